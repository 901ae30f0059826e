"""The library's CLI on the deployed lab: status at a glance, logs and link probes, over real SSH."""

from __future__ import annotations

import json

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from tests.helpers import cli


def test_status_reports_every_host_active_and_healthy(deployed, fleet):
    proc = cli("status", "--json")
    rows = {row["host"]: row for row in json.loads(proc.stdout)}
    assert set(rows) == set(fleet.hosts)
    orch = rows[fleet.orchestrator.name]
    assert orch["role"] == "orchestrator" and orch["state"] == "active" and orch["health"] == "ok"
    assert orch["endpoint"] == Endpoint.of(fleet).url and orch["unit"] == constants.LLAMA_SERVER_UNIT
    assert orch["build"], orch
    # every host's layout came from the deployment record its roles wrote
    assert all(row["recorded"] for row in rows.values()), rows
    for worker in fleet.workers:
        row = rows[worker.name]
        assert row["state"] == "active" and row["unit"] == constants.RPC_SERVER_UNIT
        assert [(u["unit"], u["state"], u["sub_state"]) for u in row["units"]] == [
            (constants.RPC_SERVER_UNIT, "active", "running")]
        assert int(row["cache_files"]) >= 0 and int(row["cache_bytes"]) >= 0, row
        assert row["build"] == orch["build"]
    # each worker's cache holds its share only: on gemma, the large tensor (the tied output) is on one worker alone
    assert sum(int(rows[w.name]["cache_bytes"]) for w in fleet.workers) > constants.RPC_HASH_THRESHOLD, rows


def test_status_table_has_a_line_per_host(deployed, fleet):
    lines = cli("status").stdout.splitlines()
    assert lines[0].split()[:4] == ["host", "role", "address", "state"]
    assert sorted(line.split()[0] for line in lines[1:]) == sorted(fleet.hosts)
    assert all(line.split()[3] == "active" for line in lines[1:]), lines


def test_logs_show_the_worker_journal(deployed, fleet):
    worker = fleet.workers[0]
    pid = fleet.run_one(f"systemctl show -p MainPID --value {constants.RPC_SERVER_UNIT}", worker).strip()
    assert pid.isdigit() and pid != "0", pid
    # the last lines are the running rpc-server's own (its start may lie further back: a worker that has served
    # many loads logs a line for every client connection)
    proc = cli("logs", worker.name, "-n", "200")
    assert f"[{pid}]: " in proc.stdout, proc.stdout[-2000:]
    assert "Starting RPC server" in cli("logs", worker.name, "-n", "100000").stdout
    missing = cli("logs", "no-such-host", check=False)
    assert missing.returncode == 2 and "no-such-host is not in" in missing.stderr


def test_probe_measures_every_orchestrator_worker_link(deployed, fleet):
    proc = cli("probe", "--megabytes", "8")
    lines = [ln for ln in proc.stdout.splitlines() if "->" in ln]
    assert len(lines) == len(fleet.workers)
    for line in lines:
        connect_ms, mb_s = (float(x) for x in line.split()[-2:])
        assert connect_ms >= 0 and mb_s > 1, line


def test_each_host_has_a_deployment_record_of_what_its_roles_made(deployed, fleet):
    records = {name: json.loads(res.stdout) for name, res in fleet.run(f"cat {constants.DEPLOYMENT_RECORD_PATH}").items()}
    orch = records[fleet.orchestrator.name]
    assert orch["schema"] == constants.DEPLOYMENT_RECORD_SCHEMA
    assert orch["collection_version"] == constants.COLLECTION_VERSION
    llama = orch["sections"]["llama_server"]
    assert llama["units"] == [constants.LLAMA_SERVER_UNIT] and llama["api_endpoint"] == Endpoint.of(fleet).url
    assert llama["build_id"] and llama["api_key_file"] == constants.API_KEY_PATH
    for worker in fleet.workers:
        rpc = records[worker.name]["sections"]["rpc_server"]
        assert rpc["units"] == [constants.RPC_SERVER_UNIT] and rpc["ports"] == [constants.RPC_SERVER_PORT]
        assert rpc["build_id"] == llama["build_id"] and rpc["cache_dir"].endswith("/cache/rpc")


