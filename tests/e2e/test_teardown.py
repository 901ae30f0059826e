"""teardown.yml end to end on the deployed lab, then deploy.yml again.

Runs last (tests/e2e/conftest.ORDER): teardown takes the cluster away, so a failure here must not cascade into the
other files (they share one deployed lab, in that order). The last test deploys again and asserts the cluster serves a
completion: that a torn-down fleet deploys as before is part of what teardown promises (users, ports, the
firewall table and the API key come back), and it leaves the lab deployed for LLAMAFLEET_KEEP_LAB=1 runs.

In order, on the 3-host lab (lab1 the orchestrator, two workers):
- ``--check --diff`` reports changes on every host and changes nothing; the cluster still serves;
- the default teardown removes every unit, the nftables table, /etc/llamafleet, the helpers and the gate's ping
  permission (the kernel's range set back), stops and disables the edge (HAProxy, on by default on the orchestrator)
  and removes its copies of the key and certificate and its drop-in, and keeps the users, the model (on the
  orchestrator), the weight cache (a worker's share) and the builds;
- run again it changes nothing (what it kept shows the hosts were deployed: no force needed);
- the last worker torn down completely (``--limit``), a run on all hosts fails naming it alone and changes nothing
  anywhere;
- the complete teardown with ``llamafleet_teardown_force`` leaves nothing of llamafleet on any host;
- on hosts with nothing left, a run fails naming every host, and a forced one changes nothing;
- deploy.yml brings the cluster back.
"""

from __future__ import annotations

import json
import posixpath
import re

import pytest
import yaml

from llamafleet.cluster import Endpoint
from llamafleet.core import constants as c
from llamafleet.core.teardown import EMPTY_PING_GROUP_RANGE
from tests.helpers import REPO, playbook

ALL = {"llamafleet_teardown_users": True, "llamafleet_teardown_caches": True, "llamafleet_teardown_builds": True}
FORCE = {"llamafleet_teardown_force": True}
USERS = (c.LLAMA_SERVER_USER, c.RPC_SERVER_USER)


def _role_value(role: str, kind: str, name: str) -> object:
    """A role's default (``kind`` defaults) or private variable (``kind`` vars), as the lab leaves them."""
    with (REPO / "roles" / role / kind / "main.yml").open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)[name]


PING_SYSCTL = str(_role_value("llama_server", "vars", "_llama_server_ping_sysctl"))
BUILD_FOLDERS = posixpath.dirname(str(_role_value("llamacpp_build", "defaults", "llamacpp_build_work_dir")))
METRICS_FILE = posixpath.join(str(_role_value("rpc_server", "defaults", "rpc_server_textfile_dir")), c.RPC_METRICS_FILE)
# Everything of llamafleet a deploy leaves on a host's file system (the lab uses the roles' default paths), and what
# changes while the cluster runs (the gate's state file, the workers' textfile metrics): there, only whether it is.
# The edge's (roles/edge): its folder of root-only copies and its drop-in in HAProxy's unit.
EDGE_DROPIN = posixpath.join(c.SYSTEMD_DIR, "haproxy.service.d", "llamafleet.conf")
ROOTS = sorted({c.CONFIG_DIR, c.LIBEXEC_DIR, c.RPC_WAIT_HELPER, posixpath.dirname(c.LLAMACPP_ROOT), c.LLAMA_SERVER_HOME,
                c.MODEL_DIR, c.RPC_SERVER_HOME, BUILD_FOLDERS, PING_SYSCTL, c.EDGE_CONFIG_DIR, EDGE_DROPIN})
RUNTIME = sorted({posixpath.dirname(c.GATE_STATE_PATH), c.BENCH_RUN_DIR, METRICS_FILE})
PORTS = (c.LLAMA_SERVER_PORT, c.LLAMA_SERVER_GATE_PORT, c.LLAMA_SERVER_BACKEND_PORT, c.RPC_SERVER_PORT)
UNITS = c.UNIT_PREFIX + "*"
FIREWALL_TABLE = c.RPC_FIREWALL_TABLE

