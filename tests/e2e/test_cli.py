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
        assert int(row["cache_files"]) >= 1 and int(row["cache_bytes"]) > constants.RPC_HASH_THRESHOLD
        assert row["build"] == orch["build"]


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
