# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read the header of GGUF model files: metadata, tensor table and shard layout.

Only the header is parsed (through a read-only memory map), never the weights,
so reading a 40 GB model costs a few megabytes of I/O; :func:`read_gguf_prefix`
parses it from a file's first bytes (an HTTP range) and says when it needs more.
GGUF versions 2 and 3 are supported, in either byte order, as are split models
written by ``llama-gguf-split`` (``NAME-00001-of-00003.gguf`` ...).

The file layout, as llama.cpp's ``ggml/src/gguf.cpp`` reads it::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key | u32 value_type | value)
    tensor_count x (string name | u32 n_dims | n_dims x u64 ne | u32 ggml_type | u64 offset)
    padding up to general.alignment (default 32)
    data section: each tensor at data_start + offset

Strings are a u64 byte length followed by UTF-8 bytes, arrays a u32 item type,
a u64 count and the items.

What the split planner needs from a header (layers, widths, tensor bytes) is
computed in ``gguf_facts.py``.

Stdlib only: this file is shared by the Ansible modules (as module_utils) and
the ``llamafleet`` library (as ``llamafleet.core.gguf``).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4

# ggml type id -> (name, elements per block, bytes per block).
# Block geometry follows the block_* structs in llama.cpp's ggml/src/ggml-common.h
# (commit 0c1e570); ids 4, 5 and 31-33, 36-38 were removed from ggml and cannot
# appear in a file llama.cpp would load.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
    42: ("Q2_0", 64, 18),
}
GGML_TYPE_IDS: dict[str, int] = {info[0]: type_id for type_id, info in GGML_TYPES.items()}

# GGUF metadata value types.
VALUE_TYPE_NAMES: dict[int, str] = {
    0: "UINT8",
    1: "INT8",
    2: "UINT16",
    3: "INT16",
    4: "UINT32",
    5: "INT32",
    6: "FLOAT32",
    7: "BOOL",
    8: "STRING",
    9: "ARRAY",
    10: "UINT64",
    11: "INT64",
    12: "FLOAT64",
}
_STRING = 8
_ARRAY = 9
# struct format character of every fixed-size value type
_SCALAR_FORMATS: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}

_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(Exception):
    """A GGUF file is missing, unreadable or malformed. The message names the file."""


class GGUFIncomplete(GGUFError):
    """The bytes given end inside the header of a longer file: read at least ``needed`` bytes and parse again."""

    def __init__(self, path: str, needed: int) -> None:
        super().__init__("%s: the GGUF header goes on past the bytes read (%d needed at least)" % (path, needed))
        self.needed = needed


@dataclass(frozen=True)
class ArraySummary:
    """Stand-in for a metadata array that was skipped because it is longer than asked for."""

    item_type: str
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF tensor table.

    ``shape`` is in ggml order (``ne0`` first, the contiguous dimension); ``offset``
    is the absolute position of the tensor's first data byte in ``path``.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int
    path: str

    @property
    def type_name(self) -> str:
        """The ggml type's name, e.g. ``Q4_K``."""
        return GGML_TYPES[self.ggml_type][0]


@dataclass
class GGUFFile:
    """The parsed header of one GGUF file."""

    path: str
    version: int
    byteorder: str
    alignment: int
    data_offset: int
    file_size: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


