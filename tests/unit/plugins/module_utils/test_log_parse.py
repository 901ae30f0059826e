"""log_parse: real llama-server load logs (llama.cpp 0c1e570, -lv 4 and -lv 5), and their buffers against the plans
the planner made for those loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamafleet.core.log_parse import (
    buffers_against_plan,
    buffers_by_device,
    compare_with_plan,
    device_for_buffer,
    layer_counts,
    layer_ranges,
    parse_load_log,
)
from llamafleet.core.split_plan import plan_split

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
LV4 = parse_load_log((FIXTURES / "llama-server_0c1e570_lv4_gemma270m_2rpc_ts11-8_real.log").read_text())
LV5 = parse_load_log((FIXTURES / "llama-server_0c1e570_lv5_gemma270m_3dev_ts0.1-0.5-1.3_real.log").read_text())


def test_lv4_devices_offload_and_buffers() -> None:
    assert LV4["devices"] == [
        {"name": "RPC0", "description": "127.0.0.1:50171", "free_mib": 24105, "endpoint": "127.0.0.1:50171"},
        {"name": "RPC1", "description": "127.0.0.1:50172", "free_mib": 24105, "endpoint": "127.0.0.1:50172"},
    ]
    assert LV4["offloaded"] == [19, 19]
    assert LV4["load_mode"] == "mmap"
    assert LV4["layers"] == {}
    assert LV4["buffers"]["model"] == {"CPU_Mapped": 170.0, "RPC0[127.0.0.1:50171]": 39.63,
                                       "RPC0[127.0.0.1:50172]": 195.53}
    # two KV caches (dense and sliding-window layers) add up per buffer
    assert LV4["buffers"]["kv"] == {"RPC0[127.0.0.1:50171]": 24.0, "RPC0[127.0.0.1:50172]": 18.0}
    assert LV4["buffers"]["compute"] == {"RPC0[127.0.0.1:50171]": 33.57, "RPC0[127.0.0.1:50172]": 33.57,
                                         "CPU": 18.33}


def test_lv4_has_no_layer_lines() -> None:
    with pytest.raises(ValueError, match="-lv 5"):
        layer_counts(LV4)


def test_lv5_layers_and_names_of_an_endpoint_with_two_devices() -> None:
    assert [d["name"] for d in LV5["devices"]] == ["RPC0", "RPC1", "RPC2"]
    assert [d["endpoint"] for d in LV5["devices"]] == ["127.0.0.1:50171", "127.0.0.1:50181", "127.0.0.1:50181"]
    assert layer_counts(LV5) == [1, 6, 12]
    assert layer_ranges(LV5) == {"RPC0": [0], "RPC1": list(range(1, 7)), "RPC2": list(range(7, 19))}
    # buffers name the device by its index on that server: RPC1[127.0.0.1:50181] is model device RPC2
    assert buffers_by_device(LV5, "model") == {"CPU": 170.0, "RPC0": 3.81, "RPC1": 21.34, "RPC2": 210.01}


@pytest.mark.parametrize("buffer, expected", [
    ("RPC0[127.0.0.1:50171]", "RPC0"),
    ("RPC0[127.0.0.1:50181]", "RPC1"),
    ("RPC1[127.0.0.1:50181]", "RPC2"),
    ("RPC2[127.0.0.1:50181]", None),
    ("RPC0[10.0.0.9:50052]", None),
    ("CPU_Mapped", None),
])
def test_device_for_buffer(buffer: str, expected: str | None) -> None:
    assert device_for_buffer(buffer, LV5["devices"]) == expected


def test_local_gpu_lines_and_journal_prefixes() -> None:
    text = (
        "Nov 23 12:00:01 orch llama-server[77]: llama_prepare_model_devices: using device RPC0 (10.77.0.12:50052)"
        " (unknown id) - 23604 MiB free\n"
        "Nov 23 12:00:01 orch llama-server[77]: llama_prepare_model_devices: using device CUDA0 (NVIDIA GeForce "
        "RTX 4090) (0000:01:00.0) - 23011 MiB free\n"
        "Nov 23 12:00:03 orch llama-server[77]: load_tensors: layer  40 assigned to device CUDA0, is_swa = 0\n"
        "Nov 23 12:00:03 orch llama-server[77]: load_tensors: offloaded 41/41 layers to GPU\n"
        "Nov 23 12:00:03 orch llama-server[77]: load_tensors:        CUDA0 model buffer size =  7339.58 MiB\n"
    )
    parsed = parse_load_log(text)
    assert [(d["name"], d["description"], d["endpoint"]) for d in parsed["devices"]] == [
        ("RPC0", "10.77.0.12:50052", "10.77.0.12:50052"), ("CUDA0", "NVIDIA GeForce RTX 4090", None)]
    assert parsed["layers"] == {40: "CUDA0"}
    assert buffers_by_device(parsed) == {"CUDA0": 7339.58}


def test_a_journal_with_several_loads_gives_the_last() -> None:
    first = (FIXTURES / "llama-server_0c1e570_lv5_gemma270m_3dev_ts1-1-1_real.log").read_text()
    second = (FIXTURES / "llama-server_0c1e570_lv5_gemma270m_3dev_ts0.1-0.5-1.3_real.log").read_text()
    parsed = parse_load_log(first + second)
    assert parsed["loads"] == 2
    assert layer_counts(parsed) == [1, 6, 12]
    assert parsed["buffers"]["kv"] == LV5["buffers"]["kv"]  # not summed over both loads
    assert parse_load_log(second + first)["buffers"]["model"]["RPC0[127.0.0.1:50171]"] == 25.15


def test_empty_log() -> None:
    parsed = parse_load_log("")
    assert parsed == {"devices": [], "layers": {}, "offloaded": None,
                      "buffers": {"model": {}, "kv": {}, "compute": {}, "output": {}}, "load_mode": None,
                      "loads": 0}


# --- buffers against the plan ---------------------------------------------------------------------------------------

GEMMA = json.loads((FIXTURES / "gemma-3-270m-q4_k_m_model_facts.json").read_text())
# The load of the plan below, with mmap (-lv 5) and with -lm none (-lv 4): see the fixtures' README.
CPU4_MMAP = parse_load_log((FIXTURES / "llama-server_0c1e570_lv5_gemma270m_cpu4-planned-14-1_real.log").read_text())
CPU4_NONE = parse_load_log(
    (FIXTURES / "llama-server_0c1e570_lv4_gemma270m_cpu4-planned-14-1_lm-none_real.log").read_text())


def _cpu(max_mib: int | None = None) -> dict:
    device = {"backend": "cpu", "index": 0, "name": "AMD EPYC", "ggml_name": "CPU", "total_mib": 24105,
              "free_mib": 24105, "integrated": False}
    return device if max_mib is None else dict(device, max_mib=max_mib)


def _worker(host: str, port: int, *devices: dict) -> dict:
    return {"host": host, "address": "127.0.0.1", "port": port, "devices": list(devices)}


def cpu4_plan(compute_mib: int = 64, ctx_size: int = 4096) -> dict:
    """The plan those logs loaded: 4 layers on the orchestrator's CPU, -ngl 15 -ts 14,1 over two workers."""
    plan = plan_split([_worker("w1", 50171, _cpu(300)), _worker("w2", 50181, _cpu(400))],
                      {"host": "ctl", "devices": [_cpu(400)]}, GEMMA, ctx_size=ctx_size, n_parallel=2,
                      compute_mib=compute_mib, cpu_layers=4, tensor_split=[14, 1])
    assert (plan["ngl"], plan["tensor_split"], plan["cpu"]["layers"]["count"]) == (15, [14, 1], 4)
    return plan


