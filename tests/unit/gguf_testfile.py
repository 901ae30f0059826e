"""A minimal GGUF writer for tests, written independently of the reader under test.

Tests build exactly the files they need: any value type, either byte order,
versions 2 and 3, custom alignment, truncated or corrupt headers.
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path
from typing import Any, Sequence

# value type ids and struct codes
_TYPES = {"u8": (0, "B"), "i8": (1, "b"), "u16": (2, "H"), "i16": (3, "h"), "u32": (4, "I"), "i32": (5, "i"),
          "f32": (6, "f"), "bool": (7, "?"), "str": (8, None), "arr": (9, None), "u64": (10, "Q"),
          "i64": (11, "q"), "f64": (12, "d")}
# ggml type id -> (block elements, block bytes), for the types the tests use
_BLOCKS = {0: (1, 4), 1: (1, 2), 8: (32, 34), 12: (256, 144), 14: (256, 210), 30: (1, 2), 23: (256, 136)}


class Typed:
    """A metadata value with an explicit GGUF type, e.g. Typed("u64", 5) or Typed("arr", [..], "i32")."""

    def __init__(self, kind: str, value: Any, item_kind: str | None = None) -> None:
        self.kind, self.value, self.item_kind = kind, value, item_kind


def _infer(value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed("bool", value)
    if isinstance(value, int):
        return Typed("u32" if 0 <= value < 2**32 else "i64", value)
    if isinstance(value, float):
        return Typed("f32", value)
    if isinstance(value, str):
        return Typed("str", value)
    if isinstance(value, list):
        item = _infer(value[0]).kind if value else "u32"
        return Typed("arr", value, item)
    raise TypeError("cannot infer a GGUF type for %r" % (value,))


def _encode(o: str, typed: Typed) -> bytes:
    if typed.kind == "str":
        raw = typed.value.encode("utf-8") if isinstance(typed.value, str) else typed.value
        return struct.pack(o + "Q", len(raw)) + raw
    if typed.kind == "arr":
        item_kind = typed.item_kind or "u32"
        out = struct.pack(o + "IQ", _TYPES[item_kind][0], len(typed.value))
        for item in typed.value:
            if item_kind == "arr":
                out += _encode(o, item if isinstance(item, Typed) else _infer(item))
            elif item_kind == "str":
                out += _encode(o, Typed("str", item))
            else:
                out += struct.pack(o + _TYPES[item_kind][1], item)
        return out
    return struct.pack(o + _TYPES[typed.kind][1], typed.value)


def tensor_bytes(shape: Sequence[int], ggml_type: int) -> int:
    """Size of a tensor for the writer (the few types it knows)."""
    block_elems, block_bytes = _BLOCKS[ggml_type]
    count = 1
    for dim in shape:
        count *= dim
    return count // block_elems * block_bytes


def write_gguf(path: str | os.PathLike[str], metadata: dict[str, Any],
               tensors: Sequence[tuple[str, Sequence[int], int] | tuple[str, Sequence[int], int, bytes]] = (),
               version: int = 3, byteorder: str = "<", alignment: int | None = None,
               magic: bytes = b"GGUF", truncate_to: int | None = None) -> Path:
    """Write a GGUF file. Tensor data defaults to bytes derived from the tensor name (deterministic).

    ``alignment`` is the data alignment used for the layout; it is also written as
    general.alignment unless ``metadata`` already has that key.
    """
    o = byteorder
    meta = dict(metadata)
    if alignment is not None and "general.alignment" not in meta:
        meta["general.alignment"] = Typed("u32", alignment)
    align = alignment or 32
    head = magic + struct.pack(o + "I", version) + struct.pack(o + "QQ", len(tensors), len(meta))
    for key, value in meta.items():
        typed = _infer(value)
        head += _encode(o, Typed("str", key)) + struct.pack(o + "I", _TYPES[typed.kind][0]) + _encode(o, typed)
    blobs = []
    offset = 0
    infos = b""
    for spec in tensors:
        name, shape, ggml_type = spec[0], spec[1], spec[2]
        data = spec[3] if len(spec) > 3 else random.Random(name).randbytes(tensor_bytes(shape, ggml_type))
        infos += _encode(o, Typed("str", name)) + struct.pack(o + "I", len(shape))
        infos += struct.pack(o + "%dQ" % len(shape), *shape) + struct.pack(o + "IQ", ggml_type, offset)
        blobs.append((offset, data))
        offset += -(-len(data) // align) * align
    body = head + infos
    body += bytes(-len(body) % align)
    data_start = len(body)
    out = bytearray(body)
    for rel, data in blobs:
        out += bytes(data_start + rel - len(out))
        out += data
    if truncate_to is not None:
        out = out[:truncate_to]
    path = Path(path)
    path.write_bytes(bytes(out))
    return path


def llama_meta(**extra: Any) -> dict[str, Any]:
    """A small llama model's metadata (2 layers, 64 wide, 8 heads, 2 KV heads), ``extra`` keys set (None: left out)."""
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.context_length": 4096,
        "llama.attention.head_count": 8,
        "llama.attention.head_count_kv": 2,
        "tokenizer.ggml.tokens": ["t%d" % i for i in range(100)],
    }
    meta.update(extra)
    return {k: v for k, v in meta.items() if v is not None}


def llama_tensors(tied: bool = False) -> list[tuple[str, tuple[int, ...], int]]:
    """Its tensors: embedding, rope factors, two layers, a stray blk.2 tensor, output norm and (untied) output."""
    f32, f16, q8_0 = 0, 1, 8  # ggml types
    tensors = [("token_embd.weight", (64, 100), f16), ("rope_freqs.weight", (4,), f32)]
    for layer in range(2):
        tensors += [("blk.%d.attn_q.weight" % layer, (64, 64), f16),
                    ("blk.%d.attn_norm.weight" % layer, (64,), f32)]
    tensors += [("blk.2.nextn.weight", (64, 2), f16), ("output_norm.weight", (64,), f32)]
    if not tied:
        tensors.append(("output.weight", (64, 100), q8_0))
    return tensors