@dataclass
class GGUFModel:
    """A model made of one GGUF file or of all the shards of a split model, in order."""

    files: list[GGUFFile]
    tensors: list[TensorInfo] = field(init=False)

    def __post_init__(self) -> None:
        self.tensors = [tensor for gguf_file in self.files for tensor in gguf_file.tensors]

    @property
    def paths(self) -> list[str]:
        """The shard paths, first shard first."""
        return [gguf_file.path for gguf_file in self.files]

    @property
    def metadata(self) -> dict[str, Any]:
        """The model's metadata: the first shard's, which carries the hyperparameters."""
        return self.files[0].metadata

    @property
    def file_bytes(self) -> int:
        """Sum of the shard file sizes."""
        return sum(gguf_file.file_size for gguf_file in self.files)

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor called ``name``, or None."""
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        return None


def tensor_nbytes(shape: Sequence[int], ggml_type: int) -> int:
    """Bytes a tensor of this shape and ggml type occupies, as ggml_nbytes computes it.

    Raises ValueError for an unknown type or a row length that is not a whole
    number of blocks.
    """
    if ggml_type not in GGML_TYPES:
        raise ValueError("unknown ggml type %d" % ggml_type)
    name, block_elems, block_bytes = GGML_TYPES[ggml_type]
    shape = tuple(shape) or (1,)
    if shape[0] % block_elems:
        raise ValueError(
            "row of %d elements is not a multiple of the %s block size %d" % (shape[0], name, block_elems))
    count = 1
    for dim in shape:
        count *= dim
    return count // block_elems * block_bytes


class _Reader:
    """Bounds-checked sequential reader over a buffer, in one byte order.

    ``buf`` is the whole file, or its first bytes when ``file_size`` is larger (None: a
    prefix of a file of unknown size): reading past ``buf`` but not past the file raises
    GGUFIncomplete, past the file GGUFError.
    """

    def __init__(self, buf: Any, path: str, order: str, file_size: int | None) -> None:
        self.buf = buf
        self.path = path
        self.order = order
        self.pos = 0
        self.size = len(buf)
        self.file_size = file_size

    def fail(self, what: str) -> GGUFError:
        return GGUFError("%s: %s (at byte %d)" % (self.path, what, self.pos))

    def need(self, end: int, what: str) -> None:
        """Raise unless the bytes up to ``end`` are in the buffer (``what``: the error past the file's end)."""
        if end <= self.size:
            return
        if self.file_size is not None and end > self.file_size:
            raise self.fail(what)
        raise GGUFIncomplete(self.path, end)

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        fmt = self.order + fmt
        end = self.pos + struct.calcsize(fmt)
        self.need(end, "file ends inside the GGUF header (truncated download?)")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos = end
        return values

    def u32(self) -> int:
        return self.unpack("I")[0]

    def u64(self) -> int:
        return self.unpack("Q")[0]

    def raw_string(self) -> bytes:
        length = self.u64()
        end = self.pos + length
        self.need(end, "string of %d bytes runs past the end of the file" % length)
        data = self.buf[self.pos:end]
        self.pos = end
        return data

    def name(self, what: str) -> str:
        raw = self.raw_string()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("%s %r is not valid UTF-8" % (what, raw[:64])) from None

    def text(self) -> str:
        return self.raw_string().decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        length = self.u64()
        self.need(self.pos + length, "string of %d bytes runs past the end of the file" % length)
        self.pos += length

    def value(self, value_type: int, max_array_items: int | None) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self.text()
        if value_type == _ARRAY:
            return self.array(max_array_items)
        raise self.fail("unknown metadata value type %d" % value_type)

    def array(self, max_array_items: int | None) -> Any:
        item_type = self.u32()
        count = self.u64()
        if item_type not in VALUE_TYPE_NAMES:
            raise self.fail("array of unknown value type %d" % item_type)
        # Every item takes at least one byte (a string at least eight): reject absurd counts early.
        if self.file_size is not None and count > self.file_size - self.pos:
            raise self.fail("array claims %d items, more than the file can hold" % count)
        if max_array_items is not None and count > max_array_items:
            self.skip_items(item_type, count)
            return ArraySummary(VALUE_TYPE_NAMES[item_type], count)
        if item_type in _SCALAR_FORMATS:
            return list(self.unpack("%d%s" % (count, _SCALAR_FORMATS[item_type])))
        if item_type == _STRING:
            return [self.text() for dummy in range(count)]
        return [self.array(max_array_items) for dummy in range(count)]

    def skip_items(self, item_type: int, count: int) -> None:
        if item_type in _SCALAR_FORMATS:
            nbytes = count * struct.calcsize(_SCALAR_FORMATS[item_type])
            self.need(self.pos + nbytes, "array of %d items runs past the end of the file" % count)
            self.pos += nbytes
        elif item_type == _STRING:
            for dummy in range(count):
                self.skip_string()
        else:
            for dummy in range(count):
                self.skip_items(self.u32(), self.u64())


def _detect_byteorder(path: str, head: bytes) -> tuple[str, int]:
    """Return (struct byte-order prefix, version) from the first 8 bytes."""
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise GGUFError("%s: not a GGUF file (starts with %r, expected %r)" % (path, bytes(head[:4]), GGUF_MAGIC))
    little = struct.unpack_from("<I", head, 4)[0]
    big = struct.unpack_from(">I", head, 4)[0]
    # A version number is small: whichever reading is small tells the byte order.
    order, version = ("<", little) if little <= 0xFFFF or big > 0xFFFF else (">", big)
    if version == 1:
        raise GGUFError("%s: GGUF version 1 (2023 format) is not supported; reconvert the model" % path)
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError("%s: unsupported GGUF version %d (supported: %s)"
                        % (path, version, ", ".join(str(v) for v in SUPPORTED_VERSIONS)))
    return order, version


def read_gguf(path: str | os.PathLike[str], max_array_items: int | None = None) -> GGUFFile:
    """Parse the header of one GGUF file.

    :param path: the file.
    :param max_array_items: metadata arrays with more items than this (tokenizer
        vocabularies have hundreds of thousands) are skipped and stored as an
        ArraySummary; None reads every array.
    :raises GGUFError: missing, truncated or malformed file; the message names it.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            if file_size < 24:
                raise GGUFError("%s: not a GGUF file (only %d bytes)" % (path, file_size))
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                gguf_file = _parse(mapped, path, file_size, max_array_items)
    except OSError as exc:
        raise GGUFError("%s: cannot read GGUF file: %s" % (path, exc.strerror or exc)) from exc
    for tensor in gguf_file.tensors:
        if tensor.offset + tensor.nbytes > file_size:
            raise GGUFError("%s: tensor %r ends at byte %d but the file has only %d bytes (truncated?)"
                            % (path, tensor.name, tensor.offset + tensor.nbytes, file_size))
    return gguf_file


def read_gguf_prefix(buf: bytes, name: str, file_size: int | None,
                     max_array_items: int | None = None) -> GGUFFile:
    """Parse the header of a GGUF file from its first bytes (an HTTP range, say).

    :param buf: the file's first bytes.
    :param name: names the file in errors (a URL, ``model_files[0]``, ...).
    :param file_size: the whole file's size, or None when unknown; ``file_size``
        of the result is this (or ``len(buf)``). Tensors are not checked against
        it: compare :func:`data_end` with it.
    :raises GGUFIncomplete: the header goes on past ``buf``: read more and call again.
    :raises GGUFError: not a GGUF file, or a malformed header.
    """
    if len(buf) < 8 and (file_size is None or file_size > len(buf)):
        raise GGUFIncomplete(name, 8)
    return _parse(buf, name, file_size, max_array_items)


def data_end(gguf_file: GGUFFile) -> int:
    """The size in bytes the header implies: the end of its last tensor's data (or of the header)."""
    return max([gguf_file.data_offset] + [t.offset + t.nbytes for t in gguf_file.tensors])


def _parse(buf: Any, path: str, file_size: int | None, max_array_items: int | None) -> GGUFFile:
    """The header in ``buf``, the whole file or (``file_size`` larger or None) its first bytes."""
    order, version = _detect_byteorder(path, buf[:8])
    reader = _Reader(buf, path, order, file_size)
    reader.pos = 8
    tensor_count = reader.u64()
    kv_count = reader.u64()
    # A key-value pair takes at least 13 bytes, a tensor entry at least 24.
    if file_size is not None and (kv_count * 13 > file_size or tensor_count * 24 > file_size):
        raise reader.fail("header claims %d metadata keys and %d tensors, more than the file can hold"
                          % (kv_count, tensor_count))

    metadata: dict[str, Any] = {}
    for dummy in range(kv_count):
        key = reader.name("metadata key")
        value_type = reader.u32()
        if key in metadata:
            raise reader.fail("duplicate metadata key %r" % key)
        metadata[key] = reader.value(value_type, max_array_items)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise GGUFError("%s: general.alignment %r is not a power of two" % (path, alignment))

    raw_tensors = []
    seen: set[str] = set()
    for dummy in range(tensor_count):
        name = reader.name("tensor name")
        if name in seen:
            raise reader.fail("duplicate tensor %r" % name)
        seen.add(name)
        n_dims = reader.u32()
        if n_dims > MAX_DIMS:
            raise reader.fail("tensor %r has %d dimensions (ggml allows %d)" % (name, n_dims, MAX_DIMS))
        shape = reader.unpack("%dQ" % n_dims) if n_dims else ()
        ggml_type = reader.u32()
        rel_offset = reader.u64()
        raw_tensors.append((name, tuple(shape), ggml_type, rel_offset))

    data_offset = -(-reader.pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, rel_offset in raw_tensors:
        try:
            nbytes = tensor_nbytes(shape, ggml_type)
        except ValueError as exc:
            raise GGUFError("%s: tensor %r: %s" % (path, name, exc)) from None
        if rel_offset % alignment:
            raise GGUFError("%s: tensor %r data offset %d is not aligned to %d"
                            % (path, name, rel_offset, alignment))
        tensors.append(TensorInfo(name, shape, ggml_type, data_offset + rel_offset, nbytes, path))

    return GGUFFile(
        path=path,
        version=version,
        byteorder="little" if order == "<" else "big",
        alignment=alignment,
        data_offset=data_offset,
        file_size=len(buf) if file_size is None else file_size,
        metadata=metadata,
        tensors=tensors,
    )


def shard_paths(path: str | os.PathLike[str]) -> list[str]:
    """All shard paths of the split model ``path`` belongs to, in order.

    ``m-00002-of-00003.gguf`` gives ``[m-00001-of-00003.gguf, m-00002-..., m-00003-...]``
    (llama.cpp's naming, ``%s-%05d-of-%05d.gguf``); any other name gives ``[path]``.
    Existence is not checked.
    """
    path = os.fspath(path)
    directory, base = os.path.split(path)
    match = _SHARD_NAME.match(base)
    if not match:
        return [path]
    count = int(match.group("count"))
    if count < 1:
        return [path]
    prefix = match.group("prefix")
    return [os.path.join(directory, "%s-%05d-of-%05d.gguf" % (prefix, number, count))
            for number in range(1, count + 1)]


ModelPaths = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]


def _as_path_list(paths: ModelPaths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return shard_paths(paths)
    result = [os.fspath(p) for p in paths]
    if not result:
        raise GGUFError("no GGUF path given")
    if len(result) == 1:
        return shard_paths(result[0])
    return result


def read_model(paths: ModelPaths, max_array_items: int | None = None) -> GGUFModel:
    """Read a whole model: one GGUF file, or every shard of a split model.

    ``paths`` is one path or a list of shard paths. A single path named like a
    shard (``*-00001-of-00004.gguf``, any of the shards) stands for all of them.
    The shards' ``split.no``/``split.count`` keys are checked: all present, each
    once, and no tensor in two shards.
    """
    return assemble_model([read_gguf(p, max_array_items) for p in _as_path_list(paths)])


def assemble_model(files: Sequence[GGUFFile]) -> GGUFModel:
    """The model made of the parsed headers ``files`` (from :func:`read_gguf`, or :func:`read_gguf_prefix` over
    HTTP ranges): one file, or the shards of a split model in any order, checked as :func:`read_model` says."""
    files = list(files)
    if not files:
        raise GGUFError("no GGUF header given")
    if len(files) == 1:
        count = files[0].metadata.get("split.count", 1)
        if isinstance(count, int) and count > 1:
            raise GGUFError("%s: is shard %s of a %d-file split model, but no other shard was given "
                            "(and its name does not follow NAME-00001-of-%05d.gguf)"
                            % (files[0].path, files[0].metadata.get("split.no", "?"), count, count))
        return GGUFModel(files)

    by_number: dict[int, GGUFFile] = {}
    for gguf_file in files:
        count = gguf_file.metadata.get("split.count")
        number = gguf_file.metadata.get("split.no")
        if not isinstance(count, int) or not isinstance(number, int):
            raise GGUFError("%s: given as a shard of a split model but has no split.count/split.no keys"
                            % gguf_file.path)
        if count != len(files):
            raise GGUFError("%s: split.count is %d but %d shard files were given"
                            % (gguf_file.path, count, len(files)))
        if number in by_number:
            raise GGUFError("%s and %s: both are shard split.no=%d"
                            % (by_number[number].path, gguf_file.path, number))
        by_number[number] = gguf_file
    missing = [n for n in range(len(files)) if n not in by_number]
    if missing:
        raise GGUFError("split model %s: shard(s) split.no=%s missing"
                        % (files[0].path, ",".join(str(n) for n in missing)))
    model = GGUFModel([by_number[n] for n in range(len(files))])
    seen: dict[str, str] = {}
    for tensor in model.tensors:
        if tensor.name in seen:
            raise GGUFError("tensor %r appears in both %s and %s" % (tensor.name, seen[tensor.name], tensor.path))
        seen[tensor.name] = tensor.path
    return model