def test_buffers_of_a_load_with_cpu_layers_match_its_plan() -> None:
    plan = cpu4_plan()
    assert compare_with_plan(plan, CPU4_MMAP) == []
    rows, problems = buffers_against_plan(plan, CPU4_MMAP)
    assert problems == []
    assert rows == [
        {"device": "RPC0", "host": "w1", "planned_weights_mib": 50.7, "planned_kv_mib": 34.0,
         "planned_compute_mib": 64.0, "model_mib": 50.68, "kv_mib": 34.0, "compute_mib": 17.52},
        {"device": "RPC1", "host": "w2", "planned_weights_mib": 170.0, "planned_kv_mib": 0.0,
         "planned_compute_mib": 64.0, "model_mib": 170.0, "kv_mib": 0.0, "compute_mib": 2.0},
        # the input embedding (170.0) and the 4 CPU layers (14.5); CPU_Mapped spans the repacked tensors too
        {"device": "CPU", "host": "ctl", "planned_weights_mib": 184.5, "planned_kv_mib": 8.0,
         "planned_compute_mib": 64.0, "repack_mib": 2.81, "model_mib": 184.48, "kv_mib": 8.0, "compute_mib": 20.77},
    ]


def test_without_mmap_the_cpu_buffer_and_the_repacked_copies_add_up() -> None:
    assert CPU4_NONE["load_mode"] == "none"
    assert CPU4_NONE["buffers"]["model"]["CPU"] == 181.67 and CPU4_NONE["buffers"]["model"]["CPU_REPACK"] == 2.81
    rows, problems = buffers_against_plan(cpu4_plan(), CPU4_NONE)
    assert problems == []
    assert rows[-1]["model_mib"] == 184.48 and rows[-1]["repack_mib"] == 2.81


