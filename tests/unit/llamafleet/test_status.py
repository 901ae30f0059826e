"""status: the facts read from each host, the rows made of them, and the fleet's status end to end.

The end-to-end tests run the real fact script with this machine's sh against
per-host directories (build link, weight cache) and a systemctl that answers
from recorded output; llama-server is a local HTTP server.
"""

from __future__ import annotations

import os

import pytest

from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.facts import END, START, HostFacts, parse_output
from llamafleet.fleet import Host
from llamafleet.layout import HostLayout
from llamafleet.status import (
    NO_UNIT,
    fleet_status,
    host_row,
    is_bad,
    journal_command,
    overall_state,
    status_facts,
    unit_row,
)

WORKER = HostLayout("w", False, True, "/opt/x", None, (constants.RPC_SERVER_UNIT,), "/var/lib/x/cache/rpc")
ORCH = HostLayout("o", True, False, "/opt/x", constants.LLAMA_SERVER_UNIT, (), None)


def test_facts_of_a_worker_and_an_orchestrator():
    assert [f.name for f in status_facts(WORKER)] == ["build", "units", "cache_bytes", "cache_files"]
    assert [f.name for f in status_facts(ORCH)] == ["build", "units"]
    spare = HostLayout("s", False, False, "/opt/x", None, (), None)
    assert [f.name for f in status_facts(spare)] == ["build"]  # no unit to ask systemctl about
    commands = {f.name: f.command for f in status_facts(WORKER)}
    assert commands["build"] == "readlink /opt/x/current"
    assert commands["units"].endswith(f"-- {constants.RPC_SERVER_UNIT}")
    assert commands["cache_bytes"] == "du -sb /var/lib/x/cache/rpc"


@pytest.mark.parametrize(
    ("props", "expected"),
    [
        ({"Id": "u", "ActiveState": "active", "SubState": "running", "LoadState": "loaded",
          "ActiveEnterTimestamp": "Mon 2026-11-23 17:42:10 UTC", "NRestarts": "2"},
         {"unit": "u", "state": "active", "sub_state": "running", "load_state": "loaded",
          "since": "Mon 2026-11-23 17:42:10 UTC", "restarts": 2}),
        ({"Id": "u", "ActiveEnterTimestamp": "n/a", "NRestarts": ""},
         {"unit": "u", "state": "unknown", "sub_state": "", "load_state": "", "since": "", "restarts": 0}),
    ],
)
def test_unit_row(props, expected):
    assert unit_row(props) == expected


@pytest.mark.parametrize(
    ("states", "overall"),
    [(["active"], "active"), (["active", "active"], "active"), (["active", "failed", "inactive"], "failed"),
     ([], NO_UNIT)],
)
def test_overall_state(states, overall):
    assert overall_state([{"state": s} for s in states]) == overall


def test_host_row_from_recorded_output(fixture_text):
    """The rows of a worker whose facts came back as the recorded systemctl output says."""
    rpc_server_block = fixture_text("systemctl-252_show_units_reconstructed.txt").split("\n\n")[1] + "\n"
    outputs = {"build": "b4321-cpu\n", "units": rpc_server_block, "cache_bytes": "12345\t/var/lib/x/cache/rpc\n",
               "cache_files": "a\nb\n"}
    script_output = "".join(f"{START} {name}\n{text}\n{END} 0\n" for name, text in outputs.items())
    row = host_row(Host("w", "10.0.0.2"), WORKER, HostFacts("w", parse_output(status_facts(WORKER), script_output)))
    assert row["state"] == "active" and row["unit"] == constants.RPC_SERVER_UNIT
    assert (row["build"], row["cache_bytes"], row["cache_files"], row["restarts"]) == ("b4321-cpu", 12345, 2, 0)
    assert row["since"] == "Mon 2026-11-23 17:40:55 UTC"
    assert not is_bad(row)


def test_host_row_of_an_unreachable_host():
    row = host_row(Host("w", "10.0.0.2"), WORKER, HostFacts("w", error="TimeoutError: timed out"))
    assert row == {"host": "w", "address": "10.0.0.2", "role": "worker", "unit": constants.RPC_SERVER_UNIT,
                   "state": "unreachable", "error": "TimeoutError: timed out"}
    assert is_bad(row)


@pytest.mark.parametrize(
    ("row", "bad"),
    [({"state": "active"}, False), ({"state": "active", "health": "ok"}, False),
     ({"state": "active", "health": "HTTP 503: Loading model"}, True), ({"state": "failed"}, True),
     ({"state": NO_UNIT}, False), ({"state": "unreachable"}, True)],
)
def test_is_bad(row, bad):
    assert is_bad(row) is bad


