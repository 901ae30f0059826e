"""GGUF header reader: hand-built files in every layout, error cases, and the real gemma model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.unit.gguf_testfile import Typed, llama_meta, llama_tensors, write_gguf

from llamafleet.core import gguf
from llamafleet.core.gguf import (
    ArraySummary,
    GGUFError,
    read_gguf,
    read_model,
    shard_paths,
    tensor_nbytes,
)
from tests.unit.needs import LAB_MODEL, needs_lab_model

F32, F16, Q8_0, Q4_K, Q6_K, BF16, IQ4_XS = 0, 1, 8, 12, 14, 30, 23


@pytest.mark.parametrize(
    ("shape", "ggml_type", "expected"),
    [
        ((640,), F32, 2560),
        ((2560, 2560), F16, 13107200),
        ((2560, 2560), BF16, 13107200),
        ((640, 262144), Q8_0, 178257920),  # gemma-3-270m token_embd.weight
        ((1024, 640), Q4_K, 368640),  # gemma-3-270m blk.0.attn_output.weight
        ((2048, 640), Q6_K, 1075200),
        ((4096, 4096), gguf.GGML_TYPE_IDS["IQ2_XXS"], 4096 * 16 * 66),
        ((4096, 14336), IQ4_XS, 4096 * 14336 // 256 * 136),
        ((4096, 32), gguf.GGML_TYPE_IDS["MXFP4"], 4096 * 32 // 32 * 17),
        ((5120, 8), gguf.GGML_TYPE_IDS["TQ1_0"], 5120 * 8 // 256 * 54),
        ((64, 2, 3, 4), Q8_0, 64 * 24 // 32 * 34),
        ((), F32, 4),
    ],
)
def test_tensor_nbytes(shape: tuple[int, ...], ggml_type: int, expected: int) -> None:
    assert tensor_nbytes(shape, ggml_type) == expected


@pytest.mark.parametrize(
    ("shape", "ggml_type", "message"),
    [
        ((100, 4), Q4_K, "not a multiple of the Q4_K block size 256"),
        ((16,), 4, "unknown ggml type 4"),  # Q4_2: removed from ggml
        ((16,), 99, "unknown ggml type 99"),
    ],
)
def test_tensor_nbytes_rejects(shape: tuple[int, ...], ggml_type: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tensor_nbytes(shape, ggml_type)


def test_every_type_has_a_positive_block() -> None:
    for type_id, (name, elems, size) in gguf.GGML_TYPES.items():
        assert elems >= 1 and size >= 1, name
        assert gguf.GGML_TYPE_IDS[name] == type_id


METADATA = {
    "general.architecture": "llama",
    "general.name": "tiny \u00e9",
    "u8": Typed("u8", 255),
    "i8": Typed("i8", -5),
    "u16": Typed("u16", 65535),
    "i16": Typed("i16", -300),
    "u32": Typed("u32", 4000000000),
    "i32": Typed("i32", -7),
    "f32": 0.5,
    "bool": True,
    "u64": Typed("u64", 2**40),
    "i64": Typed("i64", -(2**40)),
    "f64": Typed("f64", 1.25),
    "ints": Typed("arr", [1, 2, 3], "i32"),
    "words": ["a", "bc", ""],
    "nested": Typed("arr", [Typed("arr", [1, 2], "u8"), Typed("arr", [3], "u8")], "arr"),
}
TENSORS = [
    ("token_embd.weight", (64, 10), F16),
    ("blk.0.attn_norm.weight", (64,), F32),
    ("blk.0.ffn_up.weight", (256, 3), Q4_K),
]


@pytest.mark.parametrize(
    ("version", "byteorder", "alignment"),
    [(3, "<", None), (2, "<", None), (3, ">", None), (3, "<", 64), (2, ">", 128), (3, "<", 1)],
)
def test_reads_metadata_and_tensor_table(tmp_path: Path, version: int, byteorder: str, alignment: int | None) -> None:
    path = write_gguf(tmp_path / "m.gguf", METADATA, TENSORS, version=version, byteorder=byteorder,
                      alignment=alignment)
    parsed = read_gguf(path)
    assert parsed.version == version
    assert parsed.byteorder == ("little" if byteorder == "<" else "big")
    assert parsed.alignment == (alignment or 32)
    meta = parsed.metadata
    for key in ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64", "f64"):
        assert meta[key] == METADATA[key].value, key
    assert meta["general.name"] == "tiny \u00e9"
    assert meta["f32"] == 0.5 and meta["bool"] is True
    assert meta["ints"] == [1, 2, 3] and meta["words"] == ["a", "bc", ""]
    assert meta["nested"] == [[1, 2], [3]]
    assert parsed.data_offset % parsed.alignment == 0
    assert [t.name for t in parsed.tensors] == [t[0] for t in TENSORS]
    data = path.read_bytes()
    for tensor, (name, shape, ggml_type) in zip(parsed.tensors, TENSORS):
        assert tensor.shape == shape and tensor.ggml_type == ggml_type
        assert tensor.nbytes == tensor_nbytes(shape, ggml_type)
        assert tensor.offset % parsed.alignment == 0
        # the absolute offset points at exactly the bytes the writer put there
        expected = __import__("random").Random(name).randbytes(tensor.nbytes)
        assert data[tensor.offset:tensor.offset + tensor.nbytes] == expected
    assert parsed.tensors[2].type_name == "Q4_K"
    assert parsed.file_size == len(data)


def test_long_arrays_can_be_summarised(tmp_path: Path) -> None:
    metadata = {"toks": ["x"] * 50, "scores": [0.5] * 50, "few": [1, 2],
                "nested": Typed("arr", [["a"], ["b", "c"]], "arr"), "after": "still read"}
    path = write_gguf(tmp_path / "m.gguf", metadata)
    meta = read_gguf(path, max_array_items=10).metadata
    assert meta["toks"] == ArraySummary("STRING", 50)
    assert meta["scores"] == ArraySummary("FLOAT32", 50)
    assert meta["few"] == [1, 2]
    assert meta["nested"] == [["a"], ["b", "c"]]
    assert meta["after"] == "still read"
    assert read_gguf(path, max_array_items=1).metadata["nested"] == ArraySummary("ARRAY", 2)
    assert read_gguf(path, max_array_items=1).metadata["after"] == "still read"


def _good(tmp_path: Path, **options) -> Path:
    return write_gguf(tmp_path / "bad.gguf", {"general.architecture": "llama"}, TENSORS, **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"magic": b"GGML"}, "not a GGUF file"),
        ({"version": 1}, "version 1"),
        ({"version": 4}, "unsupported GGUF version 4"),
        ({"truncate_to": 100}, "file ends inside the GGUF header|runs past the end"),
        ({"truncate_to": 30}, "more than the file can hold"),
        ({"truncate_to": -10}, r"ends at byte \d+ but the file has only \d+ bytes \(truncated"),
        ({"alignment": 48}, "not a power of two"),
    ],
)
def test_malformed_files_name_the_file(tmp_path: Path, options: dict, message: str) -> None:
    if options.get("truncate_to", 0) < 0:
        full = _good(tmp_path).stat().st_size
        options = dict(options, truncate_to=full + options["truncate_to"])
    path = _good(tmp_path, **options)
    with pytest.raises(GGUFError, match=message) as info:
        read_gguf(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([("t", (100, 2), Q4_K, b"")], "not a multiple of the Q4_K block size"),
        ([("t", (16,), 77, b"")], "unknown ggml type 77"),
        ([("t", (1, 1, 1, 1, 1), F32, b"\0" * 4)], "5 dimensions"),
        ([("t", (4,), F32), ("t", (4,), F32)], "duplicate tensor"),
    ],
)
def test_bad_tensor_entries(tmp_path: Path, tensors: list, message: str) -> None:
    path = write_gguf(tmp_path / "t.gguf", {}, tensors)
    with pytest.raises(GGUFError, match=message):
        read_gguf(path)


def test_misaligned_tensor_offset(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", {}, [("a", (3,), F32), ("b", (8,), F32)], alignment=4)
    data = bytearray(path.read_bytes())
    # declare alignment 32 in the header while the layout used 4: b's offset (12) is misaligned
    needle = b"general.alignment" + (4).to_bytes(4, "little") + (4).to_bytes(4, "little")
    index = data.index(needle) + len(needle) - 4
    data[index:index + 4] = (32).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="'b' data offset 12 is not aligned to 32"):
        read_gguf(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"\x00" * 100])
def test_tiny_or_empty_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(path)


def test_missing_file() -> None:
    with pytest.raises(GGUFError, match="/nonexistent/m.gguf: cannot read GGUF file"):
        read_gguf("/nonexistent/m.gguf")


def test_absurd_counts_are_rejected_fast(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**60).to_bytes(8, "little") + bytes(16))
    with pytest.raises(GGUFError, match="more than the file can hold"):
        read_gguf(path)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("/m/model.gguf", ["/m/model.gguf"]),
        ("/m/x-00002-of-00003.gguf", ["/m/x-00001-of-00003.gguf", "/m/x-00002-of-00003.gguf",
                                      "/m/x-00003-of-00003.gguf"]),
        ("rel-00001-of-00001.gguf", ["rel-00001-of-00001.gguf"]),
        ("/m/x-0001-of-0003.gguf", ["/m/x-0001-of-0003.gguf"]),  # not llama.cpp's %05d naming
    ],
)
def test_shard_paths(name: str, expected: list[str]) -> None:
    assert shard_paths(name) == expected


def _split(tmp_path: Path, count: int = 3, skip: int | None = None) -> list[Path]:
    paths = []
    for number in range(count):
        if number == skip:
            continue
        meta: dict = {"split.no": Typed("u16", number), "split.count": Typed("u16", count)}
        if number == 0:
            meta = {"general.architecture": "llama", **meta}
        tensors = [("blk.%d.ffn_up.weight" % number, (64, 4), F16)]
        paths.append(write_gguf(tmp_path / ("m-%05d-of-%05d.gguf" % (number + 1, count)), meta, tensors))
    return paths


def test_split_model_from_any_shard_name(tmp_path: Path) -> None:
    paths = _split(tmp_path)
    for given in (str(paths[0]), str(paths[2]), [str(paths[1])]):
        model = read_model(given)
        assert model.paths == [str(p) for p in paths]
        assert [t.name for t in model.tensors] == ["blk.0.ffn_up.weight", "blk.1.ffn_up.weight",
                                                   "blk.2.ffn_up.weight"]
        assert [t.path for t in model.tensors] == [str(p) for p in paths]
        assert model.metadata["general.architecture"] == "llama"
        assert model.file_bytes == sum(p.stat().st_size for p in paths)


def test_split_model_list_in_any_order(tmp_path: Path) -> None:
    paths = _split(tmp_path)
    model = read_model([paths[2], paths[0], paths[1]])
    assert model.paths == [str(p) for p in paths]


def test_split_model_missing_shard(tmp_path: Path) -> None:
    paths = _split(tmp_path, skip=1)
    with pytest.raises(GGUFError, match="m-00002-of-00003.gguf: cannot read"):
        read_model(paths[0])
    with pytest.raises(GGUFError, match="split.count is 3 but 2 shard files were given"):
        read_model(paths)


def test_lone_shard_without_the_naming_pattern(tmp_path: Path) -> None:
    paths = _split(tmp_path, count=2)
    renamed = tmp_path / "renamed.gguf"
    os.rename(paths[0], renamed)
    with pytest.raises(GGUFError, match="renamed.gguf: is shard 0 of a 2-file split model"):
        read_model(renamed)


def test_same_shard_twice(tmp_path: Path) -> None:
    paths = _split(tmp_path, count=2)
    with pytest.raises(GGUFError, match="both are shard split.no=0"):
        read_model([paths[0], paths[0]])


# Recorded with the gguf package's GGUFReader (gguf 0.19) on the same file: name, type, offset, bytes.
GEMMA_TENSORS = [
    ("output_norm.weight", F32, 6525120, 2560),
    ("token_embd.weight", Q8_0, 6527680, 178257920),
    ("blk.0.attn_k.weight", 6, 184785600, 112640),
    ("blk.17.ffn_up.weight", 6, 252206784, 901120),
    ("blk.17.post_attention_norm.weight", F32, 253107904, 2560),
    ("blk.17.post_ffw_norm.weight", F32, 253110464, 2560),
]


@needs_lab_model()
def test_real_gemma_tensor_table() -> None:
    ours = read_gguf(LAB_MODEL, max_array_items=0)
    assert ours.version == 3 and ours.alignment == 32 and ours.data_offset == 6525120
    assert ours.metadata["tokenizer.ggml.tokens"] == ArraySummary("STRING", 262144)
    by_name = {t.name: t for t in ours.tensors}
    for name, ggml_type, offset, nbytes in GEMMA_TENSORS:
        tensor = by_name[name]
        assert (tensor.ggml_type, tensor.offset, tensor.nbytes) == (ggml_type, offset, nbytes), name
    assert sum(t.nbytes for t in ours.tensors) == 246587904
    types = sorted({t.type_name for t in ours.tensors})
    assert types == ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    last = max(ours.tensors, key=lambda t: t.offset)
    assert last.offset + last.nbytes == ours.file_size


# --- parsing from the first bytes (an HTTP range) ------------------------------------------------


def test_prefix_parse_asks_for_more_until_the_tensor_table_is_read(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_meta(), llama_tensors())
    data = path.read_bytes()
    whole = read_gguf(path, max_array_items=10)
    parsed_from = None
    for cut in range(whole.data_offset + 1):
        try:
            header = gguf.read_gguf_prefix(data[:cut], "model_files[0]", len(data), max_array_items=10)
        except gguf.GGUFIncomplete as more:
            # asks for bytes past the cut, never past the header; once parsed, longer prefixes parse too
            assert parsed_from is None and cut < more.needed <= whole.data_offset, (cut, more.needed)
            continue
        parsed_from = cut if parsed_from is None else parsed_from
        assert (header.data_offset, header.file_size) == (whole.data_offset, len(data))
        assert [(t.name, t.offset, t.nbytes) for t in header.tensors] == [
            (t.name, t.offset, t.nbytes) for t in whole.tensors]
    assert parsed_from is not None and parsed_from > 8
    assert gguf.data_end(header) == gguf.data_end(whole) == len(data)
    # unknown size: the same header, the size is what was read
    assert gguf.read_gguf_prefix(data[:whole.data_offset], "m", None).file_size == whole.data_offset


def test_prefix_of_a_file_cut_inside_its_header_is_an_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_meta(), llama_tensors())
    data = path.read_bytes()[:300]
    with pytest.raises(GGUFError, match=r"^model_files\[0\]: (file ends inside the GGUF header|string of \d+ bytes "
                                        r"runs past the end of the file)") as info:
        gguf.read_gguf_prefix(data, "model_files[0]", len(data))
    assert not isinstance(info.value, gguf.GGUFIncomplete)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        gguf.read_gguf_prefix(b"<!DOCTYPE html>", "x", 15)


def test_data_end_of_a_truncated_file_is_past_its_size(tmp_path: Path) -> None:
    full = write_gguf(tmp_path / "full.gguf", llama_meta(), llama_tensors())
    cut = full.stat().st_size // 2
    data = full.read_bytes()[:cut]
    header = gguf.read_gguf_prefix(data, "m", cut)
    assert gguf.data_end(header) == full.stat().st_size > cut
    # read from disk the same file is refused by its first short tensor
    (tmp_path / "cut.gguf").write_bytes(data)
    with pytest.raises(GGUFError, match="but the file has only %d bytes" % cut):
        read_gguf(tmp_path / "cut.gguf")


def test_data_end_without_tensors_is_the_header(tmp_path: Path) -> None:
    header = read_gguf(write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}))
    assert gguf.data_end(header) == header.data_offset
