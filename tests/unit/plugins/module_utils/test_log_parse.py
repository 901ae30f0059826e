"""log_parse: real llama-server load logs (llama.cpp 0c1e570, -lv 4 and -lv 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamafleet.core.log_parse import (
    buffers_by_device,
    device_for_buffer,
    layer_counts,
    layer_ranges,
    parse_load_log,
)

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
