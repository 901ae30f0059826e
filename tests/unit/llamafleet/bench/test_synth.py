"""Synthetic GGUF generator: deterministic, readable by our reader, shaped as asked."""

from __future__ import annotations

import importlib.util
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
