"""llamafleet filter plugin: thin wrappers, errors as AnsibleFilterError."""

from __future__ import annotations

import pytest
from ansible.module_utils import _internal

_WAS_CONTROLLER = _internal.is_controller
try:
    # Importing controller code (ansible.errors) marks the process as the controller, after which
    # AnsibleModule.warn() prints instead of recording: module tests collected after this one would lose
    # their warnings. Restore the flag once the imports are done.
    from ansible.errors import AnsibleFilterError

    from ansible_collections.llamafleet.cluster.plugins.filter.llamafleet import FilterModule
finally:
    _internal.is_controller = _WAS_CONTROLLER

FILTERS = FilterModule().filters()
FACTS = {"distribution": "Debian", "distribution_major_version": "12", "architecture": "x86_64",
         "processor": ["0", "AuthenticAMD", "AMD EPYC"]}


def test_the_filters() -> None:
    assert set(FILTERS) == {"elect_orchestrator", "rpc_server_instances", "rpc_server_endpoints",
                            "llamacpp_build_identity", "llamacpp_cluster_source_mismatch",
                            "rpc_server_instances_problem", "fleet_groups_problem", "rpc_endpoint_clash",
                            "bind_address_problem", "gate_ping_group_range", "stamp_report"}


def test_gate_ping_group_range() -> None:
    assert FILTERS["gate_ping_group_range"]("1\t0\n", "997") == {
        "value": "997 997", "note": "net.ipv4.ping_group_range set to group 997 alone (it was empty)"}
    assert FILTERS["gate_ping_group_range"]("997 997", 997)["value"] == ""
    with pytest.raises(AnsibleFilterError, match="gate_ping_group_range"):
        FILTERS["gate_ping_group_range"]("1 0", "not a gid")


def test_elect_orchestrator() -> None:
    hosts = {"lab1": [{"backend": "cpu", "total_mib": 64000}],
             "lab2": [{"backend": "cuda", "total_mib": 12288}, {"backend": "cuda", "total_mib": 12288}]}
    assert FILTERS["elect_orchestrator"](hosts) == "lab2"
    assert FILTERS["elect_orchestrator"](hosts, "lab1") == "lab1"
    with pytest.raises(AnsibleFilterError, match="elect_orchestrator: no hosts"):
        FILTERS["elect_orchestrator"]([])


def test_rpc_server_instances_and_endpoints() -> None:
    instances = FILTERS["rpc_server_instances"](["CUDA0", "CUDA1"], 50060, per_device=True)
    assert [(i["unit"], i["port"]) for i in instances] == [
        ("llamafleet-rpc-server-cuda0.service", 50060), ("llamafleet-rpc-server-cuda1.service", 50061)]
    assert FILTERS["rpc_server_instances"](None, 50052) == [
        {"unit": "llamafleet-rpc-server.service", "devices": [], "port": 50052}]
    devices = [{"ggml_name": "CUDA1", "total_mib": 8192}, {"ggml_name": "CUDA0", "total_mib": 4096}]
    endpoints = FILTERS["rpc_server_endpoints"](instances, devices, "lab2", "10.77.0.12")
    assert [(e["port"], e["devices"]) for e in endpoints] == [(50060, [devices[1]]), (50061, [devices[0]])]


@pytest.mark.parametrize(("name", "args", "message"), [
    ("rpc_server_instances", ([], 50052, True), "rpc_server_instances: rpc_server_unit_per_device needs"),
    ("rpc_server_instances", ("CUDA0", 50052), "rpc_server_instances: rpc_server_devices must be a list"),
    ("rpc_server_endpoints", ([{"devices": []}], [], "h", "a"), "rpc_server_endpoints: 'port'"),
    ("llamacpp_build_identity", ({"backend": "opencl"}, FACTS, 2), "llamacpp_build_identity: llamacpp_build_backend"),
])
def test_errors_are_filter_errors(name: str, args: tuple, message: str) -> None:
    with pytest.raises(AnsibleFilterError, match=message):
        FILTERS[name](*args)


def test_build_identity() -> None:
    settings = {"source_type": "git", "git_repo": "https://example.invalid/llama.cpp.git", "git_version": "a" * 40}
    identity = FILTERS["llamacpp_build_identity"](settings, FACTS, 2)
    assert identity["id"].startswith("aaaaaaaaaaaa-cpu-") and len(identity["id"]) == len("aaaaaaaaaaaa-cpu-") + 10
    assert identity["label"] == "a" * 40 and "-DGGML_RPC=ON" in identity["cmake"]


def test_cluster_source_mismatch() -> None:
    settings = {"source_type": "git", "git_repo": "https://example.invalid/llama.cpp.git", "git_version": "a" * 40}
    source = FILTERS["llamacpp_build_identity"](settings, FACTS, 2)["source"]
    other = FILTERS["llamacpp_build_identity"](dict(settings, git_version="b" * 40), FACTS, 2)["source"]
    assert FILTERS["llamacpp_cluster_source_mismatch"]({"lab1": source, "lab2": source}) == ""
    message = FILTERS["llamacpp_cluster_source_mismatch"]({"lab1": source, "lab2": other})
    assert "git commit %s on lab1; git commit %s on lab2" % ("a" * 40, "b" * 40) in message
    with pytest.raises(AnsibleFilterError, match="llamacpp_cluster_source_mismatch: "):
        FILTERS["llamacpp_cluster_source_mismatch"](["lab1"])


def test_rpc_server_instances_problem_names_the_variable() -> None:
    assert FILTERS["rpc_server_instances_problem"]([], 50052) == ""
    assert FILTERS["rpc_server_instances_problem"](None, 50052) == ""
    assert FILTERS["rpc_server_instances_problem"]([], 70000) == (
        "rpc_server_port 70000 gives ports 70000-70000, outside 1-65535")
    assert FILTERS["rpc_server_instances_problem"](["CUDA0", "CUDA1"], 65535, True) == (
        "rpc_server_port 65535 gives ports 65535-65536, outside 1-65535")
    assert FILTERS["rpc_server_instances_problem"]("CUDA0", 50052).startswith("rpc_server_devices must be a list")


def test_fleet_checks_filters() -> None:
    groups = ("llamafleet_orchestrator", "llamafleet_workers")
    assert FILTERS["fleet_groups_problem"](["lab1"], ["lab2"], *groups) == ""
    assert "group llamafleet_workers is missing" in FILTERS["fleet_groups_problem"](["lab1"], None, *groups)
    assert "has 2 hosts (lab1, lab2)" in FILTERS["fleet_groups_problem"](("lab2", "lab1"), ["lab3"], *groups)
    clash = FILTERS["rpc_endpoint_clash"]({"lab2": ["10.77.0.12:50052"], "lab2b": ["10.77.0.12:50052"]})
    assert "(10.77.0.12:50052 on lab2 and lab2b)" in clash
    with pytest.raises(AnsibleFilterError, match="rpc_endpoint_clash: "):
        FILTERS["rpc_endpoint_clash"](["lab2"])
    assert FILTERS["bind_address_problem"]("10.77.0.12", "rpc_server_bind_address", ["10.77.0.12"], False) == ""
    assert FILTERS["bind_address_problem"]("127.0.0.1", "llama_server_bind_address", None, loopback_ok=True) == ""
    assert FILTERS["bind_address_problem"]("0.0.0.0", "rpc_server_bind_address", ["10.77.0.12"], False,
                                           "rpc_server_allow_any_address").endswith(
        "set rpc_server_allow_any_address=true to allow it")
