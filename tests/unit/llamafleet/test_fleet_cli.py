"""``llamafleet status|logs|probe``: the thin layer that formats what the library read.

The fleet is this machine (see conftest's ``machine_fleet``); the output is read
the way tests/e2e/test_cli.py reads it on the lab.
"""

from __future__ import annotations

import json
import sys

import pytest

from llamafleet import fleet_cli
from llamafleet.cli import main
from llamafleet.core import constants
from llamafleet.fleet import Fleet
from llamafleet.probe import Link


@pytest.fixture
def use_fleet(monkeypatch):
    """Make the CLI read ``fleet`` whatever inventory it is given."""

    def use(fleet: Fleet) -> None:
        monkeypatch.setattr(fleet_cli.Fleet, "from_inventory", classmethod(lambda cls, inventory, vault_password_files=(): fleet))

    return use


def test_status_json_has_the_fields_the_e2e_test_reads(machine_fleet, use_fleet, capsys):
    use_fleet(machine_fleet.fleet)
    assert main(["status", "--json"]) == 1  # lab3 has a unit restarting and lab4 is unreachable
    rows = {row["host"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(machine_fleet.fleet.hosts)
    orch = rows["lab1"]
    assert orch["role"] == "orchestrator" and orch["state"] == "active" and orch["health"] == "ok"
    worker = rows["lab2"]
    assert worker["state"] == "active" and worker["unit"] == constants.RPC_SERVER_UNIT
    assert int(worker["cache_files"]) >= 1 and int(worker["cache_bytes"]) > 0
    assert worker["build"] == orch["build"] == "b4321-cpu"
    assert (orch["gate"], orch["serving_state"], orch["gate_restarts"]) == ("active", "serving", 1)
    assert (worker["guard"], worker["link"]) == ("active", "ok")


def test_status_exit_status_is_0_when_all_is_well(machine_fleet, use_fleet, capsys):
    data = machine_fleet.inventory
    data["llamafleet_workers"]["hosts"] = ["lab2"]
    use_fleet(Fleet.from_inventory_json(data, machine_fleet.connector))
    assert main(["status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == fleet_cli.STATUS_HEADER
    assert [line.split()[:4] for line in lines[1:]] == [["lab1", "orchestrator", "127.0.0.1", "active"],
                                                        ["lab2", "worker", "127.0.0.1", "active"]]
    # gate, link, serving (for 28 minutes, the recorded file's), health and the watchdog's one restart
    assert lines[1].split()[-8:] == ["active", "-", "serving", "28m", "ok", "(1", "watchdog", "restart)"]
    assert "MiB/3" in lines[2] and lines[2].split()[-4:] == ["active", "ok", "-", "-"]  # guard, link


def test_status_of_a_stalled_worker_exits_1_and_says_why(machine_fleet, use_fleet, capsys):
    machine_fleet.write_gate_state("down_stalled")
    use_fleet(machine_fleet.fleet)
    assert main(["status"]) == 1
    out = capsys.readouterr().out
    print(out, file=sys.stderr)  # the example table, with -s
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert lines["lab1"].split()[7:10] == ["active", "-", "down"] and lines["lab1"].split()[10] in ("1s", "2s")
    assert lines["lab1"].endswith("no ACK for 6.6 s; llama-server is restarted if it lasts 30 s (1 watchdog restart)")
    assert "HTTP 503" not in lines["lab1"]  # the fake server says ok; the gate's 503 would only repeat the reason
    # a worker's cache is two words ("6 MiB/3")
    assert lines["lab2"].split()[8:10] == ["active", "ok"] and lines["lab3"].split()[8:10] == ["active", "stalled"]


ORCH_ROW = {"host": "lab1", "role": "orchestrator", "address": "10.0.0.1", "state": "active", "restarts": 1,
            "build": "b1", "cache_files": None}
GATE = {"gate": "active", "gate_restarts": 0}


@pytest.mark.parametrize(
    ("row", "columns"),
    [
        ({"host": "lab2", "role": "worker", "address": "10.0.0.2", "state": "active", "restarts": 0, "build": "b1",
          "cache_bytes": 3 * 2**20, "cache_files": 2},
         ["lab2", "worker", "10.0.0.2", "active", "0", "b1", "3", "MiB/2", "-", "-", "-", "-"]),
        ({"host": "lab2", "role": "worker", "address": "10.0.0.2", "state": "active", "restarts": 0, "build": "b1",
          "cache_bytes": 3 * 2**20, "cache_files": 2, "guard": "failed", "link": "stalled"},
         ["lab2", "worker", "10.0.0.2", "active", "0", "b1", "3", "MiB/2", "failed", "stalled", "-", "-"]),
        ({"host": "lab4", "role": "worker", "address": "10.0.0.4", "state": "unreachable", "error": "timed out"},
         ["lab4", "worker", "10.0.0.4", "unreachable", "-", "-", "-", "-", "-", "timed", "out"]),
        # no gate (a fleet deployed before it): /health as before
        (dict(ORCH_ROW, health="HTTP 503: Loading model"),
         ["lab1", "orchestrator", "10.0.0.1", "active", "1", "b1", "-", "-", "-", "-", "HTTP", "503:", "Loading",
          "model"]),
        (dict(ORCH_ROW, **GATE, health="ok", serving="serving: llama-server is serving", serving_state="serving",
              serving_since=7300),
         ["lab1", "orchestrator", "10.0.0.1", "active", "1", "b1", "-", "active", "-", "serving", "2h", "ok"]),
        (dict(ORCH_ROW, **GATE, health="ok", serving="serving: llama-server is serving", serving_state="serving",
              serving_since=7300, load_seconds=8.04),
         ["lab1", "orchestrator", "10.0.0.1", "active", "1", "b1", "-", "active", "-", "serving", "2h", "ok,",
          "model", "loaded", "in", "8.0", "s"]),
        # loading: /health's 503 only repeats the gate's reason
        (dict(ORCH_ROW, **GATE, health="HTTP 503: Loading model", serving="loading: llama-server is loading the model",
              serving_state="loading", serving_since=75),
         ["lab1", "orchestrator", "10.0.0.1", "active", "1", "b1", "-", "active", "-", "loading", "75s",
          "loading:", "llama-server", "is", "loading", "the", "model"]),
        (dict(ORCH_ROW, gate="active", gate_restarts=2, health="HTTP 503: llamafleet: worker lab3 lost",
              serving="down: worker lab3 lost", serving_state="down", serving_since=130),
         ["lab1", "orchestrator", "10.0.0.1", "active", "1", "b1", "-", "active", "-", "down", "2m", "down:",
          "worker", "lab3", "lost", "(2", "watchdog", "restarts)"]),
        # the gate is not running: what /health says adds to that
        (dict(ORCH_ROW, gate="failed", gate_restarts=None, health="unreachable (Connection refused)",
              serving="gate not running (llamafleet-gate.service is failed)", serving_state=None),
         ["lab1", "orchestrator", "10.0.0.1", "active", "1", "b1", "-", "failed", "-", "?", "gate", "not", "running",
          "(llamafleet-gate.service", "is", "failed);", "unreachable", "(Connection", "refused)"]),
        # a host in both roles shows the helper that is not active
        (dict(ORCH_ROW, **GATE, guard="inactive", link=None, health="ok", serving="serving: x",
              serving_state="serving", serving_since=5),
         ["lab1", "orchestrator", "10.0.0.1", "active", "1", "b1", "-", "inactive", "-", "serving", "5s", "ok"]),
    ],
)
def test_status_line(row, columns):
    assert fleet_cli.status_line(row).split() == columns


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (0, "0s"), (119.9, "119s"), (120, "2m"), (7199, "119m"),
                                               (7200, "2h"), (48 * 3600 - 1, "47h"), (48 * 3600, "2d")])
def test_ago(seconds, text):
    assert fleet_cli.ago(seconds) == text


def test_logs_of_a_worker_and_of_an_unknown_host(machine_fleet, use_fleet, capsys):
    answer = machine_fleet.connector.answer  # lab4 stays unreachable
    machine_fleet.connector.answer = lambda host, command: (
        (0, f"journal of {host.name}: {command}\n", "") if host.name != "lab4" and "journalctl" in command
        else answer(host, command))
    use_fleet(machine_fleet.fleet)
    assert main(["logs", "lab3", "-n", "7"]) == 0
    assert capsys.readouterr().out == (
        "journal of lab3: journalctl -u llamafleet-rpc-server-cuda0.service -u llamafleet-rpc-server-cuda1.service "
        f"-u {constants.RPC_GUARD_UNIT} -n 7 --no-pager -o short-iso\n")
    assert main(["logs", "lab1", "-n", "7"]) == 0
    assert capsys.readouterr().out == (f"journal of lab1: journalctl -u {constants.LLAMA_SERVER_UNIT} "
                                       f"-u {constants.GATE_UNIT} -n 7 --no-pager -o short-iso\n")
    assert main(["logs", "no-such-host"]) == 2
    assert "no-such-host is not in" in capsys.readouterr().err
    assert main(["logs", "lab4"]) == 2
    assert "lab4: timed out after 10 s (lab4 port 22)" in capsys.readouterr().err  # its deployment record could not be read


def test_probe_lines_read_as_the_e2e_test_reads_them(machine_fleet, use_fleet, capsys, tmp_path, monkeypatch):
    links = [Link("lab1", "lab2", 0.42, 32 * 2**20, 0.25), Link("lab1", "lab3", error="sink: Address already in use")]
    monkeypatch.setattr(fleet_cli, "probe_links", lambda fleet, megabytes, port: iter(links))
    use_fleet(machine_fleet.fleet)
    assert main(["probe", "--megabytes", "32"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "->" in ln]
    connect_ms, mb_s = (float(x) for x in lines[0].split()[-2:])
    assert (connect_ms, mb_s) == (0.42, round(32 * 2**20 / 0.25 / 1e6, 1))
    assert lines[1] == f"{'lab1 -> lab3':<24} failed: sink: Address already in use"


def test_help_does_not_need_fabric(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fabric", None)  # importing it would fail
    with pytest.raises(SystemExit) as exc:
        main(["status", "--help"])
    assert exc.value.code == 0 and "--json" in capsys.readouterr().out
