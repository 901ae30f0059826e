"""Hosts that joined or left the fleet between deploys (module_utils/fleet_changes.py)."""

from __future__ import annotations

import pytest

from llamafleet.core.fleet_changes import (
    RECORD_SCHEMA,
    FleetRecordError,
    fleet_changes,
    orchestrator_moved_problem,
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
    fleet_lines = [line for line in changes["report"] if " the fleet" in line]
    assert len(fleet_lines) == len(added) + len(removed), changes["report"]
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


def test_a_host_that_leaves_the_workers_but_stays_the_orchestrator():
    """lab1 was orchestrator and worker; now only orchestrator: its worker role goes (reported), nothing else."""
    last = record_of(lab1=["orchestrator", "worker"], lab2=["worker"], lab3=["worker"])
    changes = fleet_changes(last, ["lab1", "lab2", "lab3"], HOSTVARS, GROUPS, PATH)
    assert (changes["added"], changes["removed"]) == ([], [])
    assert changes["left_roles"] == [{"name": "lab1", "roles": ["worker"], "stays": ["orchestrator"]}]
    assert changes["report"] == ["lab1 is no longer a worker (it stays the orchestrator): its rpc-server units and "
                                 "firewall rules are removed; its user and weight cache stay (playbooks/teardown.yml "
                                 "takes them)"]
    assert changes["record"]["hosts"]["lab1"]["roles"] == ["orchestrator"]
    assert orchestrator_moved_problem(changes) == ""


def test_a_host_that_takes_a_second_role_is_reported_and_a_swap_is_not_a_gain():
    """lab1, the orchestrator, becomes a worker too; lab2, a worker, becomes the orchestrator too once lab1 left: each
    is named with what the new role brings. A host that swaps roles lost one: the other lines and the preflight's
    refusal speak of it, not this one; a deploy of the same fleet reports nothing."""
    last = record_of(lab1=["orchestrator"], lab2=["worker"], lab3=["worker"])
    both = {"llamafleet_orchestrator": ["lab1"], "llamafleet_workers": ["lab1", "lab2", "lab3"]}
    changes = fleet_changes(last, ["lab1", "lab2", "lab3"], HOSTVARS, both, PATH)
    assert changes["gained_roles"] == [{"name": "lab1", "roles": ["worker"], "had": ["orchestrator"]}]
    assert changes["left_roles"] == [] and orchestrator_moved_problem(changes) == ""
    assert changes["report"] == ["lab1 is now a worker too (it stays the orchestrator): an rpc-server runs there "
                                 "beside llama-server, and the plan counts the memory llama-server leaves it"]
    again = fleet_changes(changes["record"], ["lab1", "lab2", "lab3"], HOSTVARS, both, PATH)
    assert again["gained_roles"] == [] and again["report"] == []

    promoted = {"llamafleet_orchestrator": ["lab2"], "llamafleet_workers": ["lab2", "lab3"]}
    changes = fleet_changes(last, ["lab2", "lab3"], HOSTVARS, promoted, PATH)
    assert changes["gained_roles"] == [{"name": "lab2", "roles": ["orchestrator"], "had": ["worker"]}]
    assert changes["report"][-1] == ("lab2 is now the orchestrator too (it stays a worker): llama-server, the gate "
                                     "and the edge run there beside its rpc-server")

    swapped = {"llamafleet_orchestrator": ["lab3"], "llamafleet_workers": ["lab1", "lab2"]}
    changes = fleet_changes(last, ["lab1", "lab2", "lab3"], HOSTVARS, swapped, PATH)
    assert changes["gained_roles"] == [] and not any(" too (it stays " in line for line in changes["report"])


def test_an_orchestrator_that_stays_as_a_worker_stops_the_deploy():
    """The orchestrator moved from lab1 to lab3 and lab1 stays a worker: the preflight's message names lab1 and the
    teardown to run first. A first deploy (no record) and an orchestrator that left the fleet are no problem."""
    last = record_of(lab1=["orchestrator"], lab2=["worker"], lab3=["worker"])
    moved = {"llamafleet_orchestrator": ["lab3"], "llamafleet_workers": ["lab1", "lab2"]}
    changes = fleet_changes(last, ["lab1", "lab2", "lab3"], HOSTVARS, moved, PATH)
    assert changes["left_roles"] == [{"name": "lab1", "roles": ["orchestrator"], "stays": ["worker"]},
                                     {"name": "lab3", "roles": ["worker"], "stays": ["orchestrator"]}]
    assert orchestrator_moved_problem(changes) == (
        "lab1 was the orchestrator of the last deploy and stays in the fleet as worker: its llama-server, gate and "
        "edge would go on serving the old plan there. Moving the orchestrator takes two runs: playbooks/teardown.yml "
        "-l lab1 first (users, caches and builds stay), then this deploy. Nothing was changed.")
    assert orchestrator_moved_problem(fleet_changes({}, ["lab1", "lab2", "lab3"], HOSTVARS, moved, PATH)) == ""
    gone = {"llamafleet_orchestrator": ["lab3"], "llamafleet_workers": ["lab2"]}
    left = fleet_changes(last, ["lab2", "lab3"], HOSTVARS, gone, PATH)
    assert [r["name"] for r in left["removed"]] == ["lab1"] and orchestrator_moved_problem(left) == ""


def test_a_host_left_out_by_limit_keeps_the_role_it_left_for_the_next_deploy():
    last = record_of(lab1=["orchestrator", "worker"], lab2=["worker"], lab3=["worker"])
    changes = fleet_changes(last, ["lab1", "lab2", "lab3"], HOSTVARS, GROUPS, PATH)
    assert with_pending(changes["record"], [], [], changes["left_roles"], [])["hosts"]["lab1"]["roles"] == [
        "orchestrator"]
    kept = with_pending(changes["record"], [], [], changes["left_roles"], ["lab1"])
    assert kept["hosts"]["lab1"]["roles"] == ["orchestrator", "worker"]
    assert fleet_changes(kept, ["lab1", "lab2", "lab3"], HOSTVARS, GROUPS, PATH)["left_roles"] == [
        {"name": "lab1", "roles": ["worker"], "stays": ["orchestrator"]}]
