"""The lookups of the deploy stamp over a real inventory: the digest of a deploy's inputs (the same inventory digests
the same, a changed variable, extra var or group does not), and the play host patterns once the fleet is in sync."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.errors import AnsibleLookupError
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.vars.hostvars import HostVars
from ansible.vars.manager import VariableManager

from ansible_collections.llamafleet.cluster.plugins.lookup.deploy_hosts import LookupModule as DeployHosts
from ansible_collections.llamafleet.cluster.plugins.lookup.deploy_inputs import LookupModule as DeployInputs
from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import GROUP_IN_SYNC

INVENTORY = """
[llamafleet_orchestrator]
lab1 ansible_host=10.77.0.11

[llamafleet_workers]
lab2 ansible_host=10.77.0.12 rpc_server_threads={threads}
lab3 ansible_host=10.77.0.13

[llamafleet:children]
llamafleet_orchestrator
llamafleet_workers

[llamafleet:vars]
llama_server_ctx_size=2048
edge_tls_cert_file={cert}
"""


def digest(tmp_path: Path, threads: int = 2, extra: dict | None = None, check_mode: bool = False) -> str:
    cert = tmp_path / "edge.pem"
    if not cert.exists():
        cert.write_text("certificate one")
    source = tmp_path / ("hosts-%d.ini" % threads)
    source.write_text(INVENTORY.format(threads=threads, cert=cert))
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(source)])
    manager = VariableManager(loader=loader, inventory=inventory)
    manager._extra_vars = dict(extra or {})  # pylint: disable=protected-access
    HostVars(inventory=inventory, variable_manager=manager, loader=loader)  # the hostvars the play's tasks see
    variables = manager.get_vars(host=inventory.get_host("lab1"), include_hostvars=True)
    variables["ansible_check_mode"] = check_mode
    (value,) = DeployInputs(loader=loader).run([], variables=variables)
    return value


def test_the_same_inventory_digests_the_same_whatever_the_mode(tmp_path: Path) -> None:
    first = digest(tmp_path)
    assert len(first) == 64
    assert digest(tmp_path, check_mode=True) == first
    assert digest(tmp_path, extra={"llamafleet_skip_when_in_sync": False}) == first


def test_a_changed_variable_extra_var_or_controller_file_changes_the_digest(tmp_path: Path) -> None:
    first = digest(tmp_path)
    assert digest(tmp_path, threads=4) != first
    assert digest(tmp_path, extra={"llama_server_ctx_size": 4096}) != first
    (tmp_path / "edge.pem").write_text("certificate two")
    assert digest(tmp_path) != first


def test_deploy_hosts_leave_out_the_hosts_in_sync() -> None:
    lookup = DeployHosts()
    assert lookup.run(["group_fleet", "GROUP_WORKERS"], variables={"groups": {"llamafleet": ["lab1"]}}) == [
        "llamafleet", "llamafleet_workers"]
    in_sync = {"groups": {GROUP_IN_SYNC: ["lab1", "lab2"]}}
    assert lookup.run(["group_orchestrator"], variables=in_sync) == ["llamafleet_orchestrator:!" + GROUP_IN_SYNC]
    with pytest.raises(AnsibleLookupError, match="not a group constant"):
        lookup.run(["llama_server_unit"], variables=in_sync)