# One shell script, one section per kind; lines stable while nothing changes (a oneshot's pid is left out: the
# textfile metrics service runs every few seconds).
SURVEY = "\n".join([
    "echo '== units'",
    f"for u in $( (systemctl list-units --all --plain --no-legend --full '{UNITS}'; "
    f"systemctl list-unit-files --no-legend '{UNITS}') | awk '{{print $1}}' | sort -u); do",
    "  if [ \"$(systemctl show -p Type --value \"$u\")\" = oneshot ]; then p=Id,UnitFileState;",
    "  else p=Id,UnitFileState,MainPID,ExecMainStartTimestampMonotonic; fi",
    "  systemctl show -p \"$p\" --value \"$u\" | paste -sd' ' -; done",
    "echo '== unit files'",
    f"find {c.SYSTEMD_DIR} /run/systemd/system -name '{UNITS}' 2>/dev/null | sort",
    "echo '== files'",
    f"for p in {' '.join(ROOTS)}; do [ -e \"$p\" ] && find \"$p\" -maxdepth 3 -printf '%p %u %s %T@\\n'; done | sort -u",
    "echo '== runtime'",
    f"for p in {' '.join(RUNTIME)}; do [ -e \"$p\" ] && echo \"$p\"; done",
    "echo '== nft'",
    f"nft list tables 2>/dev/null | grep -F '{FIREWALL_TABLE}'",
    "echo '== users'",
    f"getent passwd {' '.join(USERS)} | cut -d: -f1,3; getent group {' '.join(USERS)} | cut -d: -f1,3",
    "echo '== ping'",
    "cat /proc/sys/net/ipv4/ping_group_range",
    # the edge's HAProxy while it runs or is enabled (Debian's package itself stays)
    "echo '== edge'",
    "systemctl is-enabled haproxy.service 2>/dev/null | grep -x enabled",
    "systemctl is-active haproxy.service 2>/dev/null | grep -x active",
    # state, backlog, local and peer address: a listener's Recv-Q is its accept queue at that instant (1 while a
    # health probe waits to be accepted), not something a deploy changed
    "echo '== ports'",
    "ss -Hltn '( " + " or ".join(f"sport = :{port}" for port in PORTS) + " )' | awk '{print $1, $3, $4, $5}'",
    "true",
])


def survey(fleet, hosts=None) -> dict[str, dict[str, list[str]]]:
    """``{host: {section: lines}}``: what of llamafleet each host has."""
    found = {}
    for name, res in fleet.run(SURVEY, hosts, timeout=120).items():
        assert res.ok, f"{name}: {res.reason}"
        sections: dict[str, list[str]] = {}
        current = None
        for line in res.stdout.splitlines():
            if line.startswith("== "):
                current = sections.setdefault(line[3:], [])
            elif line.strip() and current is not None:
                current.append(" ".join(line.split()))
        found[name] = sections
    return found


def under(lines: list[str], *roots: str) -> list[str]:
    """The ``files`` lines of paths at or below any of ``roots``."""
    return [line for line in lines if any(line.split()[0] == r or line.split()[0].startswith(r.rstrip("/") + "/")
                                          for r in roots)]


def leftovers(host: dict[str, list[str]]) -> dict[str, list[str]]:
    """The sections of a host's survey that show something of llamafleet (the kernel's ping range aside)."""
    return {name: lines for name, lines in host.items() if name != "ping" and lines}


def teardown(*args: str, **kwargs):
    """teardown.yml with ``args``."""
    return playbook("teardown.yml", *args, timeout=1200, **kwargs)


def named_hosts(output: str) -> set[str]:
    """Hosts the preflight failed for ("HOST: nothing of llamafleet on this host")."""
    return set(re.findall(r"([\w.-]+): nothing of llamafleet on this host", output))


def said(run, text: str) -> bool:
    """Whether the run's output says ``text`` (the callback wraps long messages: blanks are compared as one)."""
    return " ".join(text.split()) in " ".join(run.output.split())


@pytest.fixture(scope="module")
def hosts(fleet):
    workers = sorted(fleet.workers, key=lambda h: h.name)
    assert len(workers) >= 2, "needs two workers"
    return fleet.orchestrator, workers


@pytest.fixture(scope="module")
def ping_before(deployed, fleet):
    """The orchestrator's gate ping setting and the kernel's range before any teardown: (file text, /proc)."""
    orch = fleet.orchestrator
    res = fleet.run(f"cat {PING_SYSCTL} 2>/dev/null; echo ==; cat /proc/sys/net/ipv4/ping_group_range", [orch])
    text, _, current = res[orch.name].stdout.partition("==\n")
    return text, current


def test_check_mode_reports_changes_and_changes_nothing(deployed, fleet, hosts, ping_before):
    """(ping_before is taken here, before any teardown.)"""
    orch, workers = hosts
    before = survey(fleet)
    assert all(before[h.name]["units"] for h in [orch, *workers]), before
    # the edge, on by default, on the orchestrator alone
    assert before[orch.name]["edge"] == ["enabled", "active"], before[orch.name]
    assert under(before[orch.name]["files"], c.EDGE_CONFIG_DIR, EDGE_DROPIN), before[orch.name]["files"]
    assert not any(before[w.name]["edge"] for w in workers), before
    assert all(before[w.name]["nft"] for w in workers), before
    run = teardown("--check", "--diff", "-e", json.dumps(ALL))
    assert run.rc == 0, run.output[-6000:]
    assert all(run.recap[h.name]["changed"] > 0 for h in [orch, *workers]), run.recap
    assert survey(fleet) == before
    Endpoint.of(fleet).wait_healthy(timeout=60)