def test_a_compute_buffer_over_its_margin_and_a_kv_off_the_plan_are_named() -> None:
    rows, problems = buffers_against_plan(cpu4_plan(compute_mib=18), CPU4_MMAP)
    assert problems == [
        "CPU (ctl): compute buffer 20.8 MiB, over the plan's margin of 18.0 MiB (llama_server_compute_margin_mib)"]
    assert [row["compute_mib"] for row in rows] == [17.52, 2.0, 20.77]
    # a plan for twice the context: more KV on RPC0's dense layers; the CPU's 4 layers are sliding-window ones,
    # whose cache the window bounds
    assert buffers_against_plan(cpu4_plan(ctx_size=8192), CPU4_MMAP)[1] == [
        "RPC0 (w1): KV buffers 34.0 MiB, the plan's KV 46.0 MiB"]
    plan = cpu4_plan()
    plan["cpu"] = dict(plan["cpu"], kv_mib=8.9)  # within the tolerance (1 MiB)
    assert buffers_against_plan(plan, CPU4_MMAP)[1] == []
    plan["cpu"] = dict(plan["cpu"], kv_mib=10.0)
    assert buffers_against_plan(plan, CPU4_MMAP)[1] == ["CPU (ctl): KV buffers 8.0 MiB, the plan's KV 10.0 MiB"]


def test_model_buffers_off_the_planned_weights_are_named() -> None:
    plan = cpu4_plan()
    plan["devices"][1] = dict(plan["devices"][1], weights_mib=300.0)
    assert buffers_against_plan(plan, CPU4_MMAP)[1] == [
        "RPC1 (w2): model buffers 170.0 MiB, the plan's weights 300.0 MiB"]
    # a buffer on a device the plan does not have
    fewer = dict(plan, devices=plan["devices"][:1])
    assert "RPC1: a model buffer of 170.0 MiB on a device the plan does not name" in buffers_against_plan(
        fewer, CPU4_MMAP)[1]


def test_buffers_of_a_plan_without_cpu_layers() -> None:
    """The planner's 13,5,1 (the same load compare_with_plan checks in test_split_plan): the host keeps the input
    embedding only, and its compute buffer has no planned margin: reported, not compared."""
    plan = plan_split([_worker("w1", 50171, _cpu(300)), _worker("w2", 50181, _cpu(200), _cpu(500))],
                      {"host": "ctl", "devices": []}, GEMMA, ctx_size=8192, n_parallel=2, compute_mib=64,
                      tensor_split=[13, 5, 1])
    parsed = parse_load_log((FIXTURES / "llama-server_0c1e570_lv5_gemma270m_planned-13-5-1_real.log").read_text())
    rows, problems = buffers_against_plan(plan, parsed)
    assert problems == []
    assert rows[-1] == {"device": "CPU", "host": "ctl", "planned_weights_mib": 170.0, "planned_kv_mib": 0.0,
                        "planned_compute_mib": None, "repack_mib": 0.0, "model_mib": 170.0, "kv_mib": 0.0,
                        "compute_mib": 26.33}
    assert [row["compute_mib"] for row in rows[:-1]] == [41.57, 41.57, 2.02]