def test_journal_command_names_every_unit():
    per_device = HostLayout("w", False, True, "/opt/x", None, ("a.service", "b.service"), "/c")
    assert journal_command(per_device, 20) == "journalctl -u a.service -u b.service -n 20 --no-pager -o short-iso"


def test_journal_of_a_host_without_units_is_a_user_error():
    with pytest.raises(UserError, match="s is neither the orchestrator nor a worker"):
        journal_command(HostLayout("s", False, False, "/opt/x", None, (), None), 20)


# End to end on this machine

def test_fleet_status_reads_every_host_once(machine_fleet):
    rows = {r["host"]: r for r in fleet_status(machine_fleet.fleet)}
    assert list(rows) == ["lab1", "lab2", "lab3", "lab4"]
    orch = rows["lab1"]
    assert (orch["role"], orch["state"], orch["health"]) == ("orchestrator", "active", "ok")
    assert orch["unit"] == constants.LLAMA_SERVER_UNIT and orch["cache_files"] is None
    assert orch["endpoint"] == f"http://127.0.0.1:{machine_fleet.server.port}"
    # /health is public: status sends no key (and so never reads it from the orchestrator)
    assert machine_fleet.server.seen[-1][:3] == ("GET", "/health", None)
    lab2 = rows["lab2"]
    assert (lab2["state"], lab2["unit"], lab2["build"]) == ("active", constants.RPC_SERVER_UNIT, orch["build"])
    cache_dir = machine_fleet.fleet.hosts["lab2"].vars["rpc_server_home"] + "/cache/rpc"
    assert (lab2["cache_files"], lab2["cache_bytes"]) == (3, 6000 + os.stat(cache_dir).st_size)  # du counts the dir
    lab3 = rows["lab3"]
    assert lab3["unit"] == "llamafleet-rpc-server-cuda0.service, llamafleet-rpc-server-cuda1.service"
    assert (lab3["state"], lab3["restarts"], lab3["cache_files"]) == ("activating", 3, 1)
    assert [u["state"] for u in lab3["units"]] == ["active", "activating"]
    assert rows["lab4"]["state"] == "unreachable" and "timed out" in rows["lab4"]["error"]
    assert [is_bad(rows[h]) for h in rows] == [False, False, True, True]
    assert sorted(h for h, _ in machine_fleet.connector.calls) == ["lab1", "lab2", "lab3", "lab4"]


def test_no_health_check_when_llama_server_is_not_active(machine_fleet, tmp_path):
    show = tmp_path / "show.txt"
    show.write_text("NRestarts=0\nId=llamafleet-llama-server.service\nLoadState=loaded\nActiveState=failed\n"
                    "SubState=failed\nActiveEnterTimestamp=\n", encoding="utf-8")
    machine_fleet.connector.answer = _with_env(machine_fleet.connector.answer, FAKE_SYSTEMCTL_SHOW=str(show))
    orch = next(r for r in fleet_status(machine_fleet.fleet) if r["host"] == "lab1")
    assert orch["state"] == "failed" and "health" not in orch
    assert machine_fleet.server.seen == []


def test_an_unusable_endpoint_setting_is_the_orchestrators_health(machine_fleet):
    machine_fleet.fleet.hosts["lab1"].vars["llama_server_bind_address"] = "{{ ansible_default_ipv4.address }}"
    orch = next(r for r in fleet_status(machine_fleet.fleet) if r["host"] == "lab1")
    assert orch["state"] == "active" and "llama_server_bind_address is a Jinja expression" in orch["health"]
    assert is_bad(orch)


def test_a_misconfigured_host_is_reported_not_raised(machine_fleet):
    machine_fleet.fleet.hosts["lab2"].vars["rpc_server_unit_per_device"] = "maybe"
    rows = {r["host"]: r for r in fleet_status(machine_fleet.fleet)}
    assert rows["lab2"]["state"] == "unreachable"
    assert "rpc_server_unit_per_device='maybe' is not a boolean" in rows["lab2"]["error"]
    assert rows["lab1"]["health"] == "ok"


def _with_env(answer, **extra):
    """The answer with extra environment variables exported before each command."""
    prefix = " ".join(f"{k}={v}" for k, v in extra.items())
    return lambda host, command: answer(host, f"export {prefix}\n{command}")
