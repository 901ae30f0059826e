"""The action plugins rpc_cache_share and model_receive through a real ansible-playbook run: an orchestrator and two
workers on this machine (connection local), each worker's cache a folder under tmp_path, the model a synthetic llama
GGUF in a controller cache under tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamafleet.core import model_share as ms
from llamafleet.core.checksum import sha256_hex
from llamafleet.core.fnv import hash_ranges_python

REPO = Path(__file__).resolve().parents[4]
BIN = Path(sys.executable).parent
THRESHOLD = 100_000

INVENTORY = """\
[orch]
o ansible_connection=local ansible_python_interpreter={python}

[workers]
w1 ansible_connection=local ansible_python_interpreter={python} cache={tmp}/w1/rpc address=10.9.0.1
w2 ansible_connection=local ansible_python_interpreter={python} cache={tmp}/w2/rpc address=10.9.0.2
"""

PLAYBOOK = """\
- name: Shares
  hosts: orch
  gather_facts: false
  vars:
    endpoints:
      - {{host: w1, address: 10.9.0.1, port: 50052, devices: [{{}}]}}
      - {{host: w2, address: 10.9.0.2, port: 50052, devices: [{{}}]}}
  tasks:
    - name: Copy the model to the orchestrator
      llamafleet.cluster.model_receive:
        src: {model}
        dest: {tmp}/o/models/synth.gguf
        sha256: {sha}
        piece_mib: 1
        free_margin_mib: 0

    - name: Send each worker its share
      llamafleet.cluster.rpc_cache_share:
        state: "{{{{ share_state | default('present') }}}}"
        host: "{{{{ item }}}}"
        model: [{model}]
        sha256: [{sha}]
        threshold: {threshold}
        plan: {{rpc: [10.9.0.1:50052, 10.9.0.2:50052], tensor_split: "{{{{ split | default([2, 3]) }}}}"}}
        workers: "{{{{ endpoints }}}}"
        degraded: "{{{{ degraded | default([]) }}}}"
        cache_dir: "{{{{ hostvars[item].cache }}}}"
        free_margin_mib: "{{{{ margin | default(0) }}}}"
      delegate_to: "{{{{ item }}}}"
      loop: [w1, w2]
      register: shares

    - name: Save the results
      ansible.builtin.copy:
        content: "{{{{ shares.results | to_json }}}}"
        dest: {tmp}/results.json
        mode: "0644"
      check_mode: false
      changed_when: false
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("numpy")
    from llamafleet.bench.synth import SynthSpec, write_model

    tmp = tmp_path_factory.mktemp("share")
    model = tmp / "controller" / "models" / "synth" / "synth.gguf"
    model.parent.mkdir(parents=True)
    write_model(model, SynthSpec(layers=4, hidden=256, ffn=512, heads=4, kv_heads=4, context=256))
    sha = sha256_hex(model)
    (tmp / "hosts.ini").write_text(INVENTORY.format(python=sys.executable, tmp=tmp))
    (tmp / "play.yml").write_text(PLAYBOOK.format(model=model, sha=sha, tmp=tmp, threshold=THRESHOLD))
    manifest = ms.build_manifest([str(model)], [sha], THRESHOLD, hash_ranges_python)
    return {"tmp": tmp, "model": model, "sha": sha, "manifest": manifest}


