"""gguf_facts: the split planner's facts about a model, from GGUF headers written here and the lab model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.gguf_testfile import Typed, llama_meta, llama_tensors, write_gguf
from llamafleet.core.gguf import GGUFError
from llamafleet.core.gguf_facts import architecture, model_facts
from tests.unit.needs import LAB_MODEL, needs_lab_model


def test_model_facts_untied(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_meta(), llama_tensors())
    facts = model_facts(str(path))
    layer = 64 * 64 * 2 + 64 * 4
    assert facts == {
        "arch": "llama",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 8,
        "n_head_kv": 2,
        "n_embd_k_gqa": [16, 16],  # head dim 64/8 = 8, times 2 KV heads
        "n_embd_v_gqa": [16, 16],
        "n_ctx_train": 4096,
        "layer_bytes": [layer, layer],
        "output_bytes": 64 * 4 + 100 * 2 * 34,
        "token_embd_bytes": 64 * 100 * 2,
        "other_bytes": 16 + 64 * 2 * 2,  # rope_freqs + blk.2 beyond n_layer
        "total_tensor_bytes": 2 * layer + 64 * 4 + 6800 + 12800 + 16 + 256,
        "file_bytes": path.stat().st_size,
        "tensor_count": 9,
        "kv_bytes_per_token_f16": 2 * (16 + 16) * 2,
        "sliding_window": None,
    }


def test_model_facts_tied_embeddings_count_token_embd_as_output(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_meta(), llama_tensors(tied=True))
    facts = model_facts(path)
    assert facts["output_bytes"] == 64 * 4 + 12800
    assert facts["token_embd_bytes"] == 12800
    assert facts["other_bytes"] == 16 + 256
    assert facts["total_tensor_bytes"] == sum(facts["layer_bytes"]) + 256 + 12800 + facts["other_bytes"]


@pytest.mark.parametrize(
    ("extra", "k", "v", "n_head_kv"),
    [
        ({}, [16, 16], [16, 16], 2),
        ({"llama.attention.head_count_kv": None}, [64, 64], [64, 64], 8),  # MHA: kv heads = heads
        ({"llama.attention.key_length": 32, "llama.attention.value_length": 16}, [64, 64], [32, 32], 2),
        ({"llama.attention.head_count_kv": Typed("arr", [4, 0], "i32")}, [32, 0], [32, 0], 4),
        ({"llama.attention.head_count": Typed("arr", [4, 4], "u32"),
          "llama.attention.head_count_kv": Typed("arr", [1, 2], "u32")}, [16, 32], [16, 32], 2),
    ],
)
def test_model_facts_kv_widths(tmp_path: Path, extra: dict, k: list, v: list, n_head_kv: int) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_meta(**extra), llama_tensors())
    facts = model_facts(path)
    assert facts["n_embd_k_gqa"] == k and facts["n_embd_v_gqa"] == v
    assert facts["n_head_kv"] == n_head_kv
    assert facts["kv_bytes_per_token_f16"] == (sum(k) + sum(v)) * 2


@pytest.mark.parametrize(
    ("arch", "extra", "expected"),
    [
        ("llama", {}, None),
        ("llama", {"llama.attention.sliding_window": 4096}, {"n_swa": 4096, "pattern": None}),
        ("gemma3", {"gemma3.attention.sliding_window": 512}, {"n_swa": 512, "pattern": 6}),
        ("gemma3", {"gemma3.attention.sliding_window": 512, "gemma3.attention.sliding_window_pattern": 4},
         {"n_swa": 512, "pattern": 4}),
        ("gemma3", {"gemma3.attention.sliding_window": 512,
                    "gemma3.attention.sliding_window_pattern": [True, False]},
         {"n_swa": 512, "pattern": [True, False]}),
    ],
)
def test_model_facts_sliding_window(tmp_path: Path, arch: str, extra: dict, expected: dict | None) -> None:
    meta = {k.replace("llama.", arch + "."): v for k, v in llama_meta().items()}
    meta["general.architecture"] = arch
    meta.update(extra)
    path = write_gguf(tmp_path / "m.gguf", meta, llama_tensors())
    assert model_facts(path)["sliding_window"] == expected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"general.architecture": None}, "general.architecture is missing"),
        ({"llama.block_count": None}, "llama.block_count is missing"),
        ({"llama.embedding_length": "wide"}, "llama.embedding_length is 'wide', expected an integer"),
        ({"llama.attention.head_count_kv": Typed("arr", [1, 2, 3], "u32")}, "array of 3 values, expected 2"),
    ],
)
def test_model_facts_missing_keys(tmp_path: Path, extra: dict, message: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", llama_meta(**extra), llama_tensors())
    with pytest.raises(GGUFError, match=message) as info:
        model_facts(path)
    assert str(path) in str(info.value)


def test_model_facts_split_model(tmp_path: Path) -> None:
    meta0 = llama_meta(**{"split.no": Typed("u16", 0), "split.count": Typed("u16", 2)})
    tensors = llama_tensors()
    first = write_gguf(tmp_path / "s-00001-of-00002.gguf", meta0, tensors[:4])
    second = write_gguf(tmp_path / "s-00002-of-00002.gguf",
                        {"split.no": Typed("u16", 1), "split.count": Typed("u16", 2)}, tensors[4:])
    whole = write_gguf(tmp_path / "whole.gguf", llama_meta(), tensors)
    split_facts = model_facts(first)
    whole_facts = model_facts(whole)
    assert split_facts["file_bytes"] == first.stat().st_size + second.stat().st_size
    for key in ("layer_bytes", "output_bytes", "token_embd_bytes", "other_bytes", "total_tensor_bytes",
                "tensor_count", "kv_bytes_per_token_f16"):
        assert split_facts[key] == whole_facts[key], key


@needs_lab_model()
def test_real_gemma_model_facts() -> None:
    facts = model_facts(str(LAB_MODEL))
    assert facts["arch"] == "gemma3"
    assert facts["tensor_count"] == 236
    assert facts["token_embd_bytes"] == 178257920
    assert facts["n_layer"] == 18 and len(facts["layer_bytes"]) == 18
    assert facts["n_embd"] == 640 and facts["n_head"] == 4 and facts["n_head_kv"] == 1
    assert facts["n_embd_k_gqa"] == [256] * 18 and facts["n_embd_v_gqa"] == [256] * 18
    assert facts["kv_bytes_per_token_f16"] == 18 * 512 * 2
    assert facts["n_ctx_train"] == 32768
    # tied embeddings: the output layer is output_norm plus token_embd
    assert facts["output_bytes"] == 640 * 4 + 178257920
    assert facts["file_bytes"] == 253113024
    assert facts["sliding_window"] == {"n_swa": 512, "pattern": 6}
    assert facts["total_tensor_bytes"] == sum(facts["layer_bytes"]) + 2560 + 178257920 + facts["other_bytes"]


@pytest.mark.parametrize(("metadata", "message"), [
    ({"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64}, None),
    ({"general.architecture": "gemma9", "gemma3.block_count": 2, "gemma3.embedding_length": 64},
     "m: required metadata keys gemma9.block_count and gemma9.embedding_length are missing for "
     "general.architecture 'gemma9': an architecture the planner does not know"),
    ({"general.architecture": "llama", "llama.block_count": 2},
     "m: required metadata key llama.embedding_length is missing for general.architecture 'llama'"),
    ({"general.name": "x"}, "m: required metadata key general.architecture is missing"),
    ({"general.architecture": 7}, "m: required metadata key general.architecture is missing"),
])
def test_architecture(metadata: dict, message: str | None) -> None:
    if message is None:
        assert architecture(metadata, "m") == "llama"
    else:
        with pytest.raises(GGUFError) as info:
            architecture(metadata, "m")
        assert str(info.value).startswith(message)
