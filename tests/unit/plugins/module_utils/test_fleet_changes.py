"""Hosts that joined or left the fleet between deploys (module_utils/fleet_changes.py)."""

from __future__ import annotations

import pytest

from llamafleet.core.fleet_changes import (
    RECORD_SCHEMA,
    FleetRecordError,
    fleet_changes,
    with_pending,
)

PATH = "/inv/.llamafleet/deployment.json"
GROUPS = {"llamafleet_orchestrator": ["lab1"], "llamafleet_workers": ["lab2", "lab3"]}
HOSTVARS = {name: {"ansible_host": "10.77.0.1%s" % name[-1], "ansible_user": "root", "ansible_port": 22,
                   "ansible_ssh_private_key_file": "/k", "ansible_password": "never-kept", "model_name": "m"}
            for name in ("lab1", "lab2", "lab3", "lab4")}


def record_of(**hosts):
    entries = {n: {"roles": r, "connection": {"ansible_host": "10.0.0.%s" % n[-1]}} for n, r in hosts.items()}
    return {"schema": RECORD_SCHEMA, "hosts": entries}


def test_the_first_deploy_reports_nothing_and_records_every_host():
    changes = fleet_changes({}, ["lab1", "lab2", "lab3"], HOSTVARS, GROUPS, PATH)
    assert (changes["added"], changes["removed"], changes["report"]) == ([], [], [])
    hosts = changes["record"]["hosts"]
    assert {n: h["roles"] for n, h in hosts.items()} == {"lab1": ["orchestrator"], "lab2": ["worker"],
                                                         "lab3": ["worker"]}
    assert hosts["lab2"]["connection"] == {"ansible_host": "10.77.0.12", "ansible_user": "root", "ansible_port": 22,
                                           "ansible_ssh_private_key_file": "/k"}  # no password, no other vars


@pytest.mark.parametrize("last, hosts, groups, added, removed", [
    # lab3 dropped from the inventory
    (record_of(lab1=["orchestrator"], lab2=["worker"], lab3=["worker"]), ["lab1", "lab2"],
     {"llamafleet_orchestrator": ["lab1"], "llamafleet_workers": ["lab2"]}, [], ["lab3"]),
    # lab3 still in the fleet group but in neither role's group
    (record_of(lab1=["orchestrator"], lab2=["worker"], lab3=["worker"]), ["lab1", "lab2", "lab3"],
     {"llamafleet_orchestrator": ["lab1"], "llamafleet_workers": ["lab2"]}, [], ["lab3"]),
    # lab3 joins
    (record_of(lab1=["orchestrator"], lab2=["worker"]), ["lab1", "lab2", "lab3"], GROUPS, ["lab3"], []),
    # the orchestrator becomes a worker and lab3 the orchestrator: nobody left
    (record_of(lab1=["orchestrator"], lab2=["worker"], lab3=["worker"]), ["lab1", "lab2", "lab3"],
     {"llamafleet_orchestrator": ["lab3"], "llamafleet_workers": ["lab1", "lab2"]}, [], []),
])
def test_added_and_removed(last, hosts, groups, added, removed):
    changes = fleet_changes(last, hosts, HOSTVARS, groups, PATH)
    assert changes["added"] == added
    assert [r["name"] for r in changes["removed"]] == removed
    assert len(changes["report"]) == len(added) + len(removed)
    for r in changes["removed"]:  # reached as the last deploy reached it
        assert r["connection"] == last["hosts"][r["name"]]["connection"] and r["roles"] == ["worker"]
        assert any(line.startswith("%s left the fleet (it was worker)" % r["name"]) for line in changes["report"])


def test_an_unreached_host_stays_pending_and_goes_once_reached():
    last = record_of(lab1=["orchestrator"], lab2=["worker"], lab3=["worker"])
    groups = {"llamafleet_orchestrator": ["lab1"], "llamafleet_workers": ["lab2"]}
    changes = fleet_changes(last, ["lab1", "lab2"], HOSTVARS, groups, PATH)
    kept = with_pending(changes["record"], changes["removed"], ["lab3"])
    assert kept["hosts"]["lab3"]["pending_removal"] is True and set(kept["hosts"]) == {"lab1", "lab2", "lab3"}
    again = fleet_changes(kept, ["lab1", "lab2"], HOSTVARS, groups, PATH)
    assert [r["name"] for r in again["removed"]] == ["lab3"]
    assert set(with_pending(again["record"], again["removed"], [])["hosts"]) == {"lab1", "lab2"}


@pytest.mark.parametrize("last, message", [
    ({"schema": 1, "hosts": []}, "not a llamafleet controller record"),
    ([1], "not a llamafleet controller record"),
    ({"schema": RECORD_SCHEMA + 1, "hosts": {}, "collection_version": "9.0.0"}, "reads up to .*9.0.0"),
])
def test_bad_records_name_the_file(last, message):
    with pytest.raises(FleetRecordError, match="^%s .*%s" % (PATH, message)):
        fleet_changes(last, ["lab1"], HOSTVARS, GROUPS, PATH)