def test_teardown_removes_the_deployment_and_keeps_users_caches_builds(deployed, fleet, hosts, ping_before):
    orch, workers = hosts
    run = teardown()
    assert run.rc == 0, run.output[-6000:]
    assert all(run.recap[h.name]["changed"] > 0 for h in [orch, *workers]), run.recap
    assert said(run, "keeping the service users, keeping the caches, keeping the llama.cpp builds"), run.output[-6000:]
    after = survey(fleet)
    model = posixpath.join(c.MODEL_DIR, str(orch.var("model_name")))
    for host in [orch, *workers]:
        found = after[host.name]
        gone = {k: found[k] for k in ("units", "unit files", "runtime", "nft", "edge", "ports") if found.get(k)}
        assert gone == {}, (host.name, gone)
        shared = under(found["files"], c.CONFIG_DIR, c.LIBEXEC_DIR, c.RPC_WAIT_HELPER, PING_SYSCTL, c.EDGE_CONFIG_DIR,
                       EDGE_DROPIN)
        assert shared == [], (host.name, shared)
        assert under(found["files"], c.LLAMACPP_ROOT + "/current"), (host.name, "the builds should stay")
    # the whole model lives on the orchestrator only (a worker keeps its share, in its weight cache)
    assert under(after[orch.name]["files"], model), (orch.name, "the model should stay")
    assert any(line.startswith(c.LLAMA_SERVER_USER + ":") for line in after[orch.name]["users"])
    for worker in workers:
        assert any(line.startswith(c.RPC_SERVER_USER + ":") for line in after[worker.name]["users"])
        assert under(after[worker.name]["files"], c.rpc_cache_dir()), (worker.name, "the weight cache should stay")
    # the deploy set the range only where it was empty, and it goes back to empty while it has the deploy's value
    text, current = ping_before
    if text.strip() and current.split() == text.rpartition("=")[2].split():
        assert after[orch.name]["ping"] == [EMPTY_PING_GROUP_RANGE], after[orch.name]["ping"]
    else:
        assert after[orch.name]["ping"] == [" ".join(current.split())], after[orch.name]["ping"]


def test_second_teardown_changes_nothing(deployed, fleet):
    before = survey(fleet)
    run = teardown("--diff")
    assert run.rc == 0, run.output[-6000:]
    assert run.changed == 0, run.output[-6000:]
    assert survey(fleet) == before


def test_a_host_with_nothing_fails_the_run_before_any_change(deployed, fleet, hosts):
    orch, workers = hosts
    last = workers[-1]
    run = teardown("--limit", last.name, "-e", json.dumps(ALL))
    assert run.rc == 0, run.output[-6000:]
    assert leftovers(survey(fleet, [last])[last.name]) == {}
    before = survey(fleet)
    run = teardown("-e", json.dumps(ALL))
    assert run.rc != 0, run.output[-6000:]
    assert named_hosts(run.output) == {last.name}, run.output[-6000:]
    assert said(run, "Nothing was changed on any host. Check the inventory, or set llamafleet_teardown_force=true")
    assert run.changed == 0, run.output[-6000:]
    # the others keep what the default teardown kept: users, model, builds
    assert survey(fleet) == before


def test_forced_complete_teardown_leaves_nothing(deployed, fleet, hosts):
    orch, workers = hosts
    run = teardown("-e", json.dumps({**ALL, **FORCE}))
    assert run.rc == 0, run.output[-6000:]
    assert run.recap[workers[-1].name]["changed"] == 0, run.recap  # torn down already
    assert all(run.recap[h.name]["changed"] > 0 for h in [orch, *workers[:-1]]), run.recap
    for name, found in survey(fleet).items():
        assert leftovers(found) == {}, (name, leftovers(found))


def test_teardown_of_bare_hosts_fails_unless_forced(deployed, fleet, hosts):
    orch, workers = hosts
    run = teardown()
    assert run.rc != 0, run.output[-6000:]
    assert named_hosts(run.output) == {h.name for h in [orch, *workers]}, run.output[-6000:]
    assert run.changed == 0
    run = teardown("--diff", "-e", json.dumps({**ALL, **FORCE}))
    assert run.rc == 0, run.output[-6000:]
    assert run.changed == 0, run.output[-6000:]


def test_deploy_after_teardown_serves(deployed, fleet):
    run = playbook("deploy.yml", timeout=5400)
    assert run.rc == 0, run.output[-8000:]
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=300)
    answer = endpoint.complete("The capital of France is", n_predict=16)
    assert answer["content"].strip(), answer
