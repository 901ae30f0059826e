"""host_firewall and host_firewall_facts modules on a pretend firewalld/ufw host: check, apply, again, the state file."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils.basic import AnsibleModule
from tests.unit.firewall_sim import FirewallHost

from llamafleet.core.constants import (
    HOST_FIREWALL_COMMENT,
    HOST_FIREWALL_STATE,
)
from ansible_collections.llamafleet.cluster.plugins.modules import host_firewall, host_firewall_facts
from tests.unit.module_runner import run_four, run_main, warning_messages

MODULES = Path(__file__).resolve().parents[4] / "plugins" / "modules"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> FirewallHost:
    fake = FirewallHost(firewalld="running")
    monkeypatch.setattr(AnsibleModule, "run_command", lambda self, argv, **kw: fake.run(argv))
    monkeypatch.setattr(AnsibleModule, "get_bin_path", lambda self, name, *a, **kw: fake.which(name))
    return fake


def apply(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(host_firewall.main, args, capsys)


def test_check_apply_apply_check_then_a_client_leaves(host: FirewallHost, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "etc" / "host-firewall.json"
    base = {"clients": ["10.77.0.11", "10.77.0.99"], "ports": [50052], "address": "10.77.0.13",
            "state_path": str(state)}

    def nothing_done_in_check_mode(extra: dict[str, Any], result: dict[str, Any]) -> None:
        if extra.get("_ansible_check_mode") and result["changed"]:
            assert not state.exists() and host.changes() == []

    results = run_four(host_firewall.main, base, capsys, nothing_done_in_check_mode)
    check, applied = results[:2]
    assert check["added"] == applied["added"] and len(applied["added"]) == 4   # 2 clients x runtime/permanent
    assert check["diff"]["before"] == "" and check["diff"]["after"].count("\n") == 4
    assert "diff" not in applied
    recorded = json.loads(state.read_text())["rules"]
    assert sorted(r["client"] for r in recorded) == ["10.77.0.11", "10.77.0.99"]
    assert {r["zone"] for r in recorded} == {"public"} and len(host.permanent["public"]) == 2
    # 10.77.0.99 leaves: its rules go, runtime and permanent
    rc, left = apply({**base, "clients": ["10.77.0.11"]}, capsys)
    assert rc == 0 and left["changed"] and len(left["removed"]) == 2
    assert [r["client"] for r in json.loads(state.read_text())["rules"]] == ["10.77.0.11"]
    assert len(host.runtime["public"]) == len(host.permanent["public"]) == 1


def test_no_manager_writes_no_state_file(host: FirewallHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host.firewalld = "absent"
    state = tmp_path / "host-firewall.json"
    rc, result = apply({"clients": ["10.77.0.11"], "ports": [50052], "address": "10.77.0.13",
                        "state_path": str(state)}, capsys)
    assert rc == 0 and result["changed"] is False and result["manager"] == "none"
    assert not state.exists()


def test_forgets_a_purged_manager_with_a_warning(host: FirewallHost, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "host-firewall.json"
    args = {"clients": ["10.77.0.11"], "ports": [50052], "address": "10.77.0.13", "state_path": str(state)}
    assert apply(args, capsys)[1]["changed"]
    host.firewalld = "absent"
    rc, result = apply(args, capsys)
    assert rc == 0 and result["changed"] is True and json.loads(state.read_text())["rules"] == []
    messages = warning_messages(result)
    assert any("firewalld is no longer installed" in m for m in messages)
    assert apply(args, capsys)[1]["changed"] is False


def test_named_manager_not_active_fails(host: FirewallHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = apply({"manager": "ufw", "clients": ["10.77.0.11"], "ports": [50052], "address": "10.77.0.13",
                        "state_path": str(tmp_path / "s.json")}, capsys)
    assert rc == 1 and result["msg"] == "ufw is not installed on this host"


def test_facts_module(host: FirewallHost, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_main(host_firewall_facts.main, {}, capsys)
    assert rc == 0 and result["changed"] is False
    assert (result["manager"], result["problem"]) == ("firewalld", None)
    assert result["facts"]["firewalld"] == {"installed": True, "active": True, "status": "running"}
    assert result["facts"]["nft_tables"] == ["inet llamafleet_rpc", "inet firewalld"]
    host.firewalld = "stopped"
    rc, result = run_main(host_firewall_facts.main, {"manager": "firewalld"}, capsys)
    assert result["problem"] == "rpc_server_host_firewall=firewalld: firewalld is not active (not running) on this host"
    assert host.changes() == []


def _documentation(module: str) -> dict:
    tree = ast.parse((MODULES / (module + ".py")).read_text(encoding="utf-8"))
    doc = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", "") == "DOCUMENTATION")
    return yaml.safe_load(doc)["options"]


def test_documented_defaults_equal_the_constants() -> None:
    options = _documentation("host_firewall")
    assert options["state_path"]["default"] == HOST_FIREWALL_STATE
    assert options["comment"]["default"] == HOST_FIREWALL_COMMENT
    assert options["manager"]["choices"] == _documentation("host_firewall_facts")["manager"]["choices"]
