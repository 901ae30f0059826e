"""Synthetic GGUF generator: deterministic, readable by our reader, shaped as asked."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from llamafleet.core.gguf import read_gguf
from llamafleet.core.gguf_facts import model_facts
from tests.unit.needs import require

# synth writes with the gguf and numpy packages (pyproject's bench extra, in requirements/lock.txt)
require(all(importlib.util.find_spec(name) for name in ("gguf", "numpy")), "the Python packages gguf and numpy")

from llamafleet.bench import synth  # noqa: E402

SMALL = synth.SynthSpec(layers=2, hidden=64, ffn=160, heads=4, kv_heads=2, context=256, seed=3)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    first = tmp_path / "a.gguf"
    second = tmp_path / "b.gguf"
    third = tmp_path / "c.gguf"
    synth.write_model(first, SMALL)
    synth.write_model(second, SMALL)
    synth.write_model(third, synth.SynthSpec(**{**SMALL.__dict__, "seed": 4}))
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes() != third.read_bytes()
    assert first.stat().st_size == third.stat().st_size


def test_model_shape(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    summary = synth.write_model(path, SMALL)
    tokens, scores, types = synth.vocabulary()
    assert len(scores) == len(tokens)
    facts = model_facts(str(path))
    assert facts["arch"] == "llama" and facts["n_layer"] == 2 and facts["n_embd"] == 64
    assert facts["n_head"] == 4 and facts["n_head_kv"] == 2
    assert facts["n_embd_k_gqa"] == [32, 32]
    assert facts["n_ctx_train"] == 256
    assert facts["tensor_count"] == summary["tensors"] == 2 * 9 + 3
    assert facts["total_tensor_bytes"] == summary["tensor_bytes"]
    assert facts["file_bytes"] == summary["file_bytes"] == path.stat().st_size
    meta = read_gguf(path).metadata
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"] == tokens
    assert types.count(6) == 256  # every byte has a byte-fallback token
    assert "<0x0A>" in tokens


def test_default_shape_puts_almost_everything_over_the_hash_threshold() -> None:
    spec = synth.SynthSpec()
    n_vocab = len(synth.vocabulary()[0])
    sizes = []
    for dummy, shape, dtype in synth.tensor_shapes(spec, n_vocab):
        count = 1
        for dim in shape:
            count *= dim
        sizes.append(count * (2 if dtype == "f16" else 4))
    large = [s for s in sizes if s > synth.RPC_HASH_THRESHOLD]
    assert len(large) == 14
    assert sum(large) / sum(sizes) > 0.98
    assert 300e6 < sum(sizes) < 340e6


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"hidden": 65}, "multiple of heads"), ({"kv_heads": 3}, "multiple of kv_heads"), ({"layers": 0}, "positive")],
)
def test_bad_shapes(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        synth.write_model(tmp_path / "x.gguf", synth.SynthSpec(**{**SMALL.__dict__, **changes}))


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert synth.main([str(out), "--layers", "1", "--hidden", "64", "--ffn", "96", "--heads", "2",
                       "--kv-heads", "2", "--seed", "9"]) == 0
    assert out.is_file() and "0 over 10 MiB" in capsys.readouterr().out


# --- Q8_0, the 7b preset, streaming ---------------------------------------------------------------------

Q8 = synth.SynthSpec(layers=2, hidden=256, ffn=704, heads=4, kv_heads=2, context=512, seed=11, wtype="q8_0")
F32, Q8_0 = 0, 8  # ggml type ids (ggml.h)


def _q8_bytes(elements: int) -> int:
    """block_q8_0: 32 weights in 2 bytes of F16 scale + 32 int8."""
    assert elements % 32 == 0
    return elements // 32 * 34


def _expected_tensors(spec: synth.SynthSpec, n_vocab: int) -> dict[str, tuple[list[int], int]]:
    """What llama.cpp's llama loader asks for (llama-model.cpp, LLM_ARCH_LLAMA), in ggml order."""
    h, f, kv = spec.hidden, spec.ffn, spec.hidden // spec.heads * spec.kv_heads
    expected = {"token_embd.weight": ([h, n_vocab], Q8_0), "output_norm.weight": ([h], F32),
                "output.weight": ([h, n_vocab], Q8_0)}
    for i in range(spec.layers):
        expected.update({
            "blk.%d.attn_norm.weight" % i: ([h], F32), "blk.%d.ffn_norm.weight" % i: ([h], F32),
            "blk.%d.attn_q.weight" % i: ([h, h], Q8_0), "blk.%d.attn_k.weight" % i: ([h, kv], Q8_0),
            "blk.%d.attn_v.weight" % i: ([h, kv], Q8_0), "blk.%d.attn_output.weight" % i: ([h, h], Q8_0),
            "blk.%d.ffn_gate.weight" % i: ([h, f], Q8_0), "blk.%d.ffn_up.weight" % i: ([h, f], Q8_0),
            "blk.%d.ffn_down.weight" % i: ([f, h], Q8_0),
        })
    return expected


