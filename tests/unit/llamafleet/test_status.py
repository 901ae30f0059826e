"""status: the facts read from each host, the rows made of them, and the fleet's status end to end.

The end-to-end tests run the real fact script with this machine's sh against
per-host directories (build link, weight cache) and a systemctl that answers
from recorded output; llama-server is a local HTTP server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.facts import END, START, HostFacts, parse_output
from llamafleet.fleet import Fleet, Host
from llamafleet.layout import HostLayout, host_layout
from llamafleet.status import (
    GATE_STATE_MAX_AGE,
    NO_UNIT,
    fleet_status,
    gate_fields,
    gate_links,
    host_row,
    is_bad,
    journal_command,
    overall_state,
    parse_gate_state,
    status_facts,
    unit_row,
)

WORKER = HostLayout("w", False, True, "/opt/x", None, (constants.RPC_SERVER_UNIT,), "/var/lib/x/cache/rpc")
ORCH = HostLayout("o", True, False, "/opt/x", constants.LLAMA_SERVER_UNIT, (), None, "/run/gate dir/state.json")
NOW = 1795468310  # two seconds after the recorded stall's state file was written


def test_facts_of_a_worker_and_an_orchestrator():
    assert [f.name for f in status_facts(WORKER)] == ["build", "units", "helpers", "cache_bytes", "cache_files"]
    assert [f.name for f in status_facts(ORCH)] == ["build", "units", "helpers", "gate_state"]
    spare = HostLayout("s", False, False, "/opt/x", None, (), None)
    assert [f.name for f in status_facts(spare)] == ["build"]  # no unit to ask systemctl about
    commands = {f.name: f.command for f in status_facts(WORKER)}
    assert commands["build"] == "readlink /opt/x/current"
    assert commands["units"].endswith(f"-- {constants.RPC_SERVER_UNIT}")
    assert commands["helpers"].endswith(f"-- {constants.RPC_GUARD_UNIT}")
    assert commands["cache_bytes"] == "du -sb /var/lib/x/cache/rpc"
    commands = {f.name: f.command for f in status_facts(ORCH)}
    assert commands["helpers"].endswith(f"-- {constants.GATE_UNIT}")
    assert commands["gate_state"] == "date +%s; cat '/run/gate dir/state.json'"


def test_the_orchestrators_layout_points_at_the_gates_state_file(lab_inventory):
    fleet = Fleet.from_inventory_json(lab_inventory)
    orch, worker = host_layout(fleet, fleet.hosts["lab1"]), host_layout(fleet, fleet.hosts["lab2"])
    assert (orch.gate_state_path, orch.helper_units) == (constants.GATE_STATE_PATH, (constants.GATE_UNIT,))
    assert (worker.gate_state_path, worker.helper_units) == (None, (constants.RPC_GUARD_UNIT,))


# The gate's state file

@pytest.mark.parametrize(
    ("text", "doc", "error"),
    [
        ("1795468310\n", None, "no state file"),
        ("1795468310\n{\"state\": \"serv", None, "state file is not JSON: "),
        ("1795468310\n[1, 2]\n", None, "state file is not a JSON object"),
        ("1795468310\n{\"state\": \"busy\", \"since\": 1, \"updated\": 2, \"restarts\": 0}", None,
         "state file has state 'busy', not one of serving, loading, down"),
        ("1795468310\n{\"state\": \"down\", \"since\": 1, \"updated\": \"now\", \"restarts\": 0}", None,
         "state file has updated 'now', not a number"),
        ("1795468310\n{\"state\": \"down\", \"since\": 1, \"updated\": 2, \"restarts\": true}", None,
         "state file has restarts True, not a number"),
        ("1795468310\n{\"state\": \"down\", \"since\": 1, \"updated\": 2, \"restarts\": 0}", None,
         "state file has reason None, not a text"),
        ("1795468310\n{\"state\": \"down\", \"reason\": \"x\", \"since\": 1, \"updated\": 2, \"restarts\": 0, "
         "\"workers\": []}", None, "state file's workers is not an object"),
    ],
)
def test_parse_gate_state_says_why_there_is_no_state(text, doc, error):
    found = parse_gate_state(text)
    assert (found["now"], found["doc"]) == (NOW, doc) and found["error"].startswith(error)


@pytest.mark.parametrize("name", ["serving", "down_stalled"])
def test_parse_gate_state_reads_the_recorded_files(fixture_text, name):
    text = fixture_text(f"gate-state_{name}_generated.json")
    found = parse_gate_state(f"{NOW}\n{text}")
    assert found == {"now": NOW, "doc": json.loads(text), "error": None}


def test_parse_gate_state_needs_the_hosts_clock():
    with pytest.raises(ValueError):
        parse_gate_state("date: not found\n{}")


STALL = ("down: worker lab3 (10.77.0.13:50052) stopped acknowledging: 1048576 bytes unsent or unacked (9 segments in "
         "flight, 6 retransmitted), no ACK for 6.6 s; llama-server is restarted if it lasts 30 s")


@pytest.mark.parametrize(
    ("unit", "name", "now", "expected"),
    [
        ("active", "serving", 1795468280, {"serving": "serving: llama-server is serving", "serving_state": "serving",
                                           "serving_since": 1703, "gate_restarts": 1}),
        ("active", "down_stalled", NOW, {"serving": STALL, "serving_state": "down", "serving_since": 3,
                                         "gate_restarts": 1}),
        # written exactly GATE_STATE_MAX_AGE seconds ago: still the gate's word
        ("active", "down_stalled", 1795468308 + GATE_STATE_MAX_AGE, {"serving_state": "down", "serving": STALL}),
        ("active", "down_stalled", 1795468308 + GATE_STATE_MAX_AGE + 1,
         {"serving": "gate not running (state 11 s old)", "serving_state": None, "serving_since": None,
          "gate_restarts": 1}),
        ("active", "serving", 1795468278 + 3600, {"serving": "gate not running (state 3600 s old)"}),
        ("failed", "serving", 1795468280,
         {"gate": "failed", "serving": f"gate not running ({constants.GATE_UNIT} is failed)", "serving_state": None}),
    ],
)
def test_gate_fields(fixture_text, unit, name, now, expected):
    found = parse_gate_state(f"{now}\n" + fixture_text(f"gate-state_{name}_generated.json"))
    fields = gate_fields(unit, found)
    assert fields["gate"] == unit and fields["gate_state"] == found["doc"]
    assert {key: fields[key] for key in expected} == expected


def test_gate_fields_of_a_degraded_cluster(fixture_text):
    doc = json.loads(fixture_text("gate-state_serving_generated.json"))
    doc["plan"] = {"mode": "degraded", "without": "lab3", "reason": "worker lab3 does not answer HELLO",
                   "requested": "without-lab3", "return_probes": 0}
    fields = gate_fields("active", parse_gate_state("1795468280\n" + json.dumps(doc)))
    assert fields["serving"] == "serving (degraded, without lab3): llama-server is serving"
    assert fields["degraded_without"] == "lab3"
    doc["plan"] = dict(doc["plan"], mode="full", without=None)
    assert gate_fields("active", parse_gate_state("1795468280\n" + json.dumps(doc)))["degraded_without"] is None


def test_gate_fields_carry_the_last_model_load(fixture_text):
    doc = json.loads(fixture_text("gate-state_serving_generated.json"))
    assert gate_fields("active", parse_gate_state("1795468280\n" + json.dumps(doc)))["load_seconds"] is None
    doc["load"] = {"last_seconds": 8.25, "ready_at": 1795468000.0, "loads": 2}
    assert gate_fields("active", parse_gate_state("1795468280\n" + json.dumps(doc)))["load_seconds"] == 8.25


def test_gate_fields_without_a_state_file():
    fields = gate_fields("inactive", parse_gate_state(f"{NOW}\n"))
    assert fields["serving"] == f"gate not running ({constants.GATE_UNIT} is inactive)"
    fields = gate_fields("active", parse_gate_state(f"{NOW}\n"))
    assert (fields["serving"], fields["gate_restarts"], fields["gate_state"]) == (
        "gate not running (no state file)", None, None)


@pytest.mark.parametrize(
    ("name", "now", "links"),
    [("serving", 1795468280, {"lab2": "ok", "lab3": "ok"}), ("down_stalled", NOW, {"lab2": "ok", "lab3": "stalled"}),
     ("down_stalled", NOW + 60, None)],  # the gate stopped: its links say nothing any more
)
def test_gate_links(fixture_text, name, now, links):
    row = gate_fields("active", parse_gate_state(f"{now}\n" + fixture_text(f"gate-state_{name}_generated.json")))
    assert gate_links(row) == links


def test_no_gate_links_without_an_orchestrator_row():
    assert gate_links(None) is None


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


@pytest.mark.parametrize(("helpers", "guard", "bad"), [("", "unknown", True), ("guard", "active", False)])
def test_host_row_from_recorded_output(fixture_text, helpers, guard, bad):
    """The rows of a worker whose facts came back as the recorded systemctl output says."""
    rpc_server_block = fixture_text("systemctl-252_show_units_reconstructed.txt").split("\n\n")[1] + "\n"
    guard_block = fixture_text("systemctl-252_show_gate_units_reconstructed.txt").split("\n\n")[1]
    outputs = {"build": "b4321-cpu\n", "units": rpc_server_block, "helpers": guard_block if helpers else "",
               "cache_bytes": "12345\t/var/lib/x/cache/rpc\n", "cache_files": "a\nb\n"}
    script_output = "".join(f"{START} {name}\n{text}\n{END} 0\n" for name, text in outputs.items())
    row = host_row(Host("w", "10.0.0.2"), WORKER, HostFacts("w", parse_output(status_facts(WORKER), script_output)))
    assert row["state"] == "active" and row["unit"] == constants.RPC_SERVER_UNIT
    assert (row["build"], row["cache_bytes"], row["cache_files"], row["restarts"]) == ("b4321-cpu", 12345, 2, 0)
    assert row["since"] == "Mon 2026-11-23 17:40:55 UTC"
    assert row["guard"] == guard and "gate" not in row and "serving" not in row  # systemctl may tell nothing
    assert is_bad(row) is bad


def test_orchestrator_row_from_recorded_output(fixture_text):
    outputs = {"build": "b4321-cpu\n",
               "units": fixture_text("systemctl-252_show_units_reconstructed.txt").split("\n\n")[0],
               "helpers": fixture_text("systemctl-252_show_gate_units_reconstructed.txt").split("\n\n")[0],
               "gate_state": f"{NOW}\n" + fixture_text("gate-state_down_stalled_generated.json")}
    script_output = "".join(f"{START} {name}\n{text}\n{END} 0\n" for name, text in outputs.items())
    row = host_row(Host("o", "10.0.0.1"), ORCH, HostFacts("o", parse_output(status_facts(ORCH), script_output)))
    assert (row["state"], row["gate"], row["serving"], row["serving_since"]) == ("active", "active", STALL, 3)
    assert row["gate_state"]["workers"]["lab3"]["unacked"] == 9 and "guard" not in row
    assert is_bad(row)


def test_host_row_of_an_unreachable_host():
    row = host_row(Host("w", "10.0.0.2"), WORKER, HostFacts("w", error="TimeoutError: timed out"))
    assert row == {"host": "w", "address": "10.0.0.2", "role": "worker", "unit": constants.RPC_SERVER_UNIT,
                   "state": "unreachable", "error": "TimeoutError: timed out"}
    assert is_bad(row)


@pytest.mark.parametrize(
    ("row", "bad"),
    [({"state": "active"}, False), ({"state": "active", "health": "ok"}, False),
     ({"state": "active", "health": "HTTP 503: Loading model"}, True), ({"state": "failed"}, True),
     ({"state": NO_UNIT}, False), ({"state": "unreachable"}, True),
     # the orchestrator's gate
     ({"state": "active", "health": "ok", "gate": "active", "serving": "serving: x", "serving_state": "serving"},
      False),
     ({"state": "active", "health": "ok", "gate": "active", "serving": "loading: x", "serving_state": "loading"}, True),
     ({"state": "active", "health": "ok", "gate": "active", "serving": "down: x", "serving_state": "down"}, True),
     ({"state": "active", "health": "ok", "gate": "active", "serving": "gate not running (state 12 s old)",
       "serving_state": None}, True),
     ({"state": "active", "health": "ok", "gate": "failed", "serving": "serving: x", "serving_state": "serving"}, True),
     # a worker's guard and link
     ({"state": "active", "guard": "active", "link": "ok"}, False),
     ({"state": "active", "guard": "active", "link": None}, False),  # llama-server does not use it
     ({"state": "active", "guard": "active", "link": "unknown"}, False),  # the orchestrator's row tells why
     ({"state": "active", "guard": "active", "link": "stalled"}, True),
     ({"state": "active", "guard": "active", "link": "lost"}, True),
     ({"state": "active", "guard": "inactive", "link": "ok"}, True)],
)
def test_is_bad(row, bad):
    assert is_bad(row) is bad


@pytest.mark.parametrize(
    ("layout", "units"),
    [(HostLayout("w", False, True, "/opt/x", None, ("a.service", "b.service"), "/c"),
      f"-u a.service -u b.service -u {constants.RPC_GUARD_UNIT}"),
     (ORCH, f"-u {constants.LLAMA_SERVER_UNIT} -u {constants.GATE_UNIT}"),
     (HostLayout("solo", True, True, "/opt/x", constants.LLAMA_SERVER_UNIT, ("a.service",), "/c"),
      f"-u {constants.LLAMA_SERVER_UNIT} -u a.service -u {constants.GATE_UNIT} -u {constants.RPC_GUARD_UNIT}")],
)
def test_journal_command_names_every_unit_and_its_helpers(layout, units):
    assert journal_command(layout, 20) == f"journalctl {units} -n 20 --no-pager -o short-iso"


def test_journal_of_a_host_without_units_is_a_user_error():
    with pytest.raises(UserError, match="s is neither the orchestrator nor a worker"):
        journal_command(HostLayout("s", False, False, "/opt/x", None, (), None), 20)


# End to end on this machine

def test_fleet_status_reads_every_host_record_then_its_facts(machine_fleet):
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
    assert rows["lab4"]["role"] == "worker"  # from the inventory groups, though the host could not be read
    assert [is_bad(rows[h]) for h in rows] == [False, False, True, True]
    # one session for the deployment records, one for the facts (none for lab4, whose record could not be read)
    assert sorted(h for h, _ in machine_fleet.connector.calls) == ["lab1", "lab1", "lab2", "lab2", "lab3", "lab3",
                                                                   "lab4"]
    # the gate (its recorded serving state, written now) and the guards, read in the same session
    assert (orch["gate"], orch["serving"], orch["serving_state"]) == (
        "active", "serving: llama-server is serving", "serving")
    assert 1700 <= orch["serving_since"] <= 1703 and orch["gate_restarts"] == 1
    assert orch["gate_state"] == json.loads(machine_fleet.gate_state_file.read_text())
    assert [(rows[h]["guard"], rows[h]["link"]) for h in ("lab2", "lab3")] == [("active", "ok"), ("active", "ok")]
    assert "guard" not in orch and "link" not in rows["lab4"]


@pytest.mark.parametrize(
    ("name", "age", "changes", "serving", "links"),
    [
        ("down_stalled", 0, {}, "down: worker lab3 (10.77.0.13:50052) stopped acknowledging", ("ok", "stalled")),
        ("serving", 0, {"state": "loading", "reason": "llama-server is loading the model"},
         "loading: llama-server is loading the model", ("ok", "ok")),
        ("serving", 42, {}, "gate not running (state 4", ("unknown", "unknown")),  # 42 s, 43 if a second ticks
        # the gate names only the workers llama-server uses
        ("serving", 0, {"workers": {"lab3": {"link": "lost"}}}, "serving: ", (None, "lost")),
    ],
)
def test_fleet_status_shows_what_the_gate_wrote(machine_fleet, name, age, changes, serving, links):
    machine_fleet.write_gate_state(name, age, **changes)
    rows = {r["host"]: r for r in fleet_status(machine_fleet.fleet)}
    assert rows["lab1"]["serving"].startswith(serving) and is_bad(rows["lab1"]) is not serving.startswith("serving")
    assert (rows["lab2"]["link"], rows["lab3"]["link"]) == links
    assert is_bad(rows["lab2"]) is (links[0] in ("stalled", "lost"))


def test_fleet_status_without_a_state_file(machine_fleet):
    machine_fleet.gate_state_file.unlink()
    rows = {r["host"]: r for r in fleet_status(machine_fleet.fleet)}
    assert rows["lab1"]["serving"] == "gate not running (no state file)" and rows["lab1"]["health"] == "ok"
    assert rows["lab2"]["link"] == "unknown" and is_bad(rows["lab1"]) and not is_bad(rows["lab2"])


def test_a_state_file_that_is_not_the_gates_is_reported_not_raised(machine_fleet):
    machine_fleet.gate_state_file.write_text('{"state": "serving"}\n', encoding="utf-8")
    orch = next(r for r in fleet_status(machine_fleet.fleet) if r["host"] == "lab1")
    assert orch["state"] == "active" and orch["serving"] == "gate not running (state file has since None, not a number)"


def test_no_health_check_when_llama_server_is_not_active(machine_fleet, tmp_path):
    show = tmp_path / "show.txt"
    show.write_text("NRestarts=0\nId=llamafleet-llama-server.service\nLoadState=loaded\nActiveState=failed\n"
                    "SubState=failed\nActiveEnterTimestamp=\n", encoding="utf-8")
    machine_fleet.connector.answer = _with_env(machine_fleet.connector.answer, FAKE_SYSTEMCTL_SHOW=str(show))
    orch = next(r for r in fleet_status(machine_fleet.fleet) if r["host"] == "lab1")
    assert orch["state"] == "failed" and "health" not in orch
    assert machine_fleet.server.seen == []
    # that file knows no gate unit either: systemctl calls it inactive, and the fresh state file does not count
    assert (orch["gate"], orch["serving"]) == ("inactive", f"gate not running ({constants.GATE_UNIT} is inactive)")


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


def test_status_follows_the_deployment_record_over_the_inventory(machine_fleet):
    """A worker whose role ran with another cache folder and unit names (set in a play, not the inventory):
    status reads the record the role wrote and reports the real units and cache."""
    import json

    lab2_home = machine_fleet.fleet.hosts["lab2"].vars["rpc_server_home"]
    moved = Path(lab2_home).parent / "elsewhere"
    moved.mkdir()
    (moved / "a").write_bytes(bytes(10))
    record = {"schema": constants.DEPLOYMENT_RECORD_SCHEMA, "collection_version": "0.1.0", "sections": {
        "rpc_server": {"units": ["llamafleet-rpc-server-cuda0.service"], "cache_dir": str(moved),
                       "guard_unit": constants.RPC_GUARD_UNIT}}}
    machine_fleet.record_file.write_text(json.dumps(record))
    rows = {r["host"]: r for r in fleet_status(machine_fleet.fleet)}
    assert rows["lab2"]["unit"] == "llamafleet-rpc-server-cuda0.service" and rows["lab2"]["recorded"] is True
    assert rows["lab2"]["cache_files"] == 1
    assert rows["lab1"]["recorded"] is False  # the orchestrator has no llama_server section in this record


def test_a_record_from_a_newer_llamafleet_is_refused_per_host(machine_fleet):
    import json

    machine_fleet.record_file.write_text(json.dumps({"schema": constants.DEPLOYMENT_RECORD_SCHEMA + 1,
                                                     "collection_version": "9.0.0", "sections": {}}))
    rows = {r["host"]: r for r in fleet_status(machine_fleet.fleet)}
    assert rows["lab2"]["state"] == "unreachable" or "error" in rows["lab2"]
    assert "written by a newer llamafleet" in rows["lab2"]["error"] and "9.0.0" in rows["lab2"]["error"]
