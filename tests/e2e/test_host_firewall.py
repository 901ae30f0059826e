"""The workers' rpc allowlist with firewalld active on a worker (deploy.yml, rpc_server_host_firewall: auto).

Runs after test_deploy.py on the 3-host lab: lab1 the orchestrator, two workers.  The last worker (lab3) gets
firewalld (Debian 12: 1.3, nftables backend, default zone public: ssh and dhcpv6-client only); the other (lab2)
stays the nftables-only case.  nftables runs every input base chain, so:

- before the role knows about firewalld, firewalld's zone rejects the orchestrator although our table accepts it;
- after deploy.yml, a rich rule (runtime and permanent) lets the orchestrator in, and only it: a second lab
  host is refused on both workers, by our table's explicit reject, firewalld's zone or not;
- ``firewall-cmd --reload`` keeps both (our table is not firewalld's, the rule is permanent);
- with lab3's interface moved to firewalld's ``trusted`` zone (accepts everything) our table still refuses lab2;
- an orchestrator that leaves (here an extra client given for one run) has its rules removed.

The connects are made from lab hosts, not the controller.  The orchestrator's reach is proven by a completion
after restarting llama-server (it loads over RPC from every worker at start): a bare connect would take the
rpc-server's one client slot.  Finally firewalld is purged and deploy.yml run again, so later tests see the
usual lab.
"""

from __future__ import annotations

# firewalld gone with its permanent configuration (zone files it wrote are not package conffiles) and its table
PURGE = ("systemctl disable --now firewalld; DEBIAN_FRONTEND=noninteractive apt-get purge -y -q firewalld >/dev/null; "
         "rm -rf /etc/firewalld; nft delete table inet firewalld 2>/dev/null; true")

import json
import shlex
import subprocess

import pytest

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from tests.helpers import BIN, INVENTORY, REPO, env, playbook

EXTRA_CLIENT = "10.77.0.99"
TABLE = "inet llamafleet_rpc"


def refused(fleet, source, address: str, port: int) -> bool:
    """Whether a TCP connect from lab host ``source`` to ``address:port`` fails (refused, rejected or timed out)."""
    res = fleet.run(f"timeout 3 bash -c '</dev/tcp/{address}/{port}'", [source])[source.name]
    assert res.error is None, f"{source.name}: {res.error}"
    return not res.ok


def sh(fleet, host, command: str, timeout: float = 60.0) -> str:
    """stdout of ``command`` on ``host``; fails the test naming the host when it fails."""
    res = fleet.run(command, [host], timeout=timeout)[host.name]
    assert res.ok, f"{host.name}: {command}: {res.reason}"
    return res.stdout


def rich_rules(fleet, host) -> dict[str, list[str]]:
    """The rich rules of lab3's default zone, runtime and permanent."""
    return {layer: sh(fleet, host, f"firewall-cmd {flag} --list-rich-rules").splitlines()
            for layer, flag in (("runtime", ""), ("permanent", "--permanent"))}


def recorded(fleet, host) -> list[dict]:
    """The rules the role recorded in the state file ([] without one)."""
    text = sh(fleet, host, f"cat {constants.HOST_FIREWALL_STATE} 2>/dev/null || true")
    return json.loads(text)["rules"] if text.strip() else []


def module(host, name: str, args: dict) -> dict:
    """Run a llamafleet.cluster module ad hoc on one lab host; its result."""
    e = env()
    # minimal: "HOST | SUCCESS => {json}" (core's json callback moved to ansible.posix)
    e.update(ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="minimal", ANSIBLE_CALLBACK_RESULT_FORMAT="json")
    # "-a {}" would be taken for raw parameters: no -a when there are no arguments
    argv = [str(BIN / "ansible"), "-i", str(INVENTORY), host.name, "-m", f"llamafleet.cluster.{name}"]
    proc = subprocess.run(argv + (["-a", json.dumps(args)] if args else []), cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.partition(" => ")[2])


def serves_after_restart(fleet) -> None:
    """llama-server restarted on the orchestrator loads over RPC from every worker and answers."""
    sh(fleet, fleet.orchestrator, f"systemctl restart {constants.LLAMA_SERVER_UNIT}")
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=300)
    answer = endpoint.complete("The capital of France is", n_predict=8)
    assert answer["content"].strip(), answer


