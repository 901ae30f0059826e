"""rpc_workers: a worker's rpc-server units and the endpoints it offers the orchestrator."""

from __future__ import annotations

from typing import Any

import pytest

from llamafleet.core.rpc_workers import (
    WorkerError,
    rpc_server_endpoints,
    rpc_server_instances,
)


@pytest.mark.parametrize(("devices", "port", "per_device", "expected"), [
    ([], 50052, False, [{"unit": "llamafleet-rpc-server.service", "devices": [], "port": 50052}]),
    (["CUDA0", "CUDA1"], 50052, False,
     [{"unit": "llamafleet-rpc-server.service", "devices": ["CUDA0", "CUDA1"], "port": 50052}]),
    (["CUDA0", "Vulkan1"], 6000, True,
     [{"unit": "llamafleet-rpc-server-cuda0.service", "devices": ["CUDA0"], "port": 6000},
      {"unit": "llamafleet-rpc-server-vulkan1.service", "devices": ["Vulkan1"], "port": 6001}]),
    (["CUDA0"], 65535, True, [{"unit": "llamafleet-rpc-server-cuda0.service", "devices": ["CUDA0"], "port": 65535}]),
])
def test_instances(devices: list[str], port: int, per_device: bool, expected: list[dict[str, Any]]) -> None:
    assert rpc_server_instances(devices, port, per_device) == expected


def test_instances_do_not_share_the_callers_list() -> None:
    devices = ["CUDA0"]
    rpc_server_instances(devices, 50052)[0]["devices"].append("CUDA1")
    assert devices == ["CUDA0"]


@pytest.mark.parametrize(("devices", "port", "per_device", "message"), [
    ([], 50052, True, "rpc_server_unit_per_device needs rpc_server_devices"),
    ("CUDA0", 50052, False, "rpc_server_devices must be a list"),
    (["CUDA0", ""], 50052, False, "rpc_server_devices must be a list"),
    (["CUDA0", "cuda0"], 50052, True, "lists a device twice: CUDA0, cuda0"),
    ([], 0, False, "rpc_server_port 0 gives ports 0-0, outside 1-65535"),
    (["CUDA0", "CUDA1"], 65535, True, "rpc_server_port 65535 gives ports 65535-65536"),
    ([], "50052", False, "rpc_server_port must be a number"),
    ([], True, False, "rpc_server_port must be a number"),
])
def test_bad_instances(devices: Any, port: Any, per_device: bool, message: str) -> None:
    with pytest.raises(WorkerError, match=message):
        rpc_server_instances(devices, port, per_device)


CPU = {"ggml_name": "CPU", "backend": "cpu", "total_mib": 4096, "free_mib": 4000}
CUDA0 = {"ggml_name": "CUDA0", "backend": "cuda", "total_mib": 24576, "free_mib": 24000}
CUDA1 = {"ggml_name": "CUDA1", "backend": "cuda", "total_mib": 12288, "free_mib": 12000}


@pytest.mark.parametrize(("instances", "rpc_devices", "expected_devices"), [
    (rpc_server_instances([], 50052), [CPU], [[CPU]]),
    (rpc_server_instances([], 50052), [CUDA0, CUDA1], [[CUDA0, CUDA1]]),
    (rpc_server_instances(["CUDA1", "CUDA0"], 50052), [CUDA0, CUDA1], [[CUDA0, CUDA1]]),  # the worker's order
    (rpc_server_instances(["CUDA1"], 50052), [CUDA0, CUDA1], [[CUDA1]]),
    (rpc_server_instances(["CUDA0", "CUDA1"], 50052, True), [CUDA0, CUDA1], [[CUDA0], [CUDA1]]),
    (rpc_server_instances(["CUDA2"], 50052), [CUDA0], [[]]),   # not present: the planner reports it
    (rpc_server_instances([], 50052), [], [[]]),
])
def test_endpoints(instances: list[dict], rpc_devices: list[dict], expected_devices: list[list[dict]]) -> None:
    endpoints = rpc_server_endpoints(instances, rpc_devices, host="lab2", address="10.77.0.12")
    assert [e["devices"] for e in endpoints] == expected_devices
    assert [(e["host"], e["address"], e["port"], e["unit"]) for e in endpoints] == [
        ("lab2", "10.77.0.12", i["port"], i["unit"]) for i in instances]


def test_endpoint_ports_are_numbers() -> None:
    endpoints = rpc_server_endpoints([{"unit": "u", "devices": [], "port": "50053"}], [], host="h", address="a")
    assert endpoints[0]["port"] == 50053
