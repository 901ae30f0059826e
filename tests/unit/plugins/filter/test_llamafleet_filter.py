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


@pytest.mark.parametrize("workers, kwargs, expected", [
    ([{"host": "lab2", "address": "10.77.0.12", "port": 50052}, {"host": "lab3", "port": "50053"}], {},
     ["10.77.0.12:50052", "lab3:50053"]),
    (["lab2", {"address": "10.0.0.9"}], {"default_port": 50060}, ["lab2:50060", "10.0.0.9:50060"]),
    ([], {}, []),
])
def test_rpc_endpoints(workers: list, kwargs: dict, expected: list[str]) -> None:
    assert FILTERS["rpc_endpoints"](workers, **kwargs) == expected


@pytest.mark.parametrize("workers, message", [
    ("lab2", "expects a list"),
    ([{"port": 1}], r"workers\[0\] needs a host or an address"),
    ([{"host": "a", "port": "http"}], "port 'http' is not a number"),
])
def test_rpc_endpoints_errors(workers: object, message: str) -> None:
    with pytest.raises(AnsibleFilterError, match=message):
        FILTERS["rpc_endpoints"](workers)


def test_elect_orchestrator_and_gpu_memory() -> None:
    hosts = {"lab1": [{"backend": "cpu", "total_mib": 64000}],
             "lab2": [{"backend": "cuda", "total_mib": 12288}, {"backend": "cuda", "total_mib": 12288}]}
    assert FILTERS["elect_orchestrator"](hosts) == "lab2"
    assert FILTERS["elect_orchestrator"](hosts, "lab1") == "lab1"
    assert FILTERS["gpu_memory_mib"](hosts["lab2"]) == 24576
    with pytest.raises(AnsibleFilterError, match="elect_orchestrator: no hosts"):
        FILTERS["elect_orchestrator"]([])
    with pytest.raises(AnsibleFilterError, match="gpu_memory_mib"):
        FILTERS["gpu_memory_mib"]([{"backend": "cuda", "total_mib": "lots"}])
