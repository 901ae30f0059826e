"""deploy.yml's preflight fit check through one real ansible-playbook run on this machine (connection local, in check
mode as ``deploy.yml --check`` runs it): the model role's preflight reads a synthetic model's GGUF header from a loopback
server and fetches nothing, and roles/llama_server/tasks/fit_check.yml plans from it and the workers' preflight
devices with rpc_plan: a context that fits passes, one that fits nowhere fails naming the orchestrator and the
variables, and a worker whose preflight facts are missing skips the check."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from llamafleet.bench.synth import SynthSpec, write_model

REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent

INVENTORY = """\
[llamafleet_orchestrator]
box
[llamafleet_workers]
w1
w2
[others]
w1
w3
[all:vars]
ansible_connection=local
ansible_python_interpreter={python}
"""

# The workers' facts as the rpc_server role's preflight records them (its filter over the devices it read); w3's
# preflight did not run. The orchestrator's CPU is capped (llama_server_device_overrides) so that it cannot hold the
# context that fits nowhere either.
PLAYBOOK = """\
- name: Header
  hosts: box
  gather_facts: false
  tasks:
    - name: The model role's preflight
      ansible.builtin.include_role:
        name: llamafleet.cluster.model
        tasks_from: preflight
      vars:
        model_name: synth
        model_files: {files}
        model_controller_cache: {tmp}/cache
        model_free_margin_mib: 0

- name: Workers
  hosts: w1:w2
  gather_facts: false
  tasks:
    - name: What the rpc_server role's preflight records
      ansible.builtin.set_fact:
        _rpc_server_preflight_endpoints: >-
          {{{{ [{{'unit': 'llamafleet-rpc-server.service', 'port': 50052}}]
             | llamafleet.cluster.rpc_server_endpoints([{{'backend': 'cpu', 'index': 0, 'name': 'CPU', 'ggml_name': 'CPU',
                                                         'total_mib': 4096, 'free_mib': 4000, 'max_mib': 600}}],
                                                       inventory_hostname, '10.77.0.1' ~ (ansible_play_hosts.index(inventory_hostname) + 2)) }}}}

- name: Fit
  hosts: box
  gather_facts: false
  vars:
    _llamacpp_build_backend: cpu
    llama_server_device_overrides: [{{match: cpu, max_mib: 100}}]
    llama_server_compute_margin_mib: 16
  tasks:
    - name: A context that fits
      ansible.builtin.include_role:
        name: llamafleet.cluster.llama_server
        tasks_from: fit_check
      vars:
        llama_server_ctx_size: 4096

    - name: A worker without preflight facts
      ansible.builtin.include_role:
        name: llamafleet.cluster.llama_server
        tasks_from: fit_check
      vars:
        llama_server_ctx_size: 1048576
        llama_server_workers_group: others

    - name: A context that fits nowhere
      block:
        - name: The fit check
          ansible.builtin.include_role:
            name: llamafleet.cluster.llama_server
            tasks_from: fit_check
          vars:
            llama_server_ctx_size: 1048576
      rescue:
        - name: Keep the refusal
          ansible.builtin.set_fact:
            refused: "{{{{ ansible_failed_result.msg }}}}"

    - name: Save the results
      ansible.builtin.copy:
        content: "{{{{ {{'refused': refused | default(''), 'facts': __model_preflight_controller.model_facts}} | to_json }}}}"
        dest: {tmp}/results.json
        mode: "0644"
      check_mode: false
"""


def test_the_preflight_fit_check_plans_from_the_header(tmp_path: Path, serve_dir) -> None:
    root = tmp_path / "www"
    root.mkdir()
    model = root / "synth.gguf"
    write_model(model, SynthSpec(layers=4, hidden=512, ffn=1536, heads=8, kv_heads=2, wtype="q8_0"))
    files = [{"url": serve_dir(root) + "/synth.gguf", "sha256": hashlib.sha256(model.read_bytes()).hexdigest()}]
    (tmp_path / "hosts.ini").write_text(INVENTORY.format(python=sys.executable))
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(tmp=tmp_path, files=json.dumps(files)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(BIN / "ansible-playbook"), "--check", "-i", str(tmp_path / "hosts.ini"),
                           str(tmp_path / "play.yml")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    out = proc.stdout + proc.stderr
    results = tmp_path / "results.json"
    assert proc.returncode == 0 and results.exists(), out[-6000:]
    result = json.loads(results.read_text())
    # the header over HTTP ranges: nothing fetched into the controller's cache
    assert not (tmp_path / "cache").exists()
    from llamafleet.core.gguf_facts import model_facts

    assert result["facts"] == model_facts(str(model))
    tasks = out.split("TASK [")
    # the task's name as tests/e2e/test_deploy.py's FIT_CHECK_TASK looks for it
    checks = [t for t in tasks if t.startswith("llamafleet.cluster.llama_server : Check the model fits the cluster at "
                                               "this context (preflight, from the GGUF header)]")]
    assert len(checks) == 3, out[-6000:]
    fits, skipped, refused = checks
    assert "ok: [box -> localhost]" in fits, fits
    assert "skipping: [box]" in skipped, skipped
    assert "fatal: [box -> localhost]" in refused, refused
    assert result["refused"].startswith("box: the model at ctx_size 1048576 needs "), result["refused"]
    assert "lower ctx_size (llama_server_ctx_size)" in result["refused"], result["refused"]
    assert "RPC0 host w1" in result["refused"] and "RPC1 host w2" in result["refused"], result["refused"]