def interface_of(fleet, host) -> str:
    """The interface holding the host's cluster address."""
    out = sh(fleet, host, f"ip -o -4 addr show to {host.cluster_address}/32")
    return out.split()[1].split("@")[0]


@pytest.fixture(scope="module")
def hosts(fleet):
    workers = sorted(fleet.workers, key=lambda h: h.name)
    assert len(workers) >= 2, "needs two workers"
    return fleet.orchestrator, workers[0], workers[-1]


def test_rpc_allowlist_holds_with_firewalld(deployed, fleet, hosts):
    orch, plain, fwd = hosts
    port = constants.RPC_SERVER_PORT
    try:
        install = "DEBIAN_FRONTEND=noninteractive apt-get install -y -q firewalld >/dev/null"
        # a leftover of an interrupted run (its permanent rules) must not decide this one
        fleet.run(PURGE, [fwd], timeout=600)
        sh(fleet, fwd, f"({install} || (apt-get update -q >/dev/null && {install})) "
                       "&& systemctl enable --now firewalld && firewall-cmd --state", timeout=600)
        tables = sh(fleet, fwd, "nft list tables")
        assert "inet firewalld" in tables and TABLE in tables, tables
        # (a) our table accepts the orchestrator, firewalld's zone rejects it: the packet must pass both chains
        assert refused(fleet, orch, fwd.cluster_address, port), "firewalld's public zone let the orchestrator in"
        facts = module(fwd, "host_firewall_facts", {})
        assert (facts["manager"], facts["problem"]) == ("firewalld", None), facts

        # a second orchestrator for one run, to see its rules go when it leaves
        clients = [orch.cluster_address, EXTRA_CLIENT]
        run = playbook("deploy.yml", "-e", json.dumps({"rpc_server_allowed_clients": clients}))
        assert run.rc == 0, run.output[-6000:]
        assert "host firewall manager for the rpc-server ports: firewalld" in run.output, run.output[-6000:]
        for layer, rules in rich_rules(fleet, fwd).items():
            assert sorted(r for r in rules if f'port="{port}"' in r) == sorted(
                f'rule family="ipv4" source address="{c}" destination address="{fwd.cluster_address}" '
                f'port port="{port}" protocol="tcp" accept' for c in clients), (layer, rules)
        assert sorted(r["client"] for r in recorded(fleet, fwd)) == sorted(clients)
        assert recorded(fleet, plain) == []

        run = playbook("deploy.yml")
        assert run.rc == 0, run.output[-6000:]
        for layer, rules in rich_rules(fleet, fwd).items():
            assert [r for r in rules if f'port="{port}"' in r] == [
                f'rule family="ipv4" source address="{orch.cluster_address}" destination address='
                f'"{fwd.cluster_address}" port port="{port}" protocol="tcp" accept'], (layer, rules)
        assert [(r["manager"], r["zone"], r["client"]) for r in recorded(fleet, fwd)] == [
            ("firewalld", "public", orch.cluster_address)]
        # on the real firewalld, a second run finds its rule and changes nothing
        again = module(fwd, "host_firewall", {"clients": [orch.cluster_address], "ports": [port],
                                              "address": fwd.cluster_address})
        assert (again["changed"], again["added"], again["removed"]) == (False, [], []), again

        # (b) only the orchestrator: lab2 is refused by lab3 (firewalld + our table) and lab3 by lab2 (our table)
        assert refused(fleet, plain, fwd.cluster_address, port), f"{plain.name} reached {fwd.name}'s rpc-server"
        assert refused(fleet, fwd, plain.cluster_address, port), f"{fwd.name} reached {plain.name}'s rpc-server"
        serves_after_restart(fleet)

        # firewall-cmd --reload rebuilds only firewalld's table from the permanent rules
        sh(fleet, fwd, "firewall-cmd --reload")
        assert TABLE in sh(fleet, fwd, "nft list tables")
        assert all(any(orch.cluster_address in r for r in rules) for rules in rich_rules(fleet, fwd).values())
        assert refused(fleet, plain, fwd.cluster_address, port), "after --reload lab2 reached the rpc-server"
        serves_after_restart(fleet)

        # a zone that accepts everything: our table's reject still holds
        interface = interface_of(fleet, fwd)
        sh(fleet, fwd, f"firewall-cmd --zone=trusted --change-interface={shlex.quote(interface)}")
        assert interface in sh(fleet, fwd, "firewall-cmd --zone=trusted --list-interfaces").split()
        assert refused(fleet, plain, fwd.cluster_address, port), "the trusted zone let lab2 reach the rpc-server"
        # the control: the same connect to ssh works, so the refusals above are the firewall's
        assert not refused(fleet, plain, fwd.cluster_address, 22), f"{plain.name} cannot reach {fwd.name}'s ssh"
    finally:
        fleet.run(PURGE, [fwd], timeout=600)
        restore = playbook("deploy.yml")
        assert restore.rc == 0, restore.output[-6000:]
    assert "inet firewalld" not in sh(fleet, fwd, "nft list tables")
    assert recorded(fleet, fwd) == []
    assert refused(fleet, plain, fwd.cluster_address, port)
    Endpoint.of(fleet).wait_healthy(timeout=120)


