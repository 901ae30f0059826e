"""split_plan: llama.cpp's device order and -ts mapping, the memory-proportional planner, its errors, election.

The reference behaviour comes from real llama-server runs (llama.cpp 0c1e570) recorded under
tests/unit/fixtures/llamacpp: see the README there.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from llamafleet.core.log_parse import (
    buffers_by_device,
    compare_with_plan,
    parse_load_log,
)
from llamafleet.core.split_plan import (
    MAX_AUTO_SLOTS,
    MAX_DEVICES,
    MIN_SHARED_SLOT_CTX,
    MIN_SLOT_CTX,
    PlanError,
    assemble_plan,
    assign_layers,
    elect_orchestrator,
    explain_plan,
    kv_bytes_per_layer,
    kv_cells,
    layers_from_split,
    model_devices,
    plan_split,
    resolve_slots,
    size_fleet,
    validate_request,
)
from llamafleet.core.split_policies import choose_split
from llamafleet.core.split_units import auto_slots
from tests.unit.needs import LAB_MODEL, needs_lab_model

MIB = 2**20
GIB = 2**30
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
GEMMA = json.loads((FIXTURES / "gemma-3-270m-q4_k_m_model_facts.json").read_text())


# --- helpers -------------------------------------------------------------------------------------

def gpu(backend: str, index: int, total: int, free: int | None = None, name: str = "", **extra: Any) -> dict:
    return {"backend": backend, "index": index, "name": name or "%s GPU %d" % (backend, index), "total_mib": total,
            "free_mib": total if free is None else free, "integrated": False, **extra}


def cpu(free: int, **extra: Any) -> dict:
    return {"backend": "cpu", "index": 0, "name": "AMD EPYC", "ggml_name": "CPU", "total_mib": free,
            "free_mib": free, "integrated": False, **extra}


def worker(host: str, *devices: dict, address: str | None = None, port: int = 50052) -> dict:
    return {"host": host, "address": address or "10.0.0.%d" % (int(host[-1]) + 10), "port": port,
            "devices": list(devices)}


def model(n_layer: int = 32, layer_mib: float = 200, output_mib: float = 400, embd_mib: float = 400,
          kv_width: int = 1024) -> dict:
    """A llama-like model: uniform layers, 1024-wide K and V per layer (8 KV heads x 128)."""
    return {
        "arch": "llama", "n_layer": n_layer, "n_embd": 4096, "n_head": 32, "n_head_kv": 8,
        "n_embd_k_gqa": [kv_width] * n_layer, "n_embd_v_gqa": [kv_width] * n_layer, "n_ctx_train": 8192,
        "layer_bytes": [int(layer_mib * MIB)] * n_layer, "output_bytes": int(output_mib * MIB),
        "token_embd_bytes": int(embd_mib * MIB), "other_bytes": 0,
        "kv_bytes_per_token_f16": n_layer * kv_width * 4, "sliding_window": None,
    }


def check_invariants(plan: dict, facts: dict) -> None:
    """What must hold for every plan: counts cover the model, llama.cpp reproduces them, nothing overflows."""
    counts = plan["tensor_split"]
    assert sum(counts) == facts["n_layer"] + 1 == plan["ngl"]
    assert layers_from_split(counts, facts["n_layer"]) == counts
    starts = [d["layers"]["start"] for d in plan["devices"]]
    assert starts == [sum(counts[:i]) for i in range(len(counts))]
    with_output = [d for d in plan["devices"] if d["layers"]["output"]]
    assert len(with_output) == 1 and with_output[0]["layers"]["end"] == facts["n_layer"] + 1
    for dev in plan["devices"]:
        assert dev["total_mib"] <= dev["usable_mib"], dev
    assert plan["device_names"] == [d["name"] for d in plan["devices"]]


# --- layers_from_split against llama.cpp -------------------------------------------------------

@pytest.mark.parametrize("split, n_layer, expected", [
    ([11, 8], 18, [11, 8]),                 # recorded: -ts 11,8 (lv4 log: KV 1 dense layer on RPC0, 2 on RPC1)
    ([1, 1, 1], 18, [7, 6, 6]),             # recorded with -lv 5
    ([0.1, 0.5, 1.3], 18, [1, 6, 12]),      # recorded with -lv 5; exact arithmetic says [1, 5, 13]
    ([13, 5, 1], 18, [13, 5, 1]),           # recorded: the planner's own split
    ([3, 1], 31, [24, 8]),
    ([0, 5, 0, 5], 9, [0, 5, 0, 5]),
    ([1], 80, [81]),
    ([24, 12, 8], 79, [44, 22, 14]),
])
def test_layers_from_split(split: list[float], n_layer: int, expected: list[int]) -> None:
    assert layers_from_split(split, n_layer) == expected


def test_fewer_gpu_layers_keep_the_first_units_on_the_cpu() -> None:
    assert assign_layers([1, 1], 5, n_gpu_layers=4) == [-1, -1, 0, 0, 1, 1]
    assert layers_from_split([1, 1], 5, n_gpu_layers=4) == [2, 2]
    assert layers_from_split([1, 1], 5, n_gpu_layers=0) == [0, 0]


@pytest.mark.parametrize("split, message", [
    ([], "empty"),
    ([1, -1], "negative"),
    ([0, 0], "all-zero"),
])
def test_layers_from_split_rejects(split: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layers_from_split(split, 10)


def test_integer_counts_always_round_trip() -> None:
    rng = random.Random(7)
    for dummy in range(2000):
        n_layer = rng.randint(1, 160)
        devices = rng.randint(1, MAX_DEVICES)
        cuts = sorted(rng.randint(0, n_layer + 1) for dummy in range(devices - 1))
        counts = [b - a for a, b in zip([0] + cuts, cuts + [n_layer + 1])]
        assert layers_from_split(counts, n_layer) == counts, (counts, n_layer)


@pytest.mark.parametrize("log_name, split", [
    ("llama-server_0c1e570_lv5_gemma270m_3dev_ts1-1-1_real.log", [1, 1, 1]),
    ("llama-server_0c1e570_lv5_gemma270m_3dev_ts0.1-0.5-1.3_real.log", [0.1, 0.5, 1.3]),
    ("llama-server_0c1e570_lv5_gemma270m_planned-13-5-1_real.log", [13, 5, 1]),
])
def test_assign_layers_matches_every_logged_layer(log_name: str, split: list[float]) -> None:
    parsed = parse_load_log((FIXTURES / log_name).read_text())
    names = [d["name"] for d in parsed["devices"]]
    logged = [names.index(parsed["layers"][il]) for il in range(GEMMA["n_layer"] + 1)]
    assert assign_layers(split, GEMMA["n_layer"]) == logged


# --- KV sizing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ctx, n_parallel, unified, expected", [
    (4096, 1, False, 4096),
    (4096, 2, False, 4096),
    (1000, 1, False, 1024),
    (1000, 3, False, 1536),
    (1000, 3, True, 1024),
    (8192, 4, False, 8192),
])
def test_kv_cells(ctx: int, n_parallel: int, unified: bool, expected: int) -> None:
    assert kv_cells(ctx, n_parallel, unified) == expected


def test_kv_per_layer_matches_the_real_log() -> None:
    # lv4 log, -c 4096 -np 2: non-SWA cache 12 MiB over 3 layers, SWA cache 30 MiB over 15 layers (1024 cells x 2)
    kv = kv_bytes_per_layer(GEMMA, 4096, 2)
    dense = [il for il in range(18) if il % 6 == 5]
    assert dense == [5, 11, 17]
    assert sum(kv[il] for il in dense) == 12 * MIB
    assert sum(kv[il] for il in range(18) if il not in dense) == 30 * MIB


@pytest.mark.parametrize("k, v, factor", [
    ("f16", None, 1.0),
    ("f32", None, 2.0),
    ("q8_0", None, 34 / 64),
    ("q4_0", "q4_0", 18 / 64),
    ("q8_0", "f16", (34 / 64 + 1) / 2),
])
def test_kv_cache_types_scale(k: str, v: str | None, factor: float) -> None:
    facts = model(n_layer=2)
    base = sum(kv_bytes_per_layer(facts, 4096, 1))
    assert sum(kv_bytes_per_layer(facts, 4096, 1, k, v)) == pytest.approx(base * factor)


def test_kv_full_context_without_swa() -> None:
    assert kv_bytes_per_layer(GEMMA, 4096, 2, swa=False) == [4 * MIB] * 18


@pytest.mark.parametrize("n_parallel, unified, cells, dense_mib, swa_mib", [
    # llama-server 0c1e570, gemma-3-270m, -c 4096 -lv 4 on the CPU: "creating ... KV cache, size = N cells"
    # and "KV buffer size" (non-SWA, then SWA)
    (1, False, 4096, 12, 15),   # -np 1
    (8, True, 4096, 12, 60),    # -np 8 -kvu: SWA layers hold n_swa x 8 + n_ubatch cells, capped at the context
    (3, False, 4608, 13.5, 45),  # -np 3 -no-kvu: 3 streams of pad(4096 / 3) = 1536 cells, "rounding down to 4608"
])
def test_kv_per_slot_layout_matches_real_runs(n_parallel: int, unified: bool, cells: int, dense_mib: float,
                                              swa_mib: float) -> None:
    kv = kv_bytes_per_layer(GEMMA, 4096, n_parallel, kv_unified=unified)
    dense = [il for il in range(18) if il % 6 == 5]
    assert kv_cells(4096, n_parallel, unified) == cells
    assert sum(kv[il] for il in dense) == dense_mib * MIB
    assert sum(kv[il] for il in range(18) if il not in dense) == swa_mib * MIB


@pytest.mark.parametrize("n_parallel", [2, 4, 8])
def test_dense_kv_is_the_same_unified_or_per_slot_when_the_context_divides(n_parallel: int) -> None:
    facts = model(n_layer=4)
    assert kv_bytes_per_layer(facts, 8192, n_parallel, kv_unified=True) == \
        kv_bytes_per_layer(facts, 8192, n_parallel, kv_unified=False) == kv_bytes_per_layer(facts, 8192, 1)


# --- slots -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctx, slots", [
    (1, 1),
    (MIN_SLOT_CTX - 1, 1),
    (MIN_SLOT_CTX, 1),
    (2 * MIN_SLOT_CTX - 1, 1),
    (2 * MIN_SLOT_CTX, 2),
    (2048, 4),
    (4095, 7),
    (MIN_SLOT_CTX * MAX_AUTO_SLOTS, MAX_AUTO_SLOTS),
    (131072, MAX_AUTO_SLOTS),
])
def test_auto_slots_one_per_min_slot_ctx_up_to_the_cap(ctx: int, slots: int) -> None:
    assert auto_slots(ctx) == auto_slots(ctx, kv_unified=False) == slots


@pytest.mark.parametrize("ctx, slots", [
    (MIN_SHARED_SLOT_CTX - 1, 1),
    (2 * MIN_SHARED_SLOT_CTX, 2),
    (1024, 8),
    (2048, 16),   # the big model's context on the lab: 16 slots, the gate keeping them within the cache
    (131072, MAX_AUTO_SLOTS),
])
def test_auto_slots_of_a_shared_cache_one_per_short_request(ctx: int, slots: int) -> None:
    assert auto_slots(ctx, kv_unified=True) == slots


@pytest.mark.parametrize("ctx, n_parallel, unified, n_ctx_train, expected", [
    (4096, 0, True, 0, (16, True, 4096)),         # auto, every request may use the whole context
    (4096, 0, False, 0, (8, True, 512)),          # auto without a unified cache: 4096 / 8
    (2048, 0, True, 32768, (16, True, 2048)),     # the big model's context on the lab
    (4096, 3, False, 0, (3, False, 1536)),        # pad(4096 / 3, 256)
    (4000, 1, True, 0, (1, False, 4096)),         # -c is padded to 256
    (1024, 4, False, 0, (4, False, 256)),         # the smallest share allowed
    (2047, 8, False, 0, (8, False, 256)),         # llama.cpp divides the padded context: 2048 / 8
    (65536, 0, True, 32768, (16, True, 32768)),   # llama-server caps a slot at the training context
    (8192, 0, True, 0, (16, True, 8192)),         # the role's default context: 16 slots
    (65536, 2, False, 16384, (2, False, 16384)),
])
def test_resolve_slots(ctx: int, n_parallel: int, unified: bool, n_ctx_train: int, expected: tuple) -> None:
    slots = resolve_slots(ctx, n_parallel, unified, n_ctx_train)
    assert (slots["n_parallel"], slots["n_parallel_auto"], slots["slot_ctx"]) == expected
    assert slots["kv_unified"] is unified


@pytest.mark.parametrize("ctx, n_parallel, share", [
    (1024, 5, 204),
    (2048, 9, 227),
    (300, 3, 512 // 3),  # -c 300 is padded to 512 first
])
def test_slots_without_a_unified_cache_need_256_tokens_each(ctx: int, n_parallel: int, share: int) -> None:
    with pytest.raises(PlanError, match=r"n_parallel \(llama_server_parallel\) %d without a unified KV cache gives "
                                        r"each slot %d of the %d tokens of ctx_size \(llama_server_ctx_size\), "
                                        r"fewer than 256: .* at least %d" % (n_parallel, share, ctx, 256 * n_parallel)):
        resolve_slots(ctx, n_parallel, False)
    assert resolve_slots(ctx, n_parallel, True)["slot_ctx"] >= ctx  # one shared cache is never too small


def test_kv_unified_must_be_a_bool() -> None:
    with pytest.raises(PlanError, match="kv_unified is 'yes', expected true or false"):
        resolve_slots(4096, 2, "yes")  # type: ignore[arg-type]


def test_plan_records_the_resolved_slots() -> None:
    fleet = [worker("w1", cpu(4000)), worker("w2", cpu(4000))]
    plan = plan_split(fleet, None, GEMMA, ctx_size=4096, n_parallel=0, kv_unified=True, compute_mib=32)
    recorded = json.loads(json.dumps(plan))  # what rpc_plan returns and the role writes to plan.json
    assert {k: recorded[k] for k in ("n_parallel", "n_parallel_auto", "kv_unified", "slot_ctx", "kv_cells")} == {
        "n_parallel": 16, "n_parallel_auto": True, "kv_unified": True, "slot_ctx": 4096, "kv_cells": 4096}
    assert plan["explanation"][1] == ("16 slots (auto: 4096 ctx / 128, at most 16), unified KV cache of 4096 tokens shared by all "
                                      "slots, up to 4096 tokens per request; the serving gate admits generations "
                                      "while their tokens fit the cache together, one without max_tokens generates "
                                      "at most 1024 (-n)")
    # the devices hold the KV cache of the resolved slots (SWA layers grow with them: 8 unified slots measured 72 MiB)
    assert plan["totals"]["kv_mib"] == round(sum(kv_bytes_per_layer(GEMMA, 4096, 16, kv_unified=True)) / MIB, 1)
    assert round(sum(kv_bytes_per_layer(GEMMA, 4096, 8, kv_unified=True)) / MIB, 1) == 72
    single = plan_split(fleet, None, GEMMA, ctx_size=4096, n_parallel=1, compute_mib=32)
    assert (single["n_parallel"], single["n_parallel_auto"], single["kv_unified"], single["totals"]["kv_mib"]) == (
        1, False, False, 27)


@pytest.mark.parametrize("ctx, n_parallel, unified, line", [
    (65536, 0, True, "16 slots (auto: 65536 ctx / 128, at most 16), unified KV cache of 65536 tokens shared by all "
                     "slots, up to 32768 tokens per request (the model's training context); the serving gate admits "
                     "generations while their tokens fit the cache together, one without max_tokens generates at "
                     "most 16384 (-n)"),
    (4096, 3, False, "3 slots, KV cache split per slot: 3 x 1536 tokens, up to 1536 tokens per request"),
    (300, 0, False, "1 slot (auto: 300 ctx / 512), KV cache of 512 tokens, up to 512 tokens per request"),
    (300, 0, True, "2 slots (auto: 300 ctx / 128), unified KV cache of 512 tokens shared by all slots, up to 512 "
                   "tokens per request; the serving gate admits generations while their tokens fit the cache "
                   "together, one without max_tokens generates at most 128 (-n)"),
    (2048, 1, True, "1 slot, KV cache of 2048 tokens, up to 2048 tokens per request"),
])
def test_explanation_of_the_slots(ctx: int, n_parallel: int, unified: bool, line: str) -> None:
    plan = plan_split([worker("w1", cpu(64000))], None, GEMMA, ctx_size=ctx, n_parallel=n_parallel,
                      kv_unified=unified, compute_mib=32)
    assert plan["explanation"][1] == line


@pytest.mark.parametrize("ctx, n_parallel, unified, setting, budget, bound", [
    (2048, 16, True, 0, 2048, 512),   # 128 per slot: what failed every request of 16 clients on the lab, now guarded
    (2048, 0, True, 0, 2048, 512),
    (8192, 16, True, 300, 8192, 300),
    (8192, 16, True, -1, 8192, 0),    # none: a generation without max_tokens runs alone in the gate
    (2048, 1, True, 0, 0, 0),         # one slot: nothing to share
    (2048, 4, False, 0, 0, 0),        # a cache split per slot: each slot owns its share
    (2048, 4, False, 100, 0, 100),
])
def test_a_shared_cache_is_guarded_by_the_gate_and_bounds_unbounded_generations(
        ctx: int, n_parallel: int, unified: bool, setting: int, budget: int, bound: int) -> None:
    plan = plan_split([worker("w1", cpu(64000))], None, GEMMA, ctx_size=ctx, n_parallel=n_parallel, kv_unified=unified,
                      compute_mib=32, max_tokens=setting)
    assert (plan["kv_budget"], plan["max_tokens"]) == (budget, bound)
    assert not [w for w in plan["warnings"] if "Context size has been exceeded" in w]


def test_slots_that_a_split_cache_cannot_hold_are_refused_by_the_planner() -> None:
    with pytest.raises(PlanError, match="llama_server_parallel.*llama_server_ctx_size"):
        plan_split([worker("w1", cpu(4000))], None, GEMMA, ctx_size=1024, n_parallel=8, kv_unified=False)


# --- device order ------------------------------------------------------------------------------

def test_device_order_rpc_first_then_local_discrete() -> None:
    devices = model_devices(
        [worker("w1", gpu("cuda", 0, 12288)), worker("w2", gpu("cuda", 0, 8192), gpu("cuda", 1, 8192))],
        {"host": "orch", "devices": [gpu("cuda", 1, 24576), gpu("cuda", 0, 24576), cpu(64000)]})
    assert [(d["name"], d["buffer_name"], d["host"]) for d in devices] == [
        ("RPC0", "RPC0[10.0.0.11:50052]", "w1"),
        ("RPC1", "RPC0[10.0.0.12:50052]", "w2"),
        ("RPC2", "RPC1[10.0.0.12:50052]", "w2"),
        ("CUDA0", "CUDA0", "orch"),
        ("CUDA1", "CUDA1", "orch"),
    ]


@pytest.mark.parametrize("local, expected", [
    ([gpu("vulkan", 0, 16000), gpu("vulkan", 1, 8000, integrated=True)], ["Vulkan0"]),
    ([gpu("vulkan", 0, 8000, integrated=True)], ["Vulkan0"]),
    ([gpu("metal", 0, 21845)], ["MTL0"]),
    ([cpu(32000)], []),
    ([], []),
])
def test_local_integrated_only_without_discrete(local: list[dict], expected: list[str]) -> None:
    devices = model_devices([worker("w1", cpu(8000))], {"host": "orch", "devices": local})
    assert [d["name"] for d in devices] == ["RPC0"] + expected


# --- the planner ---------------------------------------------------------------------------------

def test_mixed_gpu_fleet_24_12_8_without_local_gpus() -> None:
    facts = model(n_layer=40, layer_mib=400, output_mib=800)  # ~16.8 GB of weights
    plan = plan_split([worker("w1", gpu("cuda", 0, 24576)), worker("w2", gpu("cuda", 0, 12288)),
                       worker("w3", gpu("rocm", 0, 8192))], {"host": "orch", "devices": []}, facts,
                      ctx_size=8192, n_parallel=2)
    check_invariants(plan, facts)
    assert plan["rpc"] == ["10.0.0.11:50052", "10.0.0.12:50052", "10.0.0.13:50052"]
    assert plan["device_names"] == ["RPC0", "RPC1", "RPC2"]
    a, b, c = plan["tensor_split"]
    assert a > b > c > 0
    fills = [d["fill_pct"] for d in plan["devices"]]
    assert max(fills) - min(fills) < 10, fills  # proportional to usable memory
    assert plan["ngl"] == 41 and plan["orchestrator"] == "orch"
    assert plan["totals"]["weights_mib"] == 40 * 400 + 800
    assert plan["warnings"] == []


def test_orchestrator_gpu_comes_last_and_gets_the_output_layer() -> None:
    facts = model()
    plan = plan_split([worker("w1", gpu("cuda", 0, 12288)), worker("w2", gpu("cuda", 0, 8192))],
                      {"host": "orch", "devices": [gpu("cuda", 0, 24576), cpu(64000)]}, facts, ctx_size=4096)
    check_invariants(plan, facts)
    assert plan["device_names"] == ["RPC0", "RPC1", "CUDA0"]
    assert plan["rpc"] == ["10.0.0.11:50052", "10.0.0.12:50052"]
    last = plan["devices"][-1]
    assert (last["local"], last["endpoint"], last["layers"]["output"]) == (True, None, True)
    assert last["layers"]["range"].endswith("+output")


def test_cpu_only_lab_workers_capped_by_inventory() -> None:
    plan = plan_split([worker("w1", cpu(24105, max_mib=300)), worker("w2", cpu(24105, max_mib=200), cpu(24105,
                       max_mib=500))], {"host": "ctl", "devices": []}, GEMMA, ctx_size=8192, n_parallel=2,
                      compute_mib=64)
    check_invariants(plan, GEMMA)
    # The output matrix (170 MiB) fills the last device alone; 12/6 fills the first two to 33.5% and 29.5% of
    # their capacity (236 and 136 MiB), closer than 13/5 (35.8% and 25.5%), which the earlier planner chose.
    assert plan["tensor_split"] == [12, 6, 1]
    assert [d["usable_mib"] for d in plan["devices"]] == [300, 200, 500]


def test_metal_and_cuda_workers() -> None:
    facts = model(n_layer=32, layer_mib=300)
    plan = plan_split([worker("w1", {"backend": "metal", "index": 0, "name": "Apple M2 Max", "ggml_name": "MTL0",
                                     "total_mib": 49152, "free_mib": 49152, "integrated": False}),
                       worker("w2", gpu("cuda", 0, 24576))], None, facts, ctx_size=8192)
    check_invariants(plan, facts)
    assert [d["backend"] for d in plan["devices"]] == ["metal", "cuda"]
    assert plan["tensor_split"][0] > plan["tensor_split"][1]
    assert plan["orchestrator"] is None


def test_rpc_server_exposing_two_devices() -> None:
    facts = model()
    plan = plan_split([worker("w1", gpu("cuda", 0, 8192)),
                       worker("w2", gpu("cuda", 0, 12288), gpu("cuda", 1, 12288))], None, facts, ctx_size=4096)
    check_invariants(plan, facts)
    assert plan["rpc"] == ["10.0.0.11:50052", "10.0.0.12:50052"]
    assert [(d["name"], d["buffer_name"]) for d in plan["devices"]] == [
        ("RPC0", "RPC0[10.0.0.11:50052]"), ("RPC1", "RPC0[10.0.0.12:50052]"), ("RPC2", "RPC1[10.0.0.12:50052]")]


def test_share_that_would_overflow_is_capped_and_redistributed() -> None:
    # 9 layers + output of 300 MiB, no KV. Capacity shares put 1061.5 MiB on the 1150 MiB device, whose nearest
    # layer boundary (4 units = 1200 MiB) does not fit: it keeps 3 units and the rest goes to the next device.
    facts = model(n_layer=9, layer_mib=300, output_mib=300, kv_width=0)
    plan = plan_split([worker("w1", cpu(1150)), worker("w2", cpu(2100))], None, facts, ctx_size=256, compute_mib=0)
    check_invariants(plan, facts)
    assert plan["tensor_split"] == [3, 7]
    assert [d["total_mib"] for d in plan["devices"]] == [900, 2100]


def test_last_device_too_small_for_the_output_layer_gets_nothing_and_leaves_rpc() -> None:
    plan = plan_split([worker("w1", cpu(2000)), worker("w2", cpu(150))], None, GEMMA, ctx_size=1024,
                      compute_mib=16)
    check_invariants(plan, GEMMA)
    assert plan["tensor_split"] == [19]
    assert plan["rpc"] == ["10.0.0.11:50052"] and plan["device_names"] == ["RPC0"]
    assert plan["excluded"] == [{"host": "w2", "endpoint": "10.0.0.12:50052", "devices": ["RPC1"]}]
    assert plan["warnings"] == ["worker w2 (10.0.0.12:50052) gets no layers and is left out of --rpc: give it more "
                                "memory or remove it from the workers"]
    assert any(line.startswith("not in --rpc: w2 (10.0.0.12:50052)") for line in plan["explanation"])


def test_reserve_and_cap_limit_usable_memory() -> None:
    facts = model()
    plan = plan_split([worker("w1", gpu("cuda", 0, 24576, reserve_mib=2048, max_mib=16384)),
                       worker("w2", gpu("cuda", 0, 24576, free=20000, reserve_mib=1000))], None, facts,
                      ctx_size=4096)
    assert [d["usable_mib"] for d in plan["devices"]] == [16384, 19000]
    check_invariants(plan, facts)


def test_manual_split_is_checked_and_reproduced() -> None:
    facts = model()
    fleet = [worker("w1", gpu("cuda", 0, 24576)), worker("w2", gpu("cuda", 0, 24576))]
    plan = plan_split(fleet, None, facts, ctx_size=4096, tensor_split=[3, 1])
    assert plan["manual"] is True
    assert plan["tensor_split"] == [25, 8] == layers_from_split([3, 1], 32)
    check_invariants(plan, facts)


def test_manual_split_zero_for_a_device_that_has_no_memory() -> None:
    facts = model(n_layer=8, layer_mib=100)
    plan = plan_split([worker("w1", gpu("cuda", 0, 24576)), worker("w2", gpu("cuda", 0, 0))], None, facts,
                      ctx_size=1024, tensor_split=[1, 0])
    assert (plan["tensor_split"], plan["rpc"], plan["policy"]) == ([9], ["10.0.0.11:50052"], "manual")


def test_explanation_names_every_device() -> None:
    plan = plan_split([worker("w1", cpu(1000)), worker("w2", cpu(1000))], {"host": "ctl"}, GEMMA, ctx_size=2048,
                      compute_mib=64)
    text = "\n".join(plan["explanation"])
    for needle in ("gemma3: 18 layers + output = 19 units", "RPC0", "10.0.0.11:50052", "RPC1", "w2",
                   "stay in ctl's RAM"):
        assert needle in text


# --- errors --------------------------------------------------------------------------------------

def test_fleet_too_small() -> None:
    facts = model(n_layer=80, layer_mib=800, output_mib=1000)  # ~65 GB
    with pytest.raises(PlanError) as err:
        plan_split([worker("w1", gpu("cuda", 0, 24576)), worker("w2", gpu("cuda", 0, 12288))], None, facts,
                   ctx_size=8192)
    message = str(err.value)
    assert "at ctx_size 8192 needs 67.0 GiB (weights 63.5, KV 2.5, compute 1.0)" in message
    assert "the fleet has 36.0 GiB free on 2 devices, 31720 MiB short: add hosts or lower ctx_size " \
           "(llama_server_ctx_size); per device: RPC0 host w1 " in message
    assert "or shrink the KV cache (2560 MiB now: a quantized one, llama_server_cache_type q8_0, about halves it" \
        in message
    assert "llama_server_cpu_layers" not in message  # GPUs: the orchestrator's CPU is no remedy


def test_context_alone_can_make_it_too_small() -> None:
    fleet = [worker("w1", cpu(4000)), worker("w2", cpu(4000))]
    facts = model(n_layer=8, layer_mib=200, kv_width=8192)
    plan_split(fleet, None, facts, ctx_size=4096)
    with pytest.raises(PlanError, match="lower ctx_size"):
        plan_split(fleet, None, facts, ctx_size=65536)


def test_layers_that_do_not_pack() -> None:
    facts = model(n_layer=9, layer_mib=300, output_mib=300, kv_width=0)
    with pytest.raises(PlanError, match="do not pack into the devices in llama.cpp's order .*RPC0 10.0.0.11"):
        plan_split([worker("w1", cpu(1150)), worker("w2", cpu(1950))], None, facts, ctx_size=256, compute_mib=0)


def test_too_many_devices() -> None:
    fleet = [worker("w%d" % (i % 10), gpu("cuda", 0, 8192), address="10.0.1.%d" % i) for i in range(16)]
    with pytest.raises(PlanError, match="16 devices .* at most 15 .*split the fleet into clusters"):
        plan_split(fleet, None, model(), ctx_size=4096)


def test_fifteen_devices_are_fine() -> None:
    fleet = [worker("w%d" % (i % 10), gpu("cuda", 0, 8192), address="10.0.1.%d" % i) for i in range(14)]
    plan = plan_split(fleet, {"host": "orch", "devices": [gpu("cuda", 0, 8192)]}, model(), ctx_size=4096)
    assert len(plan["devices"]) == 15


@pytest.mark.parametrize("device, message", [
    (gpu("cuda", 0, 8192, free=0), r"RPC1 \(host w2, 10.0.0.12:50052, cuda GPU 0\) has no usable memory"),
    (gpu("cuda", 0, 8192, reserve_mib=9000), r"RPC1 \(host w2, .*\) has no usable memory"),
    ({"backend": "cuda", "index": 0, "name": "GB10", "total_mib": None, "free_mib": None},
     r"RPC1 \(host w2, .*GB10\) has no usable memory"),
    (gpu("cuda", 0, 8192, max_mib=300), r"RPC1 .* has 300 MiB usable, not more than its compute margin of 512"),
])
def test_device_without_usable_memory(device: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_split([worker("w1", gpu("cuda", 0, 24576)), worker("w2", device)], None, model(), ctx_size=4096)


def test_manual_split_with_the_wrong_number_of_values() -> None:
    with pytest.raises(PlanError) as err:
        plan_split([worker("w1", gpu("cuda", 0, 24576)), worker("w2", gpu("cuda", 0, 24576))],
                   {"host": "orch", "devices": [gpu("cuda", 0, 24576)]}, model(), ctx_size=4096,
                   tensor_split=[1, 1])
    assert str(err.value) == ("tensor_split: 2 values given, there are 3 devices in this order: "
                              "RPC0 10.0.0.11:50052, RPC1 10.0.0.12:50052, CUDA0 orch local")


@pytest.mark.parametrize("split, message", [
    ([1, -1], r"tensor_split\[1\] \(RPC1\) is negative"),
    ([0, 0], "all zeros"),
    ([1, "a"], r"tensor_split\[1\] \(RPC1\) is 'a', expected a number"),
    ([1, float("nan")], "expected a number"),
    ([30, 1], r"puts 32 units \(7424 MiB with KV and compute margin\) on RPC0 \(host w1, .*\), which has 4096 MiB"),
])
def test_manual_split_errors(split: list[Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_split([worker("w1", gpu("cuda", 0, 4096)), worker("w2", gpu("cuda", 0, 24576))], None, model(),
                   ctx_size=4096, tensor_split=split)


@pytest.mark.parametrize("workers, orchestrator, message", [
    ([], None, "no devices to place the model on"),
    ([worker("w1")], None, r"worker w1 \(10.0.0.11:50052\) exposes no devices"),
    ([worker("w1", cpu(8000)), worker("w2", cpu(8000), address="10.0.0.11")], None,
     "workers w1 and w2 both use endpoint 10.0.0.11:50052"),
    ([worker("w1", cpu(8000), port=70000)], None, "port 70000 is not a TCP port"),
    ([worker("w1", cpu(8000), address="fe80::1")], None, "rpc-server binds numeric IPv4 only"),
    ([{"address": "10.0.0.1", "devices": [cpu(8000)]}], None, r"workers\[0\] has no 'host'"),
    ([worker("w1", cpu(8000))], {"host": "w1", "devices": [gpu("cuda", 0, 8192)]},
     "host w1 is both a worker and the orchestrator with local GPUs"),
    ([worker("w1", cpu(8000))], {"host": "o", "devices": [gpu("cuda", 0, 8192), gpu("vulkan", 0, 8192)]},
     r"several backends \(cuda, vulkan\)"),
])
def test_fleet_errors(workers: list[dict], orchestrator: dict | None, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_split(workers, orchestrator, model(), ctx_size=4096)


def test_orchestrator_without_gpus_may_also_be_a_worker() -> None:
    plan = plan_split([worker("w1", cpu(8000))], {"host": "w1", "devices": [cpu(8000)]}, model(n_layer=8),
                      ctx_size=1024)
    assert plan["device_names"] == ["RPC0"]


@pytest.mark.parametrize("kwargs, message", [
    ({"cache_type_k": "q3_k"}, "cache_type_k is 'q3_k'; llama-server accepts f32, f16"),
    ({"cache_type_v": "fp8"}, "cache_type_v is 'fp8'"),
    ({"n_parallel": -1}, r"n_parallel is -1, expected 0 \(automatic\) or a number of slots up to 256"),
    ({"ctx_size": -1}, "ctx_size is -1"),
    ({"compute_mib": -5}, "compute_mib is -5"),
])
def test_option_errors(kwargs: dict, message: str) -> None:
    options = {"ctx_size": 4096, **kwargs}
    with pytest.raises(PlanError, match=message):
        plan_split([worker("w1", gpu("cuda", 0, 24576))], None, model(), **options)


def test_context_zero_uses_the_training_context() -> None:
    assert plan_split([worker("w1", gpu("cuda", 0, 80000))], None, model(), ctx_size=0)["ctx_size"] == 8192
    facts = dict(model(), n_ctx_train=0)
    with pytest.raises(PlanError, match="declares no training context: set ctx_size"):
        plan_split([worker("w1", gpu("cuda", 0, 80000))], None, facts, ctx_size=0)


@pytest.mark.parametrize("facts, message", [
    ({"n_layer": 2, "layer_bytes": [1, 1]}, "lack 'output_bytes'"),
    ({"n_layer": 0, "layer_bytes": [], "output_bytes": 1}, "n_layer is 0"),
    ({"n_layer": 2, "layer_bytes": [1], "output_bytes": 1}, "layer_bytes has 1 values, expected n_layer = 2"),
    ({"n_layer": 2, "layer_bytes": [1, 1], "output_bytes": 1, "n_ctx_train": 10}, "cannot size the KV cache"),
])
def test_bad_model_facts(facts: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_split([worker("w1", gpu("cuda", 0, 24576))], None, facts, ctx_size=1024)


# --- policies on the lab's shape: 4 equal CPU workers capped at 4096 MiB, gemma-3-270m, ctx 2048 ----------

def lab_workers(n: int = 4, **extra: Any) -> list[dict]:
    return [worker("w%d" % (i + 1), cpu(24105, max_mib=4096), **extra) for i in range(n)]


def lab_plan(**options: Any) -> dict:
    return plan_split(lab_workers(), {"host": "ctl", "devices": []}, GEMMA, ctx_size=2048, **options)


def test_balanced_spreads_layers_over_four_equal_workers() -> None:
    # The earlier planner placed 14, 4 and 0 layers and the output here: it rounded each device's capacity share
    # to the nearest unit boundary one device at a time, and the 170 MiB output matrix swallowed the third share.
    plan = lab_plan()
    check_invariants(plan, GEMMA)
    assert (plan["policy"], plan["tensor_split"]) == ("balanced", [6, 6, 6, 1])
    assert len(plan["rpc"]) == 4 and plan["excluded"] == [] and plan["warnings"] == []
    # the output matrix alone outweighs six layers: the three layer devices carry the same bytes within a layer
    layer_devices = [d["total_mib"] for d in plan["devices"][:3]]
    assert max(layer_devices) - min(layer_devices) < 4
    assert plan["devices"][3]["weights_mib"] == pytest.approx(GEMMA["output_bytes"] / MIB, abs=0.05)


def test_even_policy_on_four_equal_workers() -> None:
    plan = lab_plan(policy="even")
    check_invariants(plan, GEMMA)
    assert (plan["policy"], plan["tensor_split"]) == ("even", [5, 5, 5, 4])
    assert plan["tensor_split"] == layers_from_split([1, 1, 1, 1], GEMMA["n_layer"])


def test_fewest_hops_uses_one_worker_and_leaves_the_others_out_of_rpc() -> None:
    plan = lab_plan(policy="fewest_hops")
    check_invariants(plan, GEMMA)
    assert (plan["tensor_split"], plan["rpc"], plan["device_names"]) == ([19], ["10.0.0.11:50052"], ["RPC0"])
    assert [e["host"] for e in plan["excluded"]] == ["w2", "w3", "w4"]
    assert plan["warnings"] == []  # leaving workers out is what fewest_hops is for
    assert sum(line.startswith("not in --rpc:") for line in plan["explanation"]) == 3


def test_fewest_hops_prefers_the_worker_with_most_memory_and_keeps_rpc_order() -> None:
    facts = model(n_layer=8, layer_mib=200, output_mib=200, kv_width=0)  # 1800 MiB
    fleet = [worker("w1", cpu(1000)), worker("w2", cpu(1500)), worker("w3", cpu(1200))]
    plan = plan_split(fleet, None, facts, ctx_size=256, compute_mib=0, policy="fewest_hops")
    check_invariants(plan, facts)
    assert plan["rpc"] == ["10.0.0.12:50052", "10.0.0.13:50052"]
    assert [d["host"] for d in plan["devices"]] == ["w2", "w3"]


def test_fewest_hops_with_a_local_gpu_that_holds_the_model_needs_no_rpc() -> None:
    plan = plan_split(lab_workers(2), {"host": "ctl", "devices": [gpu("cuda", 0, 8192)]}, GEMMA, ctx_size=2048,
                      policy="fewest_hops")
    assert (plan["rpc"], plan["device_names"], plan["tensor_split"]) == ([], ["CUDA0"], [19])


def test_fit_leaves_the_split_to_llama_cpp() -> None:
    plan = lab_plan(policy="fit")
    assert (plan["policy"], plan["tensor_split"], plan["ngl"], plan["tensor_split_arg"]) == ("fit", None, None, "")
    assert len(plan["rpc"]) == 4 and plan["excluded"] == []
    assert all(d["layers"] is None and d["total_mib"] is None for d in plan["devices"])
    assert plan["warnings"] == []
    small = plan_split([worker("w1", cpu(300))], None, GEMMA, ctx_size=2048, policy="fit")
    assert small["warnings"] == ["the model at ctx_size 2048 needs 768 MiB with KV and compute margins, the devices "
                                 "have 300 MiB usable: llama.cpp's fit will keep layers on the orchestrator's CPU"]


@pytest.mark.parametrize("rtt, per_worker, policy", [
    (None, None, "balanced"),
    (0.0, None, "balanced"),
    (5.0, None, "fewest_hops"),
    (None, [1.0, 1.0, 1.0, 1.0], "fewest_hops"),
    (None, [1.0, None, 1.0, 1.0], "balanced"),   # one link unmeasured: no estimate, no switch
    (2.0, [None, 0.0, 0.0, 0.0], "balanced"),     # fewest_hops would use w1, as far as all four together
    (3.0, [0.5], "fewest_hops"),                  # a worker's own rtt_ms wins over link_rtt_ms
])
def test_balanced_takes_fewest_hops_when_measured_round_trips_make_it_faster(
        rtt: float | None, per_worker: list[float | None] | None, policy: str) -> None:
    fleet = lab_workers()
    for w, value in zip(fleet, per_worker or []):
        if value is not None:
            w["rtt_ms"] = value
    plan = plan_split(fleet, {"host": "ctl", "devices": []}, GEMMA, ctx_size=2048, link_rtt_ms=rtt)
    assert (plan["policy"], plan["requested_policy"]) == (policy, "balanced")
    check_invariants(plan, GEMMA)
    if policy == "fewest_hops":
        assert plan["estimate"]["hops"] == 1 and len(plan["rpc"]) == 1
        own = per_worker[0] if per_worker and per_worker[0] is not None else rtt
        assert plan["estimate"]["rtt_ms"] == own
        assert any(line.startswith("balanced -> fewest_hops") for line in plan["explanation"])


# --- zero-layer devices --------------------------------------------------------------------------

def test_an_idle_worker_in_the_middle_is_dropped_and_the_rest_renamed() -> None:
    # w2's capacity (20 - 16 = 4 MiB) is less than one layer with its KV
    fleet = [worker("w1", cpu(1000)), worker("w2", cpu(20)), worker("w3", cpu(1000), cpu(1000))]
    plan = plan_split(fleet, None, GEMMA, ctx_size=1024, compute_mib=16)
    check_invariants(plan, GEMMA)
    assert plan["rpc"] == ["10.0.0.11:50052", "10.0.0.13:50052"]
    assert [(d["name"], d["buffer_name"], d["host"]) for d in plan["devices"]] == [
        ("RPC0", "RPC0[10.0.0.11:50052]", "w1"), ("RPC1", "RPC0[10.0.0.13:50052]", "w3"),
        ("RPC2", "RPC1[10.0.0.13:50052]", "w3")]
    assert plan["excluded"] == [{"host": "w2", "endpoint": "10.0.0.12:50052", "devices": ["RPC1"]}]
    assert len(plan["tensor_split"]) == 3 and 0 not in plan["tensor_split"]


def test_a_device_without_layers_on_a_used_endpoint_stays_with_zero() -> None:
    # rpc-server serves both devices of w2 or none: the tiny one keeps -ts 0 and a warning
    plan = plan_split([worker("w1", cpu(1000)), worker("w2", cpu(20), cpu(1000))], None, GEMMA, ctx_size=1024,
                      compute_mib=16)
    check_invariants(plan, GEMMA)
    assert plan["rpc"] == ["10.0.0.11:50052", "10.0.0.12:50052"] and plan["excluded"] == []
    assert plan["tensor_split"][1] == 0
    assert plan["warnings"] == ["RPC1 (host w2, 10.0.0.12:50052, AMD EPYC) gets no layers; it still takes a backend "
                                "slot: remove it or give it more memory"]


# --- the steps -----------------------------------------------------------------------------------

def test_validate_request() -> None:
    assert validate_request(GEMMA) == {"n_layer": 18, "ctx": 32768, "policy": "balanced"}
    assert validate_request(GEMMA, ctx_size=2048, policy="fit", link_rtt_ms=0)["ctx"] == 2048


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "fastest"}, "policy is 'fastest', expected one of balanced, even, fewest_hops, fit"),
    ({"link_rtt_ms": -1}, r"link_rtt_ms is -1, expected a round trip in ms \(a number >= 0\)"),
    ({"link_rtt_ms": float("nan")}, "link_rtt_ms is nan"),
    ({"link_rtt_ms": True}, "link_rtt_ms is True"),
    ({"policy": "even", "tensor_split": [1, 1]}, "tensor_split sets the split by hand and policy even"),
    ({"n_parallel": -1}, "n_parallel is -1"),
    ({"n_parallel": 257}, "n_parallel is 257"),
    ({"n_parallel": True}, "n_parallel is True"),
])
def test_validate_request_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        validate_request(GEMMA, **kwargs)


@pytest.mark.parametrize("value", ["abc", -2, float("inf")])
def test_a_worker_rtt_that_is_not_a_round_trip(value: Any) -> None:
    fleet = [dict(worker("w1", cpu(1000)), rtt_ms=value)]
    with pytest.raises(PlanError, match="worker w1: rtt_ms is .*, expected a round trip in ms"):
        plan_split(fleet, None, GEMMA, ctx_size=1024)


def test_size_fleet() -> None:
    fleet = [dict(worker("w1", cpu(1000, reserve_mib=100)), rtt_ms="1.5"), worker("w2", cpu(2000, compute_mib=8))]
    devices, sizing = size_fleet(fleet, {"host": "ctl", "devices": [gpu("cuda", 0, 4096)]}, GEMMA, 1024,
                                 compute_mib=64, link_rtt_ms=3)
    assert [(d["name"], d["usable_mib"], d["compute_mib"], d["capacity"] // MIB, d["rtt_ms"]) for d in devices] == [
        ("RPC0", 900, 64, 836, 1.5), ("RPC1", 2000, 8, 1992, 3.0), ("CUDA0", 4096, 64, 4032, 0.0)]
    assert sizing["units"] == 19 and len(sizing["costs"]) == 19
    assert sizing["costs"][-1] == GEMMA["output_bytes"]
    assert sizing["costs"][0] == GEMMA["layer_bytes"][0] + kv_bytes_per_layer(GEMMA, 1024)[0]


def test_assemble_and_explain_a_chosen_split() -> None:
    fleet = [worker("w1", cpu(1000)), worker("w2", cpu(1000)), worker("w3", cpu(1000))]
    devices, sizing = size_fleet(fleet, None, GEMMA, 1024, compute_mib=32)
    choice = {"policy": "manual", "requested": "balanced", "counts": [10, 0, 9], "estimates": {"manual": None},
              "reason": "by hand"}
    plan = assemble_plan(fleet, None, devices, sizing, choice, 1024, compute_mib=32)
    assert plan["tensor_split"] == [10, 9] and plan["device_names"] == ["RPC0", "RPC1"]
    assert plan["rpc"] == ["10.0.0.11:50052", "10.0.0.13:50052"]
    assert [d["layers"]["range"] for d in plan["devices"]] == ["0-9", "10-17+output"]
    assert plan["totals"]["compute_mib"] == 64  # only devices that hold units keep a margin
    lines, warnings = explain_plan(plan, choice, GEMMA, None, 32)
    assert lines[1] == "1 slot, KV cache of 1024 tokens, up to 1024 tokens per request"
    assert lines[3] == "by hand"
    assert "not in --rpc: w2 (10.0.0.12:50052): its devices get no units, so llama-server neither connects to it " \
           "nor waits for it at start" in lines
    assert warnings == ["worker w2 (10.0.0.12:50052) gets no layers and is left out of --rpc: give it more memory "
                        "or remove it from the workers"]


def test_plan_split_is_its_steps() -> None:
    fleet = lab_workers()
    request = validate_request(GEMMA, 2048, link_rtt_ms=1.0)
    devices, sizing = size_fleet(fleet, None, GEMMA, request["ctx"], compute_mib=512, link_rtt_ms=1.0)
    choice = choose_split(request["policy"], devices, sizing, request["ctx"])
    plan = assemble_plan(fleet, None, devices, sizing, choice, request["ctx"], compute_mib=512, link_rtt_ms=1.0)
    whole = plan_split(fleet, None, GEMMA, ctx_size=2048, link_rtt_ms=1.0)
    # plan_split adds the explanation, the keep entry and the slots' two figures for the gate and -n
    added = ("explanation", "warnings", "keep", "kv_budget", "max_tokens")
    assert {k: v for k, v in whole.items() if k not in added} == plan
    assert (whole["n_parallel"], whole["kv_budget"], whole["max_tokens"]) == (1, 0, 0)  # one slot: nothing shared
    # and what a later run needs to keep that split (split_plan.keep_deployed)
    assert whole["keep"] == {"request_key": whole["keep"]["request_key"], "counts": choice["counts"],
                             "cpu_layers": 0, "policy": choice["policy"]}


# --- the plan against what llama.cpp really did ---------------------------------------------------

def test_plan_matches_the_real_load_of_that_plan() -> None:
    # The split the planner chose when this log was recorded, given by hand (the planner now chooses 12,6,1).
    plan = plan_split([worker("w1", cpu(24105, max_mib=300), address="127.0.0.1", port=50171),
                       worker("w2", cpu(24105, max_mib=200), cpu(24105, max_mib=500), address="127.0.0.1",
                              port=50181)],
                      {"host": "ctl", "devices": []}, GEMMA, ctx_size=8192, n_parallel=2, compute_mib=64,
                      tensor_split=[13, 5, 1])
    parsed = parse_load_log((FIXTURES / "llama-server_0c1e570_lv5_gemma270m_planned-13-5-1_real.log").read_text())
    assert compare_with_plan(plan, parsed) == []
    model_buffers = buffers_by_device(parsed, "model")
    kv_buffers = buffers_by_device(parsed, "kv")
    for dev in plan["devices"]:
        assert dev["weights_mib"] == pytest.approx(model_buffers[dev["name"]], abs=0.06), dev["name"]
        assert dev["kv_mib"] == pytest.approx(kv_buffers.get(dev["name"], 0.0), abs=0.06), dev["name"]
    assert plan["host_mib"] == pytest.approx(model_buffers["CPU"], abs=0.06)  # token_embd, CPU_Mapped


def test_plan_against_the_lv4_log_of_a_manual_split() -> None:
    plan = plan_split([worker("w1", cpu(24105), address="127.0.0.1", port=50171),
                       worker("w2", cpu(24105), address="127.0.0.1", port=50172)], None, GEMMA,
                      ctx_size=4096, n_parallel=2, tensor_split=[11, 8])
    parsed = parse_load_log((FIXTURES / "llama-server_0c1e570_lv4_gemma270m_2rpc_ts11-8_real.log").read_text())
    assert compare_with_plan(plan, parsed) == []  # no per-layer lines at -lv 4: order and offload count only
    assert buffers_by_device(parsed, "model") == pytest.approx(
        {"CPU": 170.0, **{d["name"]: d["weights_mib"] for d in plan["devices"]}}, abs=0.06)
    planned_kv = {d["name"]: d["kv_mib"] for d in plan["devices"]}
    assert buffers_by_device(parsed, "kv") == pytest.approx(planned_kv, abs=0.06)


def test_compare_with_plan_reports_differences() -> None:
    plan = plan_split([worker("w1", cpu(24105), address="127.0.0.1", port=50171),
                       worker("w2", cpu(24105), cpu(24105), address="127.0.0.1", port=50181)], None, GEMMA,
                      ctx_size=1024, tensor_split=[1, 1, 2])
    parsed = parse_load_log((FIXTURES / "llama-server_0c1e570_lv5_gemma270m_3dev_ts1-1-1_real.log").read_text())
    assert compare_with_plan(plan, parsed) == ["units per device: plan [5, 5, 9], llama.cpp [7, 6, 6]"]
    reordered = dict(plan, devices=list(reversed(plan["devices"])))
    assert compare_with_plan(reordered, parsed)[0].startswith("device order: plan")


def test_compare_a_fit_plan_by_its_devices_only() -> None:
    fleet = [worker("w1", cpu(24105), address="127.0.0.1", port=50171),
             worker("w2", cpu(24105), cpu(24105), address="127.0.0.1", port=50181)]
    parsed = parse_load_log((FIXTURES / "llama-server_0c1e570_lv5_gemma270m_3dev_ts1-1-1_real.log").read_text())
    assert compare_with_plan(plan_split(fleet, None, GEMMA, ctx_size=1024, policy="fit"), parsed) == []
    two = plan_split(fleet[:1], None, GEMMA, ctx_size=1024, policy="fit")
    assert compare_with_plan(two, parsed)[0].startswith("device order: plan [('RPC0', '127.0.0.1:50171')]")


@needs_lab_model()
def test_recorded_facts_are_the_real_files() -> None:
    from llamafleet.core.gguf_facts import model_facts

    assert model_facts(str(LAB_MODEL)) == GEMMA


# --- election ------------------------------------------------------------------------------------

@pytest.mark.parametrize("hosts, pinned, expected", [
    ([{"host": "a", "devices": [gpu("cuda", 0, 12288)]}, {"host": "b", "devices": [gpu("cuda", 0, 24576)]}],
     None, "b"),
    ([{"host": "b", "devices": [gpu("cuda", 0, 12288)]}, {"host": "a", "devices": [gpu("cuda", 0, 12288)]}],
     None, "a"),
    ([{"host": "big-ram", "devices": [cpu(512000)]}, {"host": "gpu", "devices": [gpu("vulkan", 0, 4096)]}],
     None, "gpu"),
    ([{"host": "z", "devices": [cpu(1000)]}, {"host": "y", "devices": []}], None, "y"),
    ([{"host": "two", "devices": [gpu("cuda", 0, 12288), gpu("cuda", 1, 12288)]},
      {"host": "one", "devices": [gpu("cuda", 0, 20000)]}], None, "two"),
    ({"a": [gpu("cuda", 0, 8192)], "b": [gpu("cuda", 0, 8192)]}, None, "a"),
    ([{"host": "a", "devices": [gpu("cuda", 0, 12288)]}, {"host": "b", "devices": [gpu("cuda", 0, 24576)]}],
     "a", "a"),
])
def test_elect_orchestrator(hosts: Any, pinned: str | None, expected: str) -> None:
    assert elect_orchestrator(hosts, pinned=pinned) == expected


@pytest.mark.parametrize("hosts, pinned, message", [
    ([], None, "no hosts"),
    ([{"host": "a", "devices": []}], "b", "pinned orchestrator b is not one of the hosts: a"),
    ([{"devices": []}], None, r"hosts\[0\] has no 'host'"),
])
def test_elect_orchestrator_errors(hosts: Any, pinned: str | None, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        elect_orchestrator(hosts, pinned=pinned)


def test_plan_identity_ignores_memory_readings_not_what_the_plan_is() -> None:
    from llamafleet.core.split_plan import plan_identity

    dev = {"name": "RPC1", "host": "lab3", "backend": "cpu", "endpoint": "10.77.0.13:50052", "description": "AMD EPYC",
           "local": False, "layers": {"count": 1, "start": 18, "end": 19, "output": True, "range": "output"},
           "free_mib": 23268, "fill_pct": 16.7}
    base = plan_identity([dev], ["10.77.0.13:50052"], [0, 19], "balanced")
    assert len(base) == 16
    assert plan_identity([dict(dev, free_mib=20000, fill_pct=18.1)], ["10.77.0.13:50052"], [0, 19], "balanced") == base
    # the same split on a worker that became a Vulkan worker is another plan
    vulkan = dict(dev, backend="vulkan", description="llvmpipe (LLVM 19.1.7, 256 bits)")
    assert plan_identity([vulkan], ["10.77.0.13:50052"], [0, 19], "balanced") != base
    assert plan_identity([dev], ["10.77.0.13:50052"], [1, 18], "balanced") != base
