"""deploy.yml end to end on real lab hosts: bare hosts -> one serving cluster.

The tests run in file order against one lab: the first deploy, a completion,
layers on every RPC device as planned, idempotence, check mode, a change that
restarts only the orchestrator, and bad input that fails before any change.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from llamafleet.cluster import Endpoint, read_plan, server_log
from llamafleet.core.log_parse import buffers_by_device, compare_with_plan, layer_ranges, parse_load_log
from llamafleet.lab.artifacts import LLAMA_CPP_ARCHIVE_SUBDIR
from tests.helpers import INVENTORY, REPO, playbook

def main_pids(fleet) -> dict[str, str]:
    """MainPID and start timestamp of the cluster's units on every host."""
    pids = {}
    for name, res in fleet.run(
        "for u in llamafleet-llama-server.service llamafleet-rpc-server.service; do "
        "systemctl show -p MainPID,ExecMainStartTimestampMonotonic --value $u 2>/dev/null | tr '\\n' ' '; echo; done"
    ).items():
        assert res.ok, f"{name}: {res.error or res.stderr}"
        pids[name] = res.stdout.strip()
    return pids


def test_first_deploy_serves(deployed, fleet):
    assert deployed.failed == 0
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=120)
    answer = endpoint.complete("The capital of France is", n_predict=16)
    assert answer["content"].strip(), answer
    assert answer["timings"]["predicted_n"] == 16
    # OpenAI-compatible route too
    oai = endpoint.request("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert oai["choices"][0]["text"].strip(), oai


def test_llamacpp_compiled_once(deployed, fleet):
    """A 3-host CPU lab is one build group: one build id everywhere, built by exactly one host."""
    infos = fleet.run("cat /opt/llamafleet/llama.cpp/current/BUILDINFO.json")
    records = {h: json.loads(r.stdout) for h, r in infos.items() if r.ok}
    assert len(records) == 3, infos
    assert len({r["build_id"] for r in records.values()}) == 1
    assert len({r["builder"] for r in records.values()}) == 1
    # read from the built source: what the seeding must match (llama.cpp 0c1e570: 10 MiB, protocol 7)
    assert {(r["rpc_hash_threshold"], r["rpc_protocol"]) for r in records.values()} == {(10 * 1024 * 1024, 7)}


def test_layers_on_every_rpc_device_as_planned(deployed, fleet):
    plan = read_plan(fleet)
    parsed = parse_load_log(server_log(fleet))
    seen = layer_ranges(parsed)
    rpc_devices = [d for d in plan["devices"] if d["name"].startswith("RPC")]
    assert len(rpc_devices) == len(fleet.workers)
    for dev in rpc_devices:
        got = seen.get(dev["name"], [])
        assert got, f"{dev['name']} ({dev.get('endpoint')}) holds no layers; llama.cpp log: {parsed}"
    # exactly the planned devices, order and units per device, and the planned weights on each
    assert compare_with_plan(plan, parsed) == [], parsed
    loaded = buffers_by_device(parsed, "model")
    for dev in plan["devices"]:
        assert loaded.get(dev["name"], 0.0) == pytest.approx(dev["weights_mib"], abs=0.1), (dev, loaded)


def test_second_run_changes_nothing_and_restarts_nothing(deployed, fleet):
    before = main_pids(fleet)
    run = playbook("deploy.yml")
    assert run.rc == 0, run.output[-6000:]
    assert run.changed == 0, run.output[-6000:]
    assert main_pids(fleet) == before


def test_check_diff_on_converged_fleet_reports_no_change(deployed, fleet):
    run = playbook("deploy.yml", "--check", "--diff")
    assert run.rc == 0, run.output[-6000:]
    assert run.changed == 0, run.output[-6000:]


def test_context_change_restarts_only_the_orchestrator(deployed, fleet):
    before = main_pids(fleet)
    orch = fleet.orchestrator.name
    try:
        run = playbook("deploy.yml", "-e", "llama_server_ctx_size=1024")
        assert run.rc == 0, run.output[-6000:]
        after = main_pids(fleet)
        assert after[orch].split()[0:2] != before[orch].split()[0:2]
        for worker in fleet.workers:
            assert after[worker.name] == before[worker.name], worker.name
        Endpoint.of(fleet).wait_healthy(timeout=120)
    finally:
        restore = playbook("deploy.yml")
        assert restore.rc == 0, restore.output[-6000:]


BAD_INPUT = [
    pytest.param(["-e", "llamacpp_build_backend=tpu"], "llamacpp_build_backend", id="unknown-backend"),
    pytest.param(["-e", '{"model_files": [{"url": "http://10.77.0.1:8089/models/gemma-3-270m-q4_k_m.gguf", "sha256": "abc"}]}'],
                 "model_files", id="malformed-sha256"),
    pytest.param(["-e", "model_name=other", "-e",
                  '{"model_files": [{"url": "http://10.77.0.1:8089/models/gemma-3-270m-q4_k_m.gguf", "sha256": "'
                  + "0" * 64 + '"}]}'], "sha256 mismatch", id="wrong-sha256"),
    pytest.param(["-e", "llamacpp_build_archive_url=http://10.77.0.1:8089/src/missing.tar.gz"],
                 "llamacpp_build_archive_url", id="unreachable-source"),
    pytest.param(["-e", "model_name=other", "-e", "model_free_margin_mib=100000000"], "GiB free", id="too-little-disk"),
    pytest.param(["-e", "llama_server_port=22"], "llama_server_port 22 is already taken", id="port-taken"),
    # module_utils/backend_checks.py, before the Vulkan header check; the lab hosts have no GPU, driver or loader
    pytest.param(["-e", "llamacpp_build_backend=vulkan"], "llamacpp_build_backend=vulkan needs a Vulkan loader",
                 id="vulkan-without-loader"),
    pytest.param(["-e", "llamacpp_build_backend=cuda"], "llamacpp_build_backend=cuda needs the NVIDIA driver",
                 id="cuda-without-driver"),
    pytest.param(["-e", "llamacpp_build_backend=metal"],
                 "llamacpp_build_backend=metal builds for macOS: macOS hosts are not supported", id="metal-on-linux"),
    # a second inventory source gives lab2 alone another archive: preflight names both sources and their hosts
    pytest.param(["-i", str(REPO / "tests" / "e2e" / "mixed_build_lab2.yml")],
                 "archive sha256 " + "1" * 64 + " subdir " + LLAMA_CPP_ARCHIVE_SUBDIR + " on lab2", id="mixed-build"),
]


@pytest.mark.parametrize(("extra", "expected"), BAD_INPUT)
def test_bad_input_fails_before_any_change(deployed, fleet, extra, expected):
    before = main_pids(fleet)
    units_before = fleet.run("sha256sum /etc/systemd/system/llamafleet-*.service")
    run = playbook("deploy.yml", *extra)
    assert run.rc != 0, run.output[-4000:]
    assert expected in run.output, run.output[-4000:]
    assert run.changed == 0, run.output[-4000:]
    assert main_pids(fleet) == before
    units_after = fleet.run("sha256sum /etc/systemd/system/llamafleet-*.service")
    assert {h: r.stdout for h, r in units_after.items()} == {h: r.stdout for h, r in units_before.items()}
    Endpoint.of(fleet).wait_healthy(timeout=30)


def test_orchestrator_is_elected_when_the_inventory_pins_none(deployed, tmp_path):
    """No llamafleet_orchestrator group: the deterministic election (most GPU memory, then name) picks one."""
    text = INVENTORY.read_text()
    lines, skip = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skip = line.strip() == "[llamafleet_orchestrator]"
        if skip or line.strip() == "llamafleet_orchestrator":
            continue
        lines.append(line)
    # the orchestrator becomes a plain worker candidate
    lines.insert(lines.index("[llamafleet_workers]") + 1, next(
        ln for ln in text.splitlines() if ln.startswith("lab1 ")))
    (tmp_path / "hosts.ini").write_text("\n".join(lines) + "\n")
    shutil.copytree(INVENTORY.parent / "group_vars", tmp_path / "group_vars")
    run = playbook("deploy.yml", "--check", "--tags", "election_only", "-v", timeout=600, inventory=tmp_path / "hosts.ini")
    assert run.rc == 0, run.output[-3000:]
    assert "host_name: lab1" in run.output, run.output[-3000:]
    assert "llamafleet_orchestrator" in run.output
    # the tag selects the election and nothing else: no preflight, no role task (facts and argument
    # validation are Ansible's own, tagged always)
    with (REPO / "playbooks" / "deploy.yml").open(encoding="utf-8") as handle:
        election = next(p for p in yaml.safe_load(handle) if "election_only" in p.get("tags", []))
    ran = set(re.findall(r"^TASK \[(.+?)\]", run.output, re.MULTILINE))
    ran = {t for t in ran if t != "Gathering Facts" and " : Validating arguments against arg spec " not in t}
    assert ran == {t["name"] for t in election["tasks"]}, sorted(ran)


def test_cluster_heals_after_a_worker_dies(deployed, fleet):
    """A worker's rpc-server is killed: systemd restarts it, llama-server (which aborts on a lost worker)
    restarts, waits for every worker's HELLO, reloads, and serves again, with no human involved."""
    import time

    orch = fleet.orchestrator
    worker = fleet.workers[0]

    def restarts() -> int:
        res = fleet.run("systemctl show -p NRestarts --value llamafleet-llama-server.service", [orch])[orch.name]
        return int(res.stdout.strip() or 0)

    before = restarts()
    killed = fleet.run("systemctl kill -s KILL llamafleet-rpc-server.service", [worker])[worker.name]
    assert killed.ok, killed.stderr
    endpoint = Endpoint.of(fleet)
    deadline = time.monotonic() + 180
    answer, errors = None, []
    while time.monotonic() < deadline:
        try:
            answer = endpoint.complete("The capital of France is", n_predict=8)
            if restarts() > before:
                break
        except Exception as exc:  # noqa: BLE001 - the endpoint is expected to fail while it heals
            errors.append(str(exc)[:120])
        time.sleep(2)
    assert answer and answer["content"].strip(), errors[-3:]
    assert restarts() > before, "llama-server should have restarted after losing its worker"
    state = fleet.run("systemctl is-active llamafleet-rpc-server.service", [worker])[worker.name]
    assert state.stdout.strip() == "active"
