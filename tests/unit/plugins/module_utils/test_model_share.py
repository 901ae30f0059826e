"""The model's manifest and each worker's share of it, on a synthetic llama model and the lab model (gemma-3,
tied embeddings)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from llamafleet.core import model_share as ms
from llamafleet.core.checksum import sha256_hex
from llamafleet.core.fnv import hash_ranges, hash_ranges_python
from llamafleet.core.gguf import read_model
from llamafleet.core.split_units import assign_layers
from tests.unit.needs import LAB_MODEL, needs_lab_model

THRESHOLD = 100_000  # the synthetic model's attention (128 KiB) and FFN (256 KiB) matrices are over it


def _worker(host: str, last: int, devices: int = 1) -> dict:
    return {"host": host, "address": "10.9.0.%d" % last, "port": 50052, "devices": [{}] * devices}


WORKERS = [_worker("w1", 1), _worker("w2", 2)]
RPC = ["10.9.0.1:50052", "10.9.0.2:50052"]


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("numpy")
    from llamafleet.bench.synth import SynthSpec, write_model

    path = tmp_path_factory.mktemp("synth") / "synth.gguf"
    write_model(path, SynthSpec(layers=4, hidden=256, ffn=512, heads=4, kv_heads=4, context=256))
    manifest = ms.build_manifest([str(path)], [sha256_hex(path)], THRESHOLD, hash_ranges_python)
    return path, manifest


def test_manifest_digests_and_cache_names_are_the_tensors_bytes(synth: tuple[Path, dict]) -> None:
    path, manifest = synth
    data = path.read_bytes()
    model = read_model([str(path)], max_array_items=0)
    assert [t["name"] for t in manifest["tensors"]] == [t.name for t in model.tensors]
    assert manifest["n_layer"] == 4 and manifest["arch"] == "llama"
    for tensor in manifest["tensors"]:
        raw = data[tensor["offset"]:tensor["offset"] + tensor["size"]]
        assert tensor["sha256"] == hashlib.sha256(raw).hexdigest()
        if tensor["size"] > THRESHOLD:
            assert tensor["cache"] == hash_ranges_python(path, [(tensor["offset"], tensor["size"])])[0]
        else:
            assert tensor["cache"] is None
    assert {t["name"] for t in manifest["tensors"] if t["cache"]} >= {"blk.0.attn_q.weight", "blk.3.ffn_up.weight",
                                                                      "output.weight", "token_embd.weight"}


def test_manifest_is_cached_beside_the_model_and_rebuilt_for_another_file(synth: tuple[Path, dict],
                                                                          tmp_path: Path) -> None:
    path, manifest = synth
    copy = tmp_path / "synth.gguf"
    copy.write_bytes(path.read_bytes())
    sha = manifest["files"][0]["sha256"]
    first, built = ms.load_or_build_manifest([str(copy)], [sha], THRESHOLD, hash_ranges_python)
    assert built and first == manifest
    cached = Path(ms.manifest_path(str(copy), THRESHOLD))
    assert json.loads(cached.read_text()) == manifest
    again, built = ms.load_or_build_manifest([str(copy)], [sha], THRESHOLD, lambda p, r: pytest.fail("hashed"))
    assert not built and again == manifest
    # another pinned file (a re-fetched model) or another threshold: built again
    other, built = ms.load_or_build_manifest([str(copy)], ["0" * 64], THRESHOLD, hash_ranges_python, write=False)
    assert built and other["files"][0]["sha256"] == "0" * 64
    assert not Path(ms.manifest_path(str(copy), 5)).exists()


def test_helper_and_python_give_the_same_manifest(synth: tuple[Path, dict], fnv_helper: str) -> None:
    path, manifest = synth
    fast = ms.build_manifest([str(path)], [manifest["files"][0]["sha256"]], THRESHOLD,
                             lambda p, r: hash_ranges(p, r, helper=fnv_helper, jobs=2))
    assert fast == manifest


def _layers(names: list[str]) -> set[str]:
    return {n.split(".")[1] if n.startswith("blk.") else n for n in names}


def test_shares_follow_llama_cpp_layer_assignment(synth: tuple[Path, dict]) -> None:
    _path, manifest = synth
    plan = {"rpc": RPC, "tensor_split": [2, 3]}
    # llama.cpp: units 0-1 on the first device, 2-3 and the output on the second
    assert assign_layers([2, 3], 4) == [0, 0, 1, 1, 1]
    shares = ms.plan_shares(manifest, plan, WORKERS)
    assert _layers(shares["w1"]) == {"0", "1"}
    assert _layers(shares["w2"]) == {"2", "3", "output.weight"}
    cached = {t["name"] for t in manifest["tensors"] if t["cache"]}
    # token_embd (untied model) stays on the orchestrator: in no share; every other cached tensor in one
    assert set(shares["w1"]) | set(shares["w2"]) == cached - {"token_embd.weight"}
    assert not set(shares["w1"]) & set(shares["w2"])


def test_several_devices_per_endpoint_and_local_gpus(synth: tuple[Path, dict]) -> None:
    _path, manifest = synth
    workers = [_worker("w1", 1, devices=2), _worker("w2", 2)]
    # devices: w1 (2), w2 (1), then one GPU of the orchestrator, which takes layer 3 and the output
    shares = ms.plan_shares(manifest, {"rpc": RPC, "tensor_split": [1, 1, 1, 2]}, workers)
    assert _layers(shares["w1"]) == {"0", "1"}
    assert _layers(shares["w2"]) == {"2"}
    # a worker out of --rpc gets nothing
    alone = ms.plan_shares(manifest, {"rpc": RPC[1:], "tensor_split": [5]}, WORKERS)
    assert alone["w1"] == [] and _layers(alone["w2"]) == {"0", "1", "2", "3", "output.weight"}


def test_fit_gives_every_worker_in_rpc_every_layer(synth: tuple[Path, dict]) -> None:
    _path, manifest = synth
    shares = ms.plan_shares(manifest, {"rpc": RPC, "tensor_split": None}, WORKERS)
    assert set(shares["w1"]) == set(shares["w2"]) == {t["name"] for t in manifest["tensors"]
                                                      if t["cache"] and t["name"] != "token_embd.weight"}


def test_degraded_plans_add_what_they_move(synth: tuple[Path, dict]) -> None:
    _path, manifest = synth
    degraded = [{"without": "w1", "fits": True, "rpc": RPC[1:], "tensor_split": [5]},
                {"without": "w2", "fits": False, "rpc": [], "tensor_split": None}]
    shares = ms.fleet_shares(manifest, {"rpc": RPC, "tensor_split": [2, 3]}, WORKERS, degraded)
    assert _layers(shares["w2"]["degraded"]) == {"0", "1"}
    assert shares["w1"]["degraded"] == []
    entries = ms.share_entries(manifest, shares["w2"]["plan"] + shares["w2"]["degraded"])
    assert len(entries) == len(shares["w2"]["plan"]) + len(shares["w2"]["degraded"])
    assert [e["offset"] for e in entries] == sorted(e["offset"] for e in entries)


def test_bad_plans_are_refused_with_what_is_wrong(synth: tuple[Path, dict]) -> None:
    _path, manifest = synth
    with pytest.raises(ms.ShareError, match="10.9.0.7:50052, which no worker serves"):
        ms.plan_shares(manifest, {"rpc": ["10.9.0.7:50052"], "tensor_split": [1]}, WORKERS)
    with pytest.raises(ms.ShareError, match="1 values for 2 RPC devices"):
        ms.plan_shares(manifest, {"rpc": RPC, "tensor_split": [1]}, WORKERS)


@needs_lab_model()
def test_lab_model_output_matrix_is_the_tied_embedding(fnv_helper: str, tmp_path: Path) -> None:
    """gemma-3-270m has no output.weight: llama.cpp loads token_embd.weight (170 MiB, its only tensor over 10 MiB)
    as the output matrix onto the device of the output layer; the layers' tensors are all under the threshold."""
    sha = sha256_hex(LAB_MODEL)
    manifest = ms.build_manifest([str(LAB_MODEL)], [sha], 10 * 1048576,
                                 lambda p, r: hash_ranges(p, r, helper=fnv_helper, jobs=2))
    assert manifest["n_layer"] == 18 and manifest["arch"] == "gemma3"
    assert [t["name"] for t in manifest["tensors"] if t["cache"]] == ["token_embd.weight"]
    # the lab's balanced plan: 18 layers on lab2, the output on lab3
    workers = [_worker("lab2", 12), _worker("lab3", 13)]
    rpc = ["10.9.0.12:50052", "10.9.0.13:50052"]
    assert ms.plan_shares(manifest, {"rpc": rpc, "tensor_split": [18, 1]}, workers) == \
        {"lab2": [], "lab3": ["token_embd.weight"]}
    assert ms.plan_shares(manifest, {"rpc": rpc[:1], "tensor_split": [19]}, workers) == \
        {"lab2": ["token_embd.weight"], "lab3": []}
    entries = ms.share_entries(manifest, ["token_embd.weight"])
    assert entries[0]["size"] == 178257920 and os.path.getsize(LAB_MODEL) > entries[0]["offset"]
