"""teardown filter plugin: thin wrappers over module_utils/teardown.py, errors as AnsibleFilterError."""

from __future__ import annotations

import pytest
from ansible.module_utils import _internal

_WAS_CONTROLLER = _internal.is_controller
try:
    # Importing controller code marks the process as the controller (see test_llamafleet_filter.py).
    from ansible.errors import AnsibleFilterError

    from ansible_collections.llamafleet.cluster.plugins.filter.teardown import FilterModule
finally:
    _internal.is_controller = _WAS_CONTROLLER

FILTERS = FilterModule().filters()


def test_the_filters() -> None:
    assert set(FILTERS) == {"teardown_units", "teardown_ping_group_range", "teardown_parents"}


def test_units_from_find_results() -> None:
    found = [{"path": "/etc/systemd/system/llamafleet-gate.service", "isdir": False},
             {"path": "/etc/systemd/system/llamafleet-plan-switch.path", "isdir": False},
             {"path": "/etc/systemd/system/multi-user.target.wants/llamafleet-gate.service", "isdir": False}]
    assert FILTERS["teardown_units"](found) == ["llamafleet-plan-switch.path", "llamafleet-gate.service"]


def test_units_of_one_prefix() -> None:
    """A host that is no longer a worker (playbooks/_fleet_changes.yml): its rpc-server units, the timer first."""
    found = [f"/etc/systemd/system/{name}" for name in (
        "llamafleet-llama-server.service", "llamafleet-gate.service", "llamafleet-rpc-server.service",
        "llamafleet-rpc-guard.service", "llamafleet-rpc-metrics.timer", "llamafleet-rpc-metrics.service")]
    assert FILTERS["teardown_units"](found, "llamafleet-rpc-") == [
        "llamafleet-rpc-metrics.timer", "llamafleet-rpc-guard.service", "llamafleet-rpc-metrics.service",
        "llamafleet-rpc-server.service"]
    with pytest.raises(AnsibleFilterError, match="teardown_units: the prefix must start with 'llamafleet-'"):
        FILTERS["teardown_units"](found, "rpc-")


@pytest.mark.parametrize(("name", "value"), [
    ("teardown_units", "/etc/systemd/system/llamafleet-gate.service"),
    ("teardown_units", None),
    ("teardown_parents", "/opt/llamafleet/llama.cpp"),
    ("teardown_parents", 3),
])
def test_not_a_list_is_an_error(name: str, value: object) -> None:
    with pytest.raises(AnsibleFilterError, match=name + ": expected a list"):
        FILTERS[name](value)


@pytest.mark.parametrize(("setting", "current", "expected"), [
    ("net.ipv4.ping_group_range = 997 997\n", "997\t997\n", "1 0"),
    (None, "997\t997\n", ""),  # no file read
    ("net.ipv4.ping_group_range = 997 997\n", None, ""),
])
def test_ping_group_range(setting: object, current: object, expected: str) -> None:
    assert FILTERS["teardown_ping_group_range"](setting, current) == expected
