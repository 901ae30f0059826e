"""deploy.yml with the lowest ansible-core that meta/runtime.yml claims, on the deployed lab.

tests/integration/test_min_ansible.py checks that version's modules, filters and a localhost play; here the real
roles run on real hosts with it: the same inventory and ansible.cfg as the other tests, the cluster that the
current ansible-core deployed. Nothing is left to change (the roles decide the same with either version) and the
cluster serves.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from llamafleet.cluster import Endpoint
from tests.e2e.quiet import quiet
from tests.helpers import EVERY_TASK, INVENTORY, REPO, ansible_venv, env, lowest_ansible, parse_recap

LOWEST = lowest_ansible((REPO / "meta" / "runtime.yml").read_text())


@quiet("lowest-ansible-deploy")
def _deploy_on_the_lowest(work: Path) -> tuple[str, subprocess.CompletedProcess]:
    """(ansible-playbook --version, deploy.yml's run) with the lowest ansible-core, in the quiet batch."""
    bin_dir = ansible_venv(LOWEST)
    version = subprocess.run([str(bin_dir / "ansible-playbook"), "--version"], capture_output=True, text=True,
                             check=True).stdout
    return version, subprocess.run(
        [str(bin_dir / "ansible-playbook"), "-i", str(INVENTORY), str(REPO / "playbooks" / "deploy.yml"), *EVERY_TASK],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=1800, check=False)


def test_deploy_on_the_lowest_ansible_core_changes_nothing(quiet_runs, fleet):
    version, proc = quiet_runs["lowest-ansible-deploy"]
    assert "[core %s]" % LOWEST in version.splitlines()[0], version
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    recap = parse_recap(proc.stdout)
    assert sorted(recap) == sorted(fleet.hosts), recap
    assert sum(h["changed"] for h in recap.values()) == 0, recap
    answer = Endpoint.of(fleet).complete("The capital of France is", n_predict=8)
    assert answer["timings"]["predicted_n"] == 8
