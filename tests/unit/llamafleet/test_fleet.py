"""Fleet: the inventory as ansible-inventory resolves it, host selection, and commands on all hosts at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.fleet import Fleet, GroupResult, Host, RunResult, _ssh_option, group_members, tool

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fleet_of(groups: dict[str, list[str]], hostvars: dict[str, dict] | None = None, connect=None) -> Fleet:
    """A fleet from a minimal ``ansible-inventory --list`` document."""
    data = {g: {"hosts": hosts} for g, hosts in groups.items()}
    data["_meta"] = {"hostvars": hostvars or {}}
    return Fleet.from_inventory_json(data, connect) if connect else Fleet.from_inventory_json(data)


# Inventory parsing

def test_recorded_lab_inventory_hosts_and_connection_settings(lab_inventory):
    fleet = Fleet.from_inventory_json(lab_inventory)
    assert sorted(fleet.hosts) == ["lab1", "lab2", "lab3"]
    lab2 = fleet.hosts["lab2"]
    assert (lab2.address, lab2.user, lab2.port) == ("10.77.0.12", "root", 22)
    assert lab2.key_file == "/var/cache/llamafleet/lab/id_ed25519"
    assert lab2.known_hosts == "/var/cache/llamafleet/lab/known_hosts"
    assert lab2.cluster_address == "10.77.0.12"
    assert fleet.groups[constants.GROUP_FLEET] == ["lab1", "lab2", "lab3"]


def test_recorded_lab_inventory_roles(lab_inventory):
    fleet = Fleet.from_inventory_json(lab_inventory)
    assert fleet.orchestrator.name == "lab1"
    assert [w.name for w in fleet.workers] == ["lab2", "lab3"]
    assert [h.name for h in fleet.members()] == ["lab1", "lab2", "lab3"]
    assert fleet.is_orchestrator(fleet.hosts["lab1"]) and not fleet.is_worker(fleet.hosts["lab1"])
    assert fleet.orchestrator.var("llama_server_port") == 8181


def _has_ansible_inventory() -> bool:
    try:
        return bool(tool("ansible-inventory"))
    except UserError:
        return False


@pytest.mark.skipif(not _has_ansible_inventory(), reason="ansible-inventory is not installed here")
def test_from_inventory_reads_what_ansible_inventory_resolves(lab_inventory):
    """The real ansible-inventory on the recorded inventory's source gives the recorded hosts and vars."""
    live = Fleet.from_inventory(FIXTURES / "inventory_lab3" / "hosts.ini")
    recorded = Fleet.from_inventory_json(lab_inventory)
    assert {n: h.vars for n, h in live.hosts.items()} == {n: h.vars for n, h in recorded.hosts.items()}
    assert live.groups == recorded.groups


def test_a_missing_inventory_is_named(tmp_path):
    with pytest.raises(UserError, match=f"inventory {tmp_path}/hosts.ini does not exist"):
        Fleet.from_inventory(tmp_path / "hosts.ini")


def test_nested_groups_and_hosts_without_vars():
    """Children groups count as members; a host with no vars (absent from _meta) is still a host."""
    data = {
        "all": {"children": ["ungrouped", "llamafleet"]},
        "llamafleet": {"children": ["llamafleet_orchestrator", "llamafleet_workers"]},
        "llamafleet_orchestrator": {"hosts": ["a"]},
        "llamafleet_workers": {"hosts": ["b", "c"], "children": ["gpus"]},
        "gpus": {"hosts": ["d", "b"]},
        "_meta": {"hostvars": {"a": {"ansible_host": "10.0.0.1"}}},
    }
    fleet = Fleet.from_inventory_json(data)
    assert group_members(data, "llamafleet") == ["a", "b", "c", "d"]
    assert sorted(fleet.hosts) == ["a", "b", "c", "d"]
    assert fleet.hosts["d"].address == "d"  # ansible_host defaults to the name, as in Ansible
    assert [w.name for w in fleet.workers] == ["b", "c", "d"]


def test_cyclic_groups_terminate():
    data = {"x": {"hosts": ["h"], "children": ["y"]}, "y": {"children": ["x"], "hosts": ["i"]}}
    assert group_members(data, "x") == ["h", "i"]


@pytest.mark.parametrize(
    ("args", "value"),
    [
        ("-o UserKnownHostsFile=/k/hosts -o StrictHostKeyChecking=yes", "/k/hosts"),
        ("-oUserKnownHostsFile=/k/h2", "/k/h2"),
        ("-o userknownhostsfile=/lower", "/lower"),
        ("-o StrictHostKeyChecking=yes", None),
        ("", None),
    ],
)
def test_ssh_option(args, value):
    assert _ssh_option(args, "UserKnownHostsFile") == value


# Host variables