UFW_PURGE = ("ufw --force disable >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get purge -y -q ufw >/dev/null; "
             "rm -rf /etc/ufw; true")


def ufw_rules(fleet, host) -> list[str]:
    """Our rules in ``ufw status`` (the lines with the role's comment), blanks squeezed."""
    lines = sh(fleet, host, "ufw status").splitlines()
    return [" ".join(line.split()) for line in lines if constants.HOST_FIREWALL_COMMENT in line]


def test_rpc_allowlist_holds_with_ufw(deployed, fleet, hosts):
    """The same with ufw (Debian 12: 0.36, iptables-nft) active on the last worker, incoming denied by default."""
    orch, plain, host = hosts
    port = constants.RPC_SERVER_PORT
    try:
        install = "DEBIAN_FRONTEND=noninteractive apt-get install -y -q ufw >/dev/null"
        fleet.run(UFW_PURGE, [host], timeout=600)
        # ssh first, so the lab keeps its way in; then deny everything else
        sh(fleet, host, f"({install} || (apt-get update -q >/dev/null && {install})) && ufw allow 22/tcp >/dev/null "
                        "&& ufw default deny incoming >/dev/null && ufw --force enable && ufw status", timeout=600)
        assert refused(fleet, orch, host.cluster_address, port), "ufw's default deny let the orchestrator in"
        facts = module(host, "host_firewall_facts", {})
        assert (facts["manager"], facts["problem"]) == ("ufw", None), facts

        run = playbook("deploy.yml")
        assert run.rc == 0, run.output[-6000:]
        assert "host firewall manager for the rpc-server ports: ufw" in run.output, run.output[-6000:]
        rules = ufw_rules(fleet, host)
        assert len(rules) == 1 and orch.cluster_address in rules[0] and f"{host.cluster_address} {port}/tcp" in rules[0], \
            rules
        assert [(r["manager"], r["client"]) for r in recorded(fleet, host)] == [("ufw", orch.cluster_address)]
        again = module(host, "host_firewall", {"clients": [orch.cluster_address], "ports": [port],
                                               "address": host.cluster_address})
        assert (again["changed"], again["added"], again["removed"]) == (False, [], []), again
        # only the orchestrator: a second lab host is refused, the orchestrator loads over RPC
        assert refused(fleet, plain, host.cluster_address, port), f"{plain.name} reached {host.name}'s rpc-server"
        serves_after_restart(fleet)
        # ufw opened to everyone: our table's reject still holds
        sh(fleet, host, "ufw default allow incoming >/dev/null && ufw reload >/dev/null")
        assert refused(fleet, plain, host.cluster_address, port), "ufw's default allow let lab2 reach the rpc-server"
        assert not refused(fleet, plain, host.cluster_address, 22), f"{plain.name} cannot reach {host.name}'s ssh"
    finally:
        fleet.run(UFW_PURGE, [host], timeout=600)
        restore = playbook("deploy.yml")
        assert restore.rc == 0, restore.output[-6000:]
    assert recorded(fleet, host) == []
    assert refused(fleet, plain, host.cluster_address, port)
    Endpoint.of(fleet).wait_healthy(timeout=120)
