"""fleet_checks: one orchestrator and some workers, no endpoint twice, bind addresses the host has."""

from __future__ import annotations

import pytest

from llamafleet.core.fleet_checks import (
    bind_address_problem,
    endpoint_clash,
    fleet_groups_problem,
)

ORCH, WORKERS = "llamafleet_orchestrator", "llamafleet_workers"


@pytest.mark.parametrize(("orchestrators", "workers", "expected"), [
    (["lab1"], ["lab2", "lab3"], ""),
    ([], ["lab2"], ""),  # none pinned: the election fills the group
    (["lab1"], ["lab1"], ""),  # the orchestrator may be a worker too
    (["lab2", "lab1"], ["lab2", "lab3"],
     "the inventory group llamafleet_orchestrator has 2 hosts (lab1, lab2): llama-server runs on exactly one "
     "orchestrator; keep one of them in llamafleet_orchestrator (or leave it empty to elect one)"),
    (["lab1"], [], "the inventory group llamafleet_workers is empty: the model's layers live on rpc-server workers; "
                   "put at least one host in llamafleet_workers"),
    (["lab1"], None, "the inventory group llamafleet_workers is missing: the model's layers live on rpc-server "
                     "workers; put at least one host in llamafleet_workers"),
])
def test_fleet_groups(orchestrators: list[str], workers: list[str] | None, expected: str) -> None:
    assert fleet_groups_problem(orchestrators, workers, ORCH, WORKERS) == expected


@pytest.mark.parametrize(("endpoints", "shared"), [
    ({"lab2": ["10.77.0.12:50052"], "lab3": ["10.77.0.13:50052"]}, None),
    ({"lab2": ["10.77.0.12:50052"], "lab2b": ["10.77.0.12:50053"]}, None),  # same address, other port
    ({"lab2": ["10.77.0.12:50052"], "lab2b": ["10.77.0.12:50052"], "lab3": ["10.77.0.13:50052"]},
     "10.77.0.12:50052 on lab2 and lab2b"),
    # per-device units: one clashing port is enough, and every clash is named
    ({"b": ["10.0.0.5:50060", "10.0.0.5:50061"], "a": ["10.0.0.5:50061", "10.0.0.6:50060"],
      "c": ["10.0.0.6:50060"]},
     "10.0.0.5:50061 on a and b; 10.0.0.6:50060 on a and c"),
    ({"lab2": ["0.0.0.0:50052"], "lab3": ["0.0.0.0:50052"]}, None),  # every interface: no machine named
    ({"lab1": [], "lab2": ["10.77.0.12:50052", "10.77.0.12:50052"]}, None),  # one host's own list
])
def test_endpoint_clash(endpoints: dict[str, list[str]], shared: str | None) -> None:
    message = endpoint_clash(endpoints)
    if shared is None:
        assert message == ""
    else:
        assert message.startswith("two inventory hosts offer the same rpc-server endpoint (%s): " % shared)


ADDRESSES = ["10.77.0.12", "192.168.1.5", "fe80::1"]


@pytest.mark.parametrize(("address", "options", "expected"), [
    ("10.77.0.12", {}, ""),
    ("192.168.1.5", {}, ""),
    ("fe80::1", {}, ""),
    ("10.77.0.99", {}, "rpc_server_bind_address=10.77.0.99 is not an address of this host (its addresses: "
                       "10.77.0.12, 192.168.1.5, fe80::1): set llamafleet_cluster_address (or rpc_server_bind_address)"
                       " to one of them"),
    ("127.0.0.1", {}, "rpc_server_bind_address=127.0.0.1 is not an address of this host"),
    ("127.0.0.1", {"loopback_ok": True}, ""),
    ("::1", {"loopback_ok": True}, ""),
    ("localhost", {"loopback_ok": True}, ""),
    ("0.0.0.0", {}, ""),
    ("0.0.0.0", {"any_address_ok": False, "any_address_variable": "rpc_server_allow_any_address"},
     "rpc_server_bind_address=0.0.0.0 listens on every interface: set rpc_server_allow_any_address=true to allow it"),
    ("::", {"any_address_ok": False}, "rpc_server_bind_address=:: listens on every interface"),
    ("node1.example", {}, "rpc_server_bind_address='node1.example' is not an IP address: give one of this host's "
                          "addresses (10.77.0.12, 192.168.1.5, fe80::1)"),
    ("", {}, "rpc_server_bind_address='' is not an IP address"),
])
def test_bind_address(address: str, options: dict, expected: str) -> None:
    message = bind_address_problem(address, "rpc_server_bind_address", ADDRESSES, **options)
    assert message.startswith(expected) and bool(message) == bool(expected), message


def test_bind_address_with_no_known_addresses() -> None:
    assert bind_address_problem("10.0.0.1", "llama_server_bind_address", []).startswith(
        "llama_server_bind_address=10.0.0.1 is not an address of this host (its addresses: none)")
    # a scoped IPv6 address from the facts still matches
    assert bind_address_problem("fe80::2", "v", ["fe80::2%eth0"]) == ""
