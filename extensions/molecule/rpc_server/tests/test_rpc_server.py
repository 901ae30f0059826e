"""The worker runs rpc-server as designed: user, unit, socket, cache, firewall."""

import os

import pytest
import testinfra.utils.ansible_runner

INVENTORY = os.path.join(os.environ["MOLECULE_PROJECT_DIRECTORY"], "inventories", "lab", "hosts.ini")
# molecule hands pytest its own (empty) inventory: name the lab's inventory in each host spec
testinfra_hosts = [
    f"ansible://{name}?ansible_inventory={INVENTORY}"
    for name in testinfra.utils.ansible_runner.AnsibleRunner(INVENTORY).get_hosts("llamafleet_workers")
]
UNIT = "llamafleet-rpc-server.service"


@pytest.fixture(autouse=True)
def journal_on_failure(host, request):
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(host.run(f"journalctl -u {UNIT} -n 40 --no-pager").stdout)


def test_service_user_is_a_system_account(host):
    user = host.user("llamafleet-rpc")
    assert user.exists
    assert user.shell == "/usr/sbin/nologin"
    assert user.uid < 1000


def test_unit_is_running_hardened(host):
    service = host.service(UNIT)
    assert service.is_running and service.is_enabled
    props = host.run(f"systemctl show -p User,NoNewPrivileges,ProtectSystem,Restart {UNIT}").stdout
    assert "User=llamafleet-rpc" in props
    assert "NoNewPrivileges=yes" in props
    assert "ProtectSystem=strict" in props
    assert "Restart=always" in props


def test_binds_the_cluster_address_only(host):
    address = host.ansible.get_variables()["llamafleet_cluster_address"]
    assert host.socket(f"tcp://{address}:50052").is_listening
    assert not host.socket("tcp://0.0.0.0:50052").is_listening


def test_cache_is_private_and_seeded(host):
    cache = host.file("/var/lib/llamafleet-rpc/cache/rpc")
    assert cache.is_directory
    assert cache.user == "llamafleet-rpc" and cache.mode == 0o700
    files = host.run("ls /var/lib/llamafleet-rpc/cache/rpc").stdout.split()
    # gemma-3-270m has one tensor over 10 MiB (token_embd): its FNV-1a 64 name
    assert len(files) == 1 and len(files[0]) == 16


def test_firewall_admits_only_the_orchestrator(host):
    rules = host.run("nft list table inet llamafleet_rpc").stdout
    assert "tcp dport 50052 ip saddr 10.77.0.11 accept" in rules
    assert "reject" in rules
