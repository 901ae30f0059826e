"""playbooks/upgrade.yml on the deployed lab: another llama.cpp source, every host or none.

The new source is llama-cpp-python 0.3.35's llama.cpp (RPC protocol 5, where the lab's 0.3.36 has 7: hosts on the
two builds cannot serve together), served by the lab's mirror like the lab's own. In order, on one lab:

1. ``--check`` reports each host's switch and changes nothing.
2. lab3 cannot install the new build (its install folder is taken by a file): the upgrade stops in the build phase,
   naming lab3; no unit restarted, ``current`` unchanged, the cluster serves on.
3. ``--tags llamacpp_build`` installs the new build everywhere ahead of time; nothing restarts.
4. The new rpc-server crashes at start on lab3 (as a ``-march=native`` build does on an older CPU): every host goes
   back to the build it ran, the play fails naming lab3, the cluster serves on the old build.
5. The upgrade: every host runs the new build (units, record, ``current``), llama.cpp's load log matches the plan,
   a completion is served; a second run changes nothing.
6. upgrade.yml back to the lab's source (installed already: no compile), then deploy.yml changes nothing.

The first run compiles 0.3.35 once (the artifact is cached on the controller like the lab's own build).
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from llamafleet.cluster import Endpoint, read_plan, server_log
from llamafleet.core import constants, deployment_record
from llamafleet.core.log_parse import compare_with_plan, parse_load_log
from tests.e2e.conftest import OTHER_LLAMACPP_COMMIT
from tests.helpers import current_builds, invocation, playbook

SWITCH = re.compile(r"(lab\d+): llama\.cpp build (\S+) -> (\S+)")


@pytest.fixture(scope="module")
def new_source(deployed, other_llamacpp_source):
    """The extra vars that point every host at the other llama.cpp source."""
    return ["-e", json.dumps(other_llamacpp_source)]


@pytest.fixture(scope="module")
def switch(fleet, new_source) -> dict[str, tuple[str, str]]:
    """``{host: (running build, new build)}`` as upgrade.yml --check reports it; asserts it changed nothing."""
    before = invocations(fleet)
    run = playbook("upgrade.yml", "--check", *new_source, timeout=1800)
    assert run.rc == 0, run.output[-8000:]
    found = {m.group(1): (m.group(2), m.group(3)) for m in SWITCH.finditer(run.output)}
    assert sorted(found) == sorted(fleet.hosts), run.output[-6000:]
    assert all(old != new and new.startswith(OTHER_LLAMACPP_COMMIT) for old, new in found.values()), found
    assert invocations(fleet) == before, "--check restarted a unit"
    assert current_builds(fleet) == {host: old for host, (old, _new) in found.items()}
    return found


def served_unit(fleet, host: str) -> str:
    """The server unit of ``host``: llama-server on the orchestrator, rpc-server on a worker."""
    return constants.LLAMA_SERVER_UNIT if host == fleet.orchestrator.name else constants.RPC_SERVER_UNIT


def invocations(fleet) -> dict[str, str]:
    """Every host's server InvocationID (each (re)start changes it)."""
    out = {host: invocation(fleet, host, served_unit(fleet, host)) for host in fleet.hosts}
    assert all(out.values()), out
    return out


def recorded_builds(fleet) -> dict[str, str]:
    """The build id each host's deployment record holds for the role it runs."""
    out = {}
    for name, host in fleet.hosts.items():
        record = json.loads(fleet.run_one("cat %s" % constants.DEPLOYMENT_RECORD_PATH, host))
        section = "llama_server" if name == fleet.orchestrator.name else "rpc_server"
        out[name] = deployment_record.section(record, section)["build_id"]
    return out


def serves(fleet) -> None:
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=300)
    assert endpoint.complete("The capital of France is", n_predict=8)["timings"]["predicted_n"] == 8


def test_a_host_that_cannot_install_stops_the_upgrade_before_any_switch(fleet, switch, new_source):
    before = invocations(fleet)
    _old, new = switch["lab3"]
    # lab3 must install it (a lab left over from an earlier run may have it already), and cannot
    partial = "%s/%s.partial" % (constants.LLAMACPP_ROOT, new)
    fleet.run_one("rm -rf %s/%s %s && touch %s" % (constants.LLAMACPP_ROOT, new, partial, partial), fleet.hosts["lab3"])
    run = playbook("upgrade.yml", *new_source, timeout=3600)
    assert run.rc != 0
    assert "lab3: installing llama.cpp build %s failed" % new in run.output, run.output[-6000:]
    assert invocations(fleet) == before, "a unit restarted although the build phase failed"
    assert current_builds(fleet) == {host: old for host, (old, _new) in switch.items()}
    serves(fleet)