# The CLI reaches the hosts as ansible would (llamafleet/connection.py)

def _cli_with(tmp_path, inventory: str, cfg_extra: str = "", **environ: str):
    """``llamafleet status --json`` on ``inventory`` (text) under an ansible.cfg that is the project's plus
    ``cfg_extra`` in [defaults]."""
    import subprocess

    from tests.helpers import BIN, REPO, env

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "hosts.ini").write_text(inventory)
    cfg = (REPO / "ansible.cfg").read_text().replace("[defaults]\n", f"[defaults]\n{cfg_extra}\n", 1)
    (tmp_path / "ansible.cfg").write_text(cfg)
    e = dict(env(), ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"), **environ)
    return subprocess.run([str(BIN / "llamafleet"), "status", "--json", "-i", str(tmp_path / "hosts.ini")],
                          cwd=REPO, env=e, capture_output=True, text=True, timeout=300, check=False)


def _lab_inventory() -> str:
    from tests.helpers import INVENTORY

    return INVENTORY.read_text()


def test_status_takes_the_user_from_ansible_cfg_remote_user(deployed, fleet, tmp_path):
    """No ansible_user in the inventory: ansible.cfg's remote_user=root is the user, as for ansible."""
    text = "\n".join(line for line in _lab_inventory().splitlines() if not line.startswith("ansible_user="))
    assert "ansible_user" not in text
    proc = _cli_with(tmp_path / "root", text + "\n", "remote_user = root")
    rows = {row["host"]: row for row in json.loads(proc.stdout)}
    assert all(row["state"] == "active" for row in rows.values()), proc.stdout + proc.stderr
    # without it, the local user named by LOGNAME (never root by default), who has no key on the hosts
    proc = _cli_with(tmp_path / "local", text + "\n", LOGNAME="llamafleet-nobody", USER="llamafleet-nobody")
    rows = {row["host"]: row for row in json.loads(proc.stdout)}
    assert all(row["error"].startswith("authentication failed for user llamafleet-nobody") for row in rows.values()
               ), proc.stdout


def test_status_names_an_unreachable_host_in_words_with_its_inventory_role(deployed, fleet, tmp_path):
    worker = fleet.workers[-1]
    text = _lab_inventory().replace("[llamafleet_workers]\n", f"[llamafleet_workers]\nlab9 ansible_host={worker.address} "
                                    "ansible_port=2\n", 1)
    rows = {row["host"]: row for row in json.loads(_cli_with(tmp_path, text).stdout)}
    assert (rows["lab9"]["role"], rows["lab9"]["state"]) == ("worker", "unreachable")
    assert rows["lab9"]["error"] == f"connection refused on port 2 ({worker.address})"


def test_status_reaches_the_workers_through_a_proxyjump(deployed, fleet, tmp_path):
    """Workers behind ``-J`` the orchestrator (the jump host's user and key from an ssh config given by -F)."""
    orch = fleet.orchestrator
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host {orch.address}\n    User root\n    IdentityFile {orch.key_file}\n"
                          "    IdentitiesOnly yes\n")
    lines = []
    for line in _lab_inventory().splitlines():
        name = line.split(" ", 1)[0]
        if any(name == w.name for w in fleet.workers):
            line += f" ansible_ssh_extra_args='-F {ssh_config} -J {orch.address}'"
        lines.append(line)
    proc = _cli_with(tmp_path, "\n".join(lines) + "\n")
    rows = {row["host"]: row for row in json.loads(proc.stdout)}
    assert all(row["state"] == "active" for row in rows.values()), proc.stdout + proc.stderr
    # the workers' sshd saw the orchestrator's address, not the controller's
    for worker in fleet.workers:
        log = fleet.run_one("journalctl --no-pager -o cat -n 5000 | grep 'Accepted publickey' | tail -n 20", worker)
        assert f"Accepted publickey for root from {orch.address}" in log, log[-2000:]
