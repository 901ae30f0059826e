"""A worker leaves the inventory, then comes back: deploy re-plans, reports, and restarts only the orchestrator.

Removing lab3 from the inventory and making the orchestrator lab1 a worker too, in one deploy: the orchestrator
re-plans over lab2 and its own rpc-server and serves, lab3's llamafleet units are stopped and removed (its users,
caches and builds stay), the removal is reported, and lab2's rpc-server keeps running untouched. Putting lab3 back
and lab1 back to orchestrator only: lab3 is deployed again, lab1's rpc-server units and firewall go (reported), the
plan spans lab2 and lab3, and again only llama-server restarts.
"""

from __future__ import annotations

import json

from llamafleet.cluster import Endpoint, read_plan
from llamafleet.core import constants
from tests.helpers import INVENTORY, invocation, playbook

RECORD = INVENTORY.parent / ".llamafleet" / "deployment.json"


def unit_files(fleet, host) -> list[str]:
    out = fleet.run_one(f"ls {constants.SYSTEMD_DIR} | grep '^{constants.UNIT_PREFIX}' || true", fleet.hosts[host])
    return out.split()


def test_a_worker_removed_then_added_back(deployed, fleet, tmp_path):
    lab2_rpc = invocation(fleet, "lab2", constants.RPC_SERVER_UNIT)
    llama = invocation(fleet, "lab1", constants.LLAMA_SERVER_UNIT)
    assert lab2_rpc and llama

    # the same inventory without lab3 and with lab1 a worker too, beside it so that its group_vars (and the
    # controller's record) are the same
    without = INVENTORY.parent / "hosts-without-lab3.ini"
    lines = [line for line in INVENTORY.read_text().splitlines() if not line.startswith("lab3 ")]
    lines.insert(lines.index("[llamafleet_workers]") + 1, "lab1")
    without.write_text("\n".join(lines) + "\n")
    try:
        run = playbook("deploy.yml", inventory=without, timeout=1800)
    finally:
        without.unlink()
    assert run.rc == 0, run.output[-8000:]
    assert "lab3 left the fleet (it was worker)" in run.output, run.output[-6000:]
    assert "lab1 is now a worker too (it stays the orchestrator)" in run.output, run.output[-6000:]
    assert unit_files(fleet, "lab3") == [], "lab3 still has llamafleet units"
    assert fleet.run_one(f"test -e {constants.DEPLOYMENT_RECORD_PATH} && echo yes || echo no",
                         fleet.hosts["lab3"]).strip() == "no"
    assert invocation(fleet, "lab2", constants.RPC_SERVER_UNIT) == lab2_rpc, "lab2's rpc-server was restarted"
    assert invocation(fleet, "lab1", constants.LLAMA_SERVER_UNIT) != llama
    plan = read_plan(fleet)
    assert {d["host"] for d in plan["devices"] if d.get("host")} <= {"lab2", "lab1"}
    lab1 = fleet.hosts["lab1"]
    assert any((d.get("endpoint") or "").startswith(lab1.cluster_address + ":") for d in plan["devices"]), plan
    assert fleet.run_one(f"systemctl is-active {constants.RPC_SERVER_UNIT}", lab1).strip() == "active"
    assert Endpoint.of(fleet).complete("The capital of France is", n_predict=8)["content"]
    record = json.loads(RECORD.read_text())
    roles = {name: host["roles"] for name, host in record["hosts"].items()}
    assert roles == {"lab1": ["orchestrator", "worker"], "lab2": ["worker"]}

    llama = invocation(fleet, "lab1", constants.LLAMA_SERVER_UNIT)
    back = playbook("deploy.yml", timeout=1800)
    assert back.rc == 0, back.output[-8000:]
    assert "lab3 joined the fleet as worker" in back.output
    assert "lab1 is no longer a worker (it stays the orchestrator)" in back.output, back.output[-6000:]
    assert constants.RPC_SERVER_UNIT in unit_files(fleet, "lab3")
    assert not [name for name in unit_files(fleet, "lab1") if name.startswith(constants.RPC_UNIT_PREFIX)]
    assert constants.LLAMA_SERVER_UNIT in unit_files(fleet, "lab1")
    assert fleet.run_one(f"systemctl list-units --all --plain --no-legend '{constants.RPC_UNIT_PREFIX}*'; "
                         f"nft list table {constants.RPC_FIREWALL_TABLE} 2>/dev/null || true", lab1).strip() == "", \
        "lab1 still runs a worker's unit or firewall"
    sections = json.loads(fleet.run_one(f"cat {constants.DEPLOYMENT_RECORD_PATH}", lab1))["sections"]
    assert "rpc_server" not in sections and "llama_server" in sections, sorted(sections)
    assert invocation(fleet, "lab2", constants.RPC_SERVER_UNIT) == lab2_rpc, "lab2's rpc-server was restarted"
    assert invocation(fleet, "lab1", constants.LLAMA_SERVER_UNIT) != llama
    assert "lab3" in {d.get("host") for d in read_plan(fleet)["devices"]}
    assert not any((d.get("endpoint") or "").startswith(lab1.cluster_address + ":")
                   for d in read_plan(fleet)["devices"])
    assert Endpoint.of(fleet).complete("The capital of France is", n_predict=8)["content"]
    assert {name: host["roles"] for name, host in json.loads(RECORD.read_text())["hosts"].items()} == {
        "lab1": ["orchestrator"], "lab2": ["worker"], "lab3": ["worker"]}
    # and a deploy of the same fleet changes nothing and reports nothing
    again = playbook("deploy.yml", timeout=1800)
    assert again.rc == 0 and again.changed == 0, again.recap
    assert "joined the fleet as" not in again.output and "left the fleet (it was" not in again.output
    assert "is no longer a worker" not in again.output and " too (it stays " not in again.output