def play(setup: dict, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_") and k != "LLAMAFLEET_FNV_HELPER"}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(setup["tmp"] / "hosts.ini"),
                           str(setup["tmp"] / "play.yml"), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert (proc.returncode == 0) is ok, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc


def _cache(setup: dict, host: str) -> dict[str, bytes]:
    folder = setup["tmp"] / host / "rpc"
    return {p.name: p.read_bytes() for p in folder.iterdir() if ms.re.match(r"^[0-9a-f]{16}$", p.name)} \
        if folder.is_dir() else {}


def _expected(setup: dict, split: list[int], degraded: list | None = None) -> dict[str, dict[str, bytes]]:
    data = setup["model"].read_bytes()
    endpoints = [{"host": "w1", "address": "10.9.0.1", "port": 50052, "devices": [{}]},
                 {"host": "w2", "address": "10.9.0.2", "port": 50052, "devices": [{}]}]
    shares = ms.fleet_shares(setup["manifest"], {"rpc": ["10.9.0.1:50052", "10.9.0.2:50052"], "tensor_split": split},
                             endpoints, degraded or [])
    return {host: {e["name"]: data[e["offset"]:e["offset"] + e["size"]]
                   for e in ms.share_entries(setup["manifest"], s["plan"] + s["degraded"])}
            for host, s in shares.items()}


def _results(setup: dict) -> list[dict]:
    return json.loads((setup["tmp"] / "results.json").read_text())


def test_send_resume_replan_check_and_prune(setup: dict) -> None:
    expected = _expected(setup, [2, 3])
    assert expected["w1"] and expected["w2"]

    preview = play(setup, "--check", "--diff")
    assert _cache(setup, "w1") == {} and not (setup["tmp"] / "o" / "models" / "synth.gguf").exists()
    assert [r["sent"] for r in _results(setup)] == [sorted(expected["w1"], key=list(expected["w1"]).index),
                                                    list(expected["w2"])]
    assert "changed=2" in preview.stdout or "changed=3" in preview.stdout
    assert not any(r["settled"] for r in _results(setup))

    first = play(setup)
    assert _cache(setup, "w1") == expected["w1"] and _cache(setup, "w2") == expected["w2"]
    assert (setup["tmp"] / "o" / "models" / "synth.gguf").read_bytes() == setup["model"].read_bytes()
    # progress on the controller, per worker
    assert "w1: rpc-server cache share" in first.stdout and "MB/s" in first.stdout
    assert "synth.gguf," in first.stdout
    assert os.path.exists(ms.manifest_path(str(setup["model"]), THRESHOLD))

    again = play(setup)
    assert "changed=0" in again.stdout, again.stdout[-3000:]
    assert all(r["sent"] == [] for r in _results(setup))
    # everything there and verified by the sends: the llama_server role's send step may skip both
    assert [r["settled"] for r in _results(setup)] == [True, True]

    # a stopped transfer: one file gone from w2, a half-sent one left in its incoming folder
    gone = sorted(expected["w2"])[0]
    (setup["tmp"] / "w2" / "rpc" / gone).unlink()
    (setup["tmp"] / "w2" / "rpc" / ".llamafleet-incoming" / gone).write_bytes(b"half")
    play(setup, "--check")
    assert [r["settled"] for r in _results(setup)] == [True, False]
    resumed = play(setup)
    assert [r["sent"] for r in _results(setup)] == [[], [gone]], resumed.stdout[-3000:]
    assert _cache(setup, "w2") == expected["w2"]

    # a re-plan moves only the difference; the old files stay until the prune
    replan = _expected(setup, [3, 2])
    play(setup, "-e", '{"split": [3, 2]}')
    sent = {r["item"]: r["sent"] for r in _results(setup)}
    assert set(sent["w1"]) == set(replan["w1"]) - set(expected["w1"])
    assert set(sent["w2"]) == set(replan["w2"]) - set(expected["w2"]) == set()
    assert set(_cache(setup, "w1")) == set(expected["w1"]) | set(replan["w1"])
    play(setup, "-e", '{"split": [3, 2], "share_state": "absent_others"}')
    assert _cache(setup, "w1") == replan["w1"] and _cache(setup, "w2") == replan["w2"]
    assert set(next(r for r in _results(setup) if r["item"] == "w2")["pruned_files"]) == \
        set(expected["w2"]) - set(replan["w2"])

    # the check before llama-server starts names the tensors a cache lacks
    lost = sorted(replan["w1"])[0]
    (setup["tmp"] / "w1" / "rpc" / lost).unlink()
    failed = play(setup, "-e", '{"split": [3, 2], "share_state": "checked"}', ok=False)
    tensors = next(e["tensors"] for e in ms.share_entries(setup["manifest"],
                                                          [t["name"] for t in setup["manifest"]["tensors"]])
                   if e["name"] == lost)
    assert "w1: the rpc-server cache" in failed.stdout and tensors[0] in failed.stdout


def test_degraded_ahead_and_disk_space(setup: dict) -> None:
    degraded = [{"without": "w1", "fits": True, "rpc": ["10.9.0.2:50052"], "tensor_split": [5]}]
    expected = _expected(setup, [2, 3], degraded)
    play(setup, "-e", json.dumps({"degraded": degraded}))
    assert _cache(setup, "w2") == expected["w2"] and set(expected["w2"]) >= set(_expected(setup, [2, 3])["w1"])
    # nothing more fits: a clear error before anything is sent
    (setup["tmp"] / "w1" / "rpc").joinpath(sorted(expected["w1"])[0]).unlink()
    failed = play(setup, "-e", json.dumps({"degraded": degraded, "margin": 1 << 30}), ok=False)
    assert "w1: the share needs" in failed.stdout and "MiB free; free space or lower the share " \
        "(llama_server_share_degraded: false" in failed.stdout.replace("\n", " ")