def test_a_log_without_buffer_lines_is_a_problem() -> None:
    text = "\n".join(line for line in (FIXTURES / "llama-server_0c1e570_lv4_gemma270m_2rpc_ts11-8_real.log")
                     .read_text().splitlines() if "KV buffer" not in line)
    plan = plan_split([_worker("w1", 50171, _cpu()), _worker("w2", 50172, _cpu())], None, GEMMA, ctx_size=4096,
                      n_parallel=2, tensor_split=[11, 8])
    assert buffers_against_plan(plan, parse_load_log(text)) == (
        [], ["llama.cpp's log has no KV buffer lines: run llama-server with -lv 4 or more"])
    rows, problems = buffers_against_plan(plan, LV4)
    assert problems == [] and [row["kv_mib"] for row in rows] == [24.0, 18.0, 0.0]


def test_buffers_of_the_big_model_as_the_lab_deploys_it() -> None:
    """The synthetic 7B (ctx 1024, 4 slots, q8_0 KV) with 28 layers on the CPU: every figure as planned, and the
    compute buffers of this shape far under the default 512 MiB margin."""
    facts = json.loads((FIXTURES / "synth-7b-q8_0_model_facts.json").read_text())
    plan = plan_split([_worker("w1", 50171, _cpu()), _worker("w2", 50181, _cpu())],
                      {"host": "ctl", "devices": [_cpu()]}, facts, ctx_size=1024, n_parallel=4, cache_type_k="q8_0",
                      cpu_layers=28, tensor_split=[4, 1])
    parsed = parse_load_log(
        (FIXTURES / "llama-server_0c1e570_lv4_synth7b-q8_0_cpu28-planned-4-1_real.log").read_text())
    assert compare_with_plan(plan, parsed) == []
    rows, problems = buffers_against_plan(plan, parsed)
    assert problems == []
    assert [(row["device"], row["model_mib"], row["kv_mib"], row["compute_mib"]) for row in rows] == [
        ("RPC0", 820.38, 34.0, 80.84), ("RPC1", 1.74, 0.0, 0.07), ("CPU", 5744.35, 238.0, 88.84)]
    assert [row["planned_compute_mib"] for row in rows] == [512.0, 512.0, 512.0]


# A real CUDA load (tests/device/cuda_rpc_check.sh serve, shape gpu_orchestrator, on an H200): the orchestrator's
# own CUDA0 beside a worker's CUDA rpc-server on the same GPU, with the devices gpu_facts recorded there.
H200 = json.loads((FIXTURES.parent / "gpu" / "cuda_h200_gpu_facts_real.json").read_text())
SYNTH2L = json.loads((FIXTURES / "synth2l-q8_0_model_facts.json").read_text())
CUDA_LOG = parse_load_log(
    (FIXTURES / "llama-server_0c1e570_lv5_synth2l-q8_0_cuda-h200_rpc0-cuda0_ts1-2_real.log").read_text())


def _h200_plan(**kw: object) -> dict:
    worker = {"host": "gpu", "address": "127.0.0.1", "port": 50052, "devices": H200["rpc_devices"]}
    return plan_split([worker], {"host": "orchestrator", "devices": H200["devices"]}, SYNTH2L, ctx_size=4096,
                      n_parallel=4, kv_unified=True, **kw)


def test_a_real_cuda_load_puts_the_rpc_device_first_as_planned() -> None:
    """llama.cpp's CUDA build orders the worker's RPC0 before the local CUDA0, as the plan's -ts does: every layer
    and buffer where planned."""
    plan = _h200_plan()
    assert (plan["device_names"], plan["tensor_split"], plan["ngl"]) == (["RPC0", "CUDA0"], [1, 2], 3)
    assert compare_with_plan(plan, CUDA_LOG) == []
    rows, problems = buffers_against_plan(plan, CUDA_LOG)
    assert problems == []
    assert [(row["device"], row["model_mib"], row["kv_mib"]) for row in rows] == [
        ("RPC0", 52.08, 32.0), ("CUDA0", 52.95, 32.0), ("CPU", 0.86, 0.0)]


def test_a_real_cuda_load_against_the_reversed_split_is_named() -> None:
    """The same log against a plan that gives the worker two layers (-ts 2,1): the comparison says so."""
    plan = _h200_plan(tensor_split=[2, 1])
    assert compare_with_plan(plan, CUDA_LOG) == ["units per device: plan [2, 1], llama.cpp [1, 2]"]
