"""playbooks/teardown.yml and the roles' teardown entry points fit together.

- The first play only looks (assert, find, stat), on every host of the fleet, with any_errors_fatal, before any play
  that changes something: a host never deployed stops the run before anything changes anywhere.
- Every role deploy.yml applies has a teardown entry point, and teardown.yml includes each, the model's before
  llama_server's (whose home holds the model folder by default).
- Each role that creates a service user removes the same one (the same variables) in its teardown.
- The switches the roles read are the ones the playbook checks, and each entry point documents those it reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ROLES = REPO / "roles"
FLEET = "{{ llamafleet_teardown_hosts | default(lookup('llamafleet.cluster.constants', 'group_fleet')) }}"
READ_ONLY = {"ansible.builtin.assert", "ansible.builtin.find", "ansible.builtin.stat", "ansible.builtin.debug"}
SWITCH = re.compile(r"\bllamafleet_teardown_[a-z_]+\b")


def _load(path: Path):
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _module(task: dict) -> str:
    return next(key for key in task if key.startswith("ansible.builtin.") or key.startswith("llamafleet.cluster."))


PLAYS = _load(REPO / "playbooks" / "teardown.yml")
DEPLOY_ROLES = [role["role"].rsplit(".", 1)[1] for play in _load(REPO / "playbooks" / "deploy.yml")
                for role in play.get("roles", [])]


def _includes(tasks: list[dict]) -> list[tuple[str, str]]:
    """(role, entry point) of each include_role, in order."""
    return [(t["ansible.builtin.include_role"]["name"].rsplit(".", 1)[1], t["ansible.builtin.include_role"]["tasks_from"])
            for t in tasks if "ansible.builtin.include_role" in t]


def test_the_first_play_only_looks_on_every_host_and_stops_all() -> None:
    first, *rest = PLAYS
    assert first["hosts"] == FLEET and first["any_errors_fatal"] is True
    assert {_module(t) for t in first["tasks"]} <= READ_ONLY, [_module(t) for t in first["tasks"]]
    assert "llamafleet_teardown_force" in first["tasks"][-1]["ansible.builtin.assert"]["that"]
    assert rest and all(play["hosts"] == FLEET and play.get("any_errors_fatal") for play in rest)


def test_every_deployed_role_is_torn_down_model_before_llama_server() -> None:
    assert sorted(DEPLOY_ROLES) == ["edge", "llama_server", "llamacpp_build", "model", "rpc_server"]
    included = [role for play in PLAYS[1:] for role, entry in _includes(play["tasks"]) if entry == "teardown"]
    assert sorted(included) == sorted(DEPLOY_ROLES)
    assert included.index("model") < included.index("llama_server")
    for role in DEPLOY_ROLES:
        assert (ROLES / role / "tasks" / "teardown.yml").is_file(), role
        assert "teardown" in _load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"], role


def _common_include(role: str, tasks_file: str, entry: str) -> dict | None:
    """The vars of the role's include of _common ``entry`` in ``tasks_file``, or None."""
    for task in _load(ROLES / role / "tasks" / tasks_file) or []:
        include = task.get("ansible.builtin.include_role") or {}
        if include.get("name") == "llamafleet.cluster._common" and include.get("tasks_from") == entry:
            return task.get("vars", {})
    return None


@pytest.mark.parametrize("role", ["rpc_server", "llama_server"])
def test_the_service_user_a_role_creates_is_the_one_it_removes(role: str) -> None:
    created = _common_include(role, "install.yml", "user")
    removed = _common_include(role, "teardown.yml", "user_absent")
    assert created and removed
    assert {k: created[k] for k in ("_common_user_name", "_common_user_home")} == removed


def _switches(text: str) -> set[str]:
    return set(SWITCH.findall(text))


@pytest.mark.parametrize("role", ["llama_server", "llamacpp_build", "model", "rpc_server"])
def test_roles_read_only_the_checked_switches_and_document_them(role: str) -> None:
    checked = set(PLAYS[0]["vars"]["_llamafleet_teardown_switches"])
    read = _switches((ROLES / role / "tasks" / "teardown.yml").read_text(encoding="utf-8"))
    assert read and read <= checked, (read, checked)
    options = _load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"]["teardown"]["options"]
    assert {name for name in options if SWITCH.fullmatch(name)} == read
    assert all(options[name]["type"] == "bool" and options[name]["default"] is False for name in read)


def test_the_playbook_reads_only_the_checked_switches() -> None:
    checked = set(PLAYS[0]["vars"]["_llamafleet_teardown_switches"])
    # llamafleet_teardown_hosts names a group (deploy.yml's hosts that left the fleet), not a switch
    used = _switches((REPO / "playbooks" / "teardown.yml").read_text(encoding="utf-8")) - {"llamafleet_teardown_hosts"}
    assert used == checked, used ^ checked