@pytest.mark.parametrize(
    ("vars_", "default", "expected"),
    [({"p": 8181}, 8080, 8181), ({}, 8080, 8080), ({"p": ""}, 8080, 8080), ({"p": None}, 8080, 8080),
     ({"p": 0}, 8080, 0), ({"p": False}, True, False)],
)
def test_host_var_falls_back_to_the_role_default(vars_, default, expected):
    assert Host("h", "h", vars=vars_).var("p", default) == expected


def test_host_var_refuses_an_untemplated_jinja_value():
    host = Host("lab1", "10.0.0.1", vars={"llama_server_bind_address": "{{ llamafleet_cluster_address }}"})
    with pytest.raises(UserError, match="lab1: llama_server_bind_address is a Jinja expression"):
        host.var("llama_server_bind_address")


def test_cluster_address_prefers_the_cluster_variable():
    assert Host("h", "192.168.1.5", vars={"llamafleet_cluster_address": "10.0.0.5"}).cluster_address == "10.0.0.5"
    assert Host("h", "192.168.1.5").cluster_address == "192.168.1.5"


# Host selection

def test_workers_follow_the_orchestrators_workers_group():
    fleet = fleet_of(
        {constants.GROUP_ORCHESTRATOR: ["o"], constants.GROUP_WORKERS: ["w1"], "gpu_boxes": ["g1", "g2"]},
        {"o": {"llama_server_workers_group": "gpu_boxes"}},
    )
    assert fleet.workers_group == "gpu_boxes"
    assert [w.name for w in fleet.workers] == ["g1", "g2"]
    assert [h.name for h in fleet.members()] == ["g1", "g2", "o"]  # w1 is in no group deploy.yml uses here


def test_no_orchestrator_is_a_user_error_naming_the_group():
    fleet = fleet_of({constants.GROUP_WORKERS: ["w1"]})
    with pytest.raises(UserError, match=constants.GROUP_ORCHESTRATOR):
        _ = fleet.orchestrator
    assert fleet.workers_group == constants.GROUP_WORKERS


# Running commands

def test_run_reaches_every_host_at_the_same_time(connector):
    """Four hosts that each wait for all four: only a parallel run gets through the barrier."""
    barrier = threading.Barrier(4, timeout=5)

    def answer(host, command):
        barrier.wait()
        return 0, f"{host.name}:{command}\n", ""

    conn = connector(answer)
    fleet = fleet_of({"g": ["a", "b", "c", "d"]}, connect=conn)
    results = fleet.run("uptime")
    assert isinstance(results, GroupResult)
    assert {n: r.stdout for n, r in results.items()} == {n: f"{n}:uptime\n" for n in "abcd"}
    assert not results.failed and sorted(results.succeeded) == list("abcd")


def test_run_collects_failures_per_host(connector):
    def answer(host, command):
        if host.name == "down":
            raise TimeoutError("timed out")
        if host.name == "bad":
            return 3, "", "no such unit\n"
        return 0, "ok\n", ""

    fleet = fleet_of({"g": ["up", "down", "bad"]}, connect=connector(answer))
    results = fleet.run("true")
    assert results["up"].ok and results["up"].stdout == "ok\n"
    assert results["down"] == RunResult("down", False, error="TimeoutError: timed out")
    assert (results["bad"].ok, results["bad"].exit_code) == (False, 3)
    assert results["bad"].reason == "no such unit"
    assert sorted(results.failed) == ["bad", "down"]


def test_run_writes_a_command_per_host(connector):
    conn = connector(lambda host, command: (0, command, ""))
    fleet = fleet_of({"g": ["a", "b"]}, {"a": {"x": "1"}, "b": {"x": "2"}}, connect=conn)
    results = fleet.run(lambda h: f"echo {h.var('x')}")
    assert {n: r.stdout for n, r in results.items()} == {"a": "echo 1", "b": "echo 2"}


def test_a_command_that_cannot_be_written_fails_only_its_host(connector):
    conn = connector(lambda host, command: (0, command, ""))
    fleet = fleet_of({"g": ["a", "b"]}, {"b": {"x": "{{ nope }}"}}, connect=conn)
    results = fleet.run(lambda h: f"echo {h.var('x', 'default')}")
    assert results["a"].stdout == "echo default"
    assert not results["b"].ok and "Jinja" in results["b"].error
    assert [c[0] for c in conn.calls] == ["a"]  # nothing was run on b


def test_run_on_no_host_is_empty(connector):
    assert fleet_of({}, connect=connector(lambda h, c: (0, "", ""))).run("true", []) == {}


def test_run_one_returns_stdout_or_names_the_host(connector):
    fleet = fleet_of({"g": ["a"]}, connect=connector(lambda h, c: (0, "42\n", "") if c == "ok" else (1, "", "boom")))
    assert fleet.run_one("ok", fleet.hosts["a"]) == "42\n"
    with pytest.raises(UserError, match=r"^a: reading the answer: boom$"):
        fleet.run_one("fail", fleet.hosts["a"], what="reading the answer")