def _layer_bytes(spec: synth.SynthSpec) -> int:
    h, f, kv = spec.hidden, spec.ffn, spec.hidden // spec.heads * spec.kv_heads
    return _q8_bytes(2 * h * h + 2 * h * kv + 3 * h * f) + 2 * h * 4


def test_q8_0_same_seed_same_bytes_whatever_the_chunk_size(tmp_path: Path) -> None:
    paths = [tmp_path / ("%d.gguf" % i) for i in range(3)]
    synth.write_model(paths[0], Q8)
    synth.write_model(paths[1], Q8, chunk_bytes=1000)  # a few rows at a time
    synth.write_model(paths[2], synth.SynthSpec(**{**Q8.__dict__, "seed": 12}), chunk_bytes=1000)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    assert paths[0].stat().st_size == paths[2].stat().st_size == synth.file_bytes(Q8)
    assert not list(tmp_path.glob("*.part"))


def test_q8_0_tensors_are_what_the_llama_loader_expects(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "q8.gguf"
    summary = synth.write_model(path, Q8)
    n_vocab = len(synth.vocabulary()[0])
    gguf_file = read_gguf(path)
    expected = _expected_tensors(Q8, n_vocab)
    assert [t.name for t in gguf_file.tensors] == [t.name for t in synth.tensor_table(Q8)]
    assert {t.name: (list(t.shape), t.ggml_type) for t in gguf_file.tensors} == expected
    for tensor in gguf_file.tensors:
        count = 1
        for dim in tensor.shape:
            count *= dim
        assert tensor.nbytes == (_q8_bytes(count) if tensor.ggml_type == Q8_0 else 4 * count), tensor.name
    meta = gguf_file.metadata
    assert meta["general.file_type"] == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    assert meta["general.quantization_version"] == 2
    facts = model_facts(str(path))
    assert facts["n_layer"] == 2 and facts["n_embd"] == 256 and facts["n_head_kv"] == 2
    assert facts["layer_bytes"] == [_layer_bytes(Q8)] * 2
    assert facts["token_embd_bytes"] == _q8_bytes(256 * n_vocab)
    assert facts["output_bytes"] == _q8_bytes(256 * n_vocab) + 256 * 4
    assert facts["total_tensor_bytes"] == summary["tensor_bytes"] == synth.plan(Q8)["tensor_bytes"]
    assert facts["file_bytes"] == summary["file_bytes"] == path.stat().st_size

    # the blocks: one small finite scale, int8 quants that use the whole range; weights of std ~ scale
    raw = path.read_bytes()
    ffn = next(t for t in gguf_file.tensors if t.name == "blk.1.ffn_down.weight")
    blocks = np.frombuffer(raw, dtype=np.uint8, count=ffn.nbytes, offset=ffn.offset).reshape(-1, 34)
    scales = blocks[:, :2].copy().view("<f2").ravel().astype(np.float32)
    quants = blocks[:, 2:].view(np.int8).astype(np.float32)
    assert np.isfinite(scales).all() and np.all(scales > 0) and np.all(scales < 1e-3)
    assert quants.min() == -128 and quants.max() == 127
    weights = quants * scales[:, None]
    assert abs(float(weights.std()) - Q8.scale) < 0.002 and abs(float(weights.mean())) < 0.001
    norm = next(t for t in gguf_file.tensors if t.name == "blk.0.attn_norm.weight")
    assert np.all(np.frombuffer(raw, dtype="<f4", count=256, offset=norm.offset) == 1.0)


def test_7b_preset_is_llama2_7b_in_q8_0_and_mostly_over_the_hash_threshold() -> None:
    spec = synth.PRESETS["7b"]
    assert (spec.layers, spec.hidden, spec.ffn, spec.heads, spec.kv_heads, spec.context, spec.wtype) == (
        32, 4096, 11008, 32, 32, 4096, "q8_0")
    n_vocab = len(synth.vocabulary()[0])
    table = synth.tensor_table(spec)  # no file written
    assert {t.name: ([*t.shape][::-1], t.ggml_type) for t in table} == _expected_tensors(spec, n_vocab)
    per_layer = _layer_bytes(spec)
    assert per_layer == 215_056_384
    summary = synth.plan(spec)
    assert summary["tensor_bytes"] == 32 * per_layer + 2 * _q8_bytes(4096 * n_vocab) + 4096 * 4 == 6_885_441_536
    assert summary["large_tensors"] == 7 * 32  # every matrix of every layer; embeddings are small with 416 tokens
    assert summary["large_bytes"] == 32 * (per_layer - 2 * 4096 * 4) == 6_880_755_712
    assert summary["large_bytes"] / summary["tensor_bytes"] > 0.999
    size = synth.file_bytes(spec)
    assert 6 * 2**30 < size < 8 * 2**30
    assert summary["tensor_bytes"] < size < summary["tensor_bytes"] + 64 * 1024  # header: a few tens of kB


def test_write_memory_stays_flat(tmp_path: Path) -> None:
    import tracemalloc

    spec = synth.SynthSpec(layers=1, hidden=1024, ffn=4096, heads=8, kv_heads=8, wtype="q8_0")
    largest = max(t.nbytes for t in synth.tensor_table(spec))
    tracemalloc.start()
    try:
        summary = synth.write_model(tmp_path / "m.gguf", spec, chunk_bytes=256 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert summary["tensor_bytes"] > 15e6 and largest > 4e6
    assert peak < 2 * 1024 * 1024 < largest  # a whole-tensor writer would hold at least the largest tensor


def test_progress_reports_bytes_and_rate(tmp_path: Path) -> None:
    stream = io.StringIO()
    summary = synth.write_model(tmp_path / "p.gguf", Q8, progress=stream)
    lines = stream.getvalue().splitlines()
    total = summary["tensor_bytes"] // 10**6
    assert lines and lines[-1].startswith("synth: %d / %d MB (100%%), " % (total, total))
    assert lines[-1].endswith(" MB/s done")


def test_an_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = synth._chunks
    calls = []

    def failing(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 5:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(synth, "_chunks", failing)
    with pytest.raises(OSError, match="disk full"):
        synth.write_model(tmp_path / "x.gguf", Q8)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"hidden": 240, "heads": 4}, "multiples of the q8_0 block size 32"),
     ({"ffn": 700}, "multiples of the q8_0 block size 32"), ({"wtype": "q4_k"}, "weight type 'q4_k'")],
)
def test_bad_q8_0_shapes(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        synth.plan(synth.SynthSpec(**{**Q8.__dict__, **changes}))


def test_cli_preset_plan_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "7b.gguf"
    assert synth.main([str(out), "--preset", "7b", "--plan"]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    assert "would be %d bytes (6.41 GiB;" % synth.file_bytes(synth.PRESETS["7b"]) in printed
    assert "224 over 10 MiB holding 6880755712 bytes" in printed


def test_cli_preset_with_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "small.gguf"
    assert synth.main([str(out), "--preset", "7b", "--layers", "1", "--hidden", "256", "--ffn", "704",
                       "--heads", "4", "--kv-heads", "4", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "MB/s" in captured.out
    facts = model_facts(str(out))
    assert facts["n_layer"] == 1 and facts["n_embd"] == 256 and facts["n_ctx_train"] == 4096
    assert {t.ggml_type for t in read_gguf(out).tensors} == {F32, Q8_0}
    with pytest.raises(SystemExit):
        synth.main([str(out), "--preset", "7b", "--ffn", "11000"])
    assert "block size" in capsys.readouterr().err