def test_installing_ahead_restarts_nothing(fleet, switch, new_source):
    before = invocations(fleet)
    run = playbook("upgrade.yml", "--tags", "llamacpp_build", *new_source, timeout=3600)
    assert run.rc == 0, run.output[-8000:]
    for name, host in fleet.hosts.items():
        _old, new = switch[name]
        assert fleet.run_one("test -f %s/%s/BUILDINFO.json && echo yes" % (constants.LLAMACPP_ROOT, new), host).strip() == "yes"
    assert invocations(fleet) == before
    assert current_builds(fleet) == {host: old for host, (old, _new) in switch.items()}
    serves(fleet)


def test_a_host_that_fails_to_switch_rolls_every_host_back(fleet, switch, new_source):
    _old, new = switch["lab3"]
    bin_dir = "%s/%s/bin" % (constants.LLAMACPP_ROOT, new)
    info = json.loads(fleet.run_one("cat %s/%s/BUILDINFO.json" % (constants.LLAMACPP_ROOT, new), fleet.hosts["lab3"]))
    binary = "%s/%s" % (bin_dir, info["rpc_server"])
    # --help and --version (read by the roles) still answer; serving crashes at once
    wrapper = ("#!/bin/sh\ncase \"$1\" in --help|--version|-h) exec %s.real \"$@\";; esac\n"
               "echo 'Illegal instruction' >&2\nexit 132\n" % binary)
    fleet.run_one("mv %s %s.real && printf %%s %s > %s && chmod 0755 %s"
                  % (binary, binary, shlex.quote(wrapper), binary, binary), fleet.hosts["lab3"])
    try:
        # lab3's rpc-server never answers: the switch waits rpc_server_hello_timeout for it before the rollback (30 s
        # here instead of the default 120 s: the wait itself is not what this test is about)
        run = playbook("upgrade.yml", *new_source, "-e", "rpc_server_hello_timeout=30", timeout=3600)
    finally:
        fleet.run_one("mv %s.real %s" % (binary, binary), fleet.hosts["lab3"])
    assert run.rc != 0
    assert "The upgrade to the new llama.cpp build was rolled back: it failed on lab3 (rpc_server:" in run.output, \
        run.output[-8000:]
    old = {host: old for host, (old, _new) in switch.items()}
    assert recorded_builds(fleet) == old
    assert current_builds(fleet) == old
    for name, host in fleet.hosts.items():
        exec_start = fleet.run_one("systemctl show -p ExecStart --value %s" % served_unit(fleet, name), host)
        assert "/%s/bin/" % old[name] in exec_start, (name, exec_start)
    serves(fleet)


def test_the_upgrade_switches_every_host(fleet, switch, new_source):
    run = playbook("upgrade.yml", *new_source, timeout=3600)
    assert run.rc == 0, run.output[-8000:]
    new = {host: new for host, (_old, new) in switch.items()}
    assert recorded_builds(fleet) == new
    assert current_builds(fleet) == new
    serves(fleet)
    # llama.cpp 4df29be4f places the layers as planned
    assert compare_with_plan(read_plan(fleet), parse_load_log(server_log(fleet))) == []
    again = playbook("upgrade.yml", *new_source, timeout=1800)
    assert again.rc == 0 and again.changed == 0, again.recap


def test_back_to_the_labs_source(fleet, switch):
    before = {host: old for host, (old, _new) in switch.items()}
    # the lab's build is still installed (the running build is never pruned): no compile, no install
    installed = {name: fleet.run_one("stat -c %%Y %s/%s/BUILDINFO.json" % (constants.LLAMACPP_ROOT, before[name]),
                                     host).strip() for name, host in fleet.hosts.items()}
    run = playbook("upgrade.yml", timeout=3600)
    assert run.rc == 0, run.output[-8000:]
    assert {name: fleet.run_one("stat -c %%Y %s/%s/BUILDINFO.json" % (constants.LLAMACPP_ROOT, before[name]),
                                host).strip() for name, host in fleet.hosts.items()} == installed
    assert recorded_builds(fleet) == before
    assert current_builds(fleet) == before
    serves(fleet)
    again = playbook("deploy.yml", timeout=1800)
    assert again.rc == 0 and again.changed == 0, again.recap
