"""The inventory through Ansible's own API: Jinja and vault resolved as a play resolves them, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamafleet.errors import UserError
from llamafleet.fleet import Fleet

PASSWORD = "correct horse battery staple"

HOSTS_INI = """\
[llamafleet_orchestrator]
orch ansible_host=192.0.2.10 llama_server_port="{{ 8000 + 80 }}" ansible_port="{{ 2200 + 22 }}"

[llamafleet_workers]
w1 ansible_host=192.0.2.11
w2 ansible_host=192.0.2.12 llamafleet_cluster_address="{{ ansible_host }}"

[llamafleet:children]
llamafleet_orchestrator
llamafleet_workers
"""


def vault_encrypt(text: str, password: str = PASSWORD) -> str:
    """``text`` encrypted as ansible-vault encrypts it (the real VaultLib)."""
    from ansible.parsing.vault import VaultLib, VaultSecret

    return VaultLib([("default", VaultSecret(password.encode()))]).encrypt(text).decode()


def inline_vault(name: str, text: str) -> str:
    body = "\n".join("  " + line for line in vault_encrypt(text).splitlines())
    return f"{name}: !vault |\n{body}\n"


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    (tmp_path / "hosts.ini").write_text(HOSTS_INI)
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "llamafleet_orchestrator.yml").write_text(
        inline_vault("llama_server_api_key", "sk-from-the-vault") + 'api_key_length: "{{ llama_server_api_key | length }}"\n')
    return tmp_path


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "vault-pass"
    path.write_text(PASSWORD + "\n")
    return path


def test_jinja_values_are_templated_with_the_hosts_variables(inventory, password_file):
    fleet = Fleet.from_inventory(inventory / "hosts.ini", [str(password_file)])
    orch = fleet.orchestrator
    assert orch.var("llama_server_port", 1) == 8080 and type(orch.var("llama_server_port")) is int
    assert (orch.address, orch.port) == ("192.0.2.10", 2222)
    assert fleet.hosts["w2"].cluster_address == "192.0.2.12"
    assert [h.name for h in fleet.workers] == ["w1", "w2"]


def test_vaulted_values_are_decrypted_with_the_password_file(inventory, password_file):
    orch = Fleet.from_inventory(inventory / "hosts.ini", [str(password_file)]).orchestrator
    assert orch.var("llama_server_api_key") == "sk-from-the-vault"
    assert type(orch.var("llama_server_api_key")) is str  # plain, not Ansible's tagged or encrypted types
    assert orch.var("api_key_length") == len("sk-from-the-vault")


def test_the_password_file_can_come_from_ansibles_configuration(inventory, password_file, monkeypatch):
    from ansible import constants as C

    monkeypatch.setattr(C, "DEFAULT_VAULT_PASSWORD_FILE", str(password_file))
    assert Fleet.from_inventory(inventory / "hosts.ini").orchestrator.var("llama_server_api_key") == "sk-from-the-vault"


def test_a_vaulted_value_without_the_password_names_host_variable_and_remedy(inventory):
    orch = Fleet.from_inventory(inventory / "hosts.ini").orchestrator
    assert orch.var("llama_server_port") == 8080  # what needs no vault still reads
    with pytest.raises(UserError, match=r"^orch: llama_server_api_key is vault-encrypted and cannot be decrypted "
                                        r".*--vault-password-file"):
        orch.var("llama_server_api_key")


def test_a_wrong_password_is_an_error_not_a_garbled_value(inventory, tmp_path):
    wrong = tmp_path / "wrong-pass"
    wrong.write_text("not the password\n")
    orch = Fleet.from_inventory(inventory / "hosts.ini", [str(wrong)]).orchestrator
    with pytest.raises(UserError, match="^orch: llama_server_api_key is vault-encrypted"):
        orch.var("llama_server_api_key")


def test_a_wholly_vaulted_group_vars_file_without_the_password_names_the_host(inventory):
    (inventory / "group_vars" / "llamafleet_workers.yml").write_text(vault_encrypt("rpc_server_port: 50060\n"))
    with pytest.raises(UserError, match=r"^w1: Ansible could not read its inventory variables: .*vault"):
        Fleet.from_inventory(inventory / "hosts.ini")


def test_a_wholly_vaulted_group_vars_file_reads_with_the_password(inventory, password_file):
    (inventory / "group_vars" / "llamafleet_workers.yml").write_text(vault_encrypt("rpc_server_port: 50060\n"))
    fleet = Fleet.from_inventory(inventory / "hosts.ini", [str(password_file)])
    assert [h.var("rpc_server_port") for h in fleet.workers] == [50060, 50060]


def test_a_value_that_needs_a_fact_names_host_and_variable(inventory, password_file):
    (inventory / "host_vars").mkdir()
    (inventory / "host_vars" / "w1.yml").write_text('llamafleet_cluster_address: "{{ ansible_default_ipv4.address }}"\n')
    fleet = Fleet.from_inventory(inventory / "hosts.ini", [str(password_file)])
    with pytest.raises(UserError, match=r"^w1: llamafleet_cluster_address cannot be resolved from the inventory alone"):
        fleet.hosts["w1"].cluster_address


def test_a_port_that_is_no_number_names_the_host(tmp_path):
    (tmp_path / "hosts.ini").write_text("[llamafleet_workers]\nw1 ansible_port=twentytwo\n")
    with pytest.raises(UserError, match="^w1: ansible_port is 'twentytwo', not a port number"):
        Fleet.from_inventory(tmp_path / "hosts.ini")


def test_the_default_inventory_is_ansibles_configured_one(inventory, password_file, monkeypatch):
    from ansible import constants as C

    monkeypatch.setattr(C, "DEFAULT_HOST_LIST", [str(inventory / "hosts.ini")])
    assert sorted(Fleet.from_inventory(None, [str(password_file)]).hosts) == ["orch", "w1", "w2"]


def test_an_unparsable_inventory_is_an_error(tmp_path):
    (tmp_path / "hosts.yml").write_text("all: [this is: not an inventory\n")
    with pytest.raises(UserError, match="hosts.yml"):
        Fleet.from_inventory(tmp_path / "hosts.yml")


REPO = Path(__file__).resolve().parents[3]


def test_the_collections_playbook_is_found_where_ansible_finds_it():
    from llamafleet.inventory import collection_playbook

    # this checkout's ansible.cfg (the tests run under it): its committed collections/ link
    found = collection_playbook("llamafleet.cluster.bench")
    assert found.resolve() == (REPO / "playbooks" / "bench.yml").resolve()
    assert found.is_relative_to(REPO / "collections")


def test_bench_fleet_without_the_collection_says_how_to_install_it(tmp_path):
    """A controller where the collection is not installed: a clear error before ansible-playbook runs."""
    import os
    import subprocess
    import sys

    empty = tmp_path / "collections"
    empty.mkdir()
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")
    (tmp_path / "hosts.ini").write_text(HOSTS_INI)
    env = dict(os.environ, ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"), ANSIBLE_COLLECTIONS_PATH=str(empty))
    proc = subprocess.run([sys.executable, "-m", "llamafleet", "bench", "fleet", "-i", str(tmp_path / "hosts.ini"),
                           "--out", str(tmp_path / "results")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "the collection llamafleet.cluster is not installed where Ansible looks for collections (%s)" % empty \
        in proc.stderr, proc.stderr
    assert "ansible-galaxy collection install" in proc.stderr
    assert "PLAY [" not in proc.stdout and not (tmp_path / "results").exists()