def test_switching_to_one_rpc_server_per_device_and_back_leaves_no_stale_unit(deployed, fleet):
    per_device = constants.rpc_server_unit("CPU")
    switched = playbook("deploy.yml", "-e", json.dumps({"rpc_server_unit_per_device": True,
                                                        "rpc_server_devices": ["CPU"]}), timeout=1800)
    assert switched.rc == 0, switched.output[-8000:]
    for worker in fleet.workers:
        units = unit_files(fleet, worker.name)
        assert per_device in units and constants.RPC_SERVER_UNIT not in units, (worker.name, units)
        assert invocation(fleet, worker.name, per_device)
    assert Endpoint.of(fleet).complete("The capital of France is", n_predict=8)["content"]

    back = playbook("deploy.yml", timeout=1800)
    assert back.rc == 0, back.output[-8000:]
    for worker in fleet.workers:
        units = unit_files(fleet, worker.name)
        assert constants.RPC_SERVER_UNIT in units and per_device not in units, (worker.name, units)
        state = fleet.run_one(f"systemctl is-active {per_device} || true", worker).strip()
        assert state in ("inactive", "unknown"), (worker.name, state)
    assert Endpoint.of(fleet).complete("The capital of France is", n_predict=8)["content"]


def test_a_model_change_can_prune_the_other_models(deployed, fleet):
    model_dir = constants.MODEL_DIR
    # the orchestrator keeps the whole model (workers keep only their share, model_worker_copy: share)
    worker = fleet.orchestrator
    fleet.run_one(f"mkdir -p {model_dir}/old-model && head -c 1000 /dev/zero > {model_dir}/old-model/old.gguf", worker)
    kept = playbook("deploy.yml", "--tags", "model", timeout=1800)
    assert kept.rc == 0 and kept.changed == 0, kept.recap  # not asked: the other model stays
    assert fleet.run_one(f"ls {model_dir}", worker).split().count("old-model") == 1
    pruned = playbook("deploy.yml", "--tags", "model", "-e", "model_prune_others=true", timeout=1800)
    assert pruned.rc == 0, pruned.output[-6000:]
    left = fleet.run_one(f"ls {model_dir}", worker).split()
    assert "old-model" not in left and worker.var("model_name") in left, left  # the model in use stays
