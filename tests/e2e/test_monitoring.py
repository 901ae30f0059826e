"""playbooks/monitoring.yml on the deployed lab: Debian's Prometheus and node exporters scraping the real cluster.

Runs after test_deploy.py on its converged lab (lab1 the orchestrator, two workers). The lab has no host outside
the cluster, so the orchestrator is the monitoring host too: a second inventory source puts it in the
llamafleet_monitoring group. Grafana is left out (monitoring_grafana: false): the lab reaches Debian's archive only,
not apt.grafana.com.

Then the real Prometheus answers, on the monitoring host's loopback: every target is up, the orchestrator's
llama-server (its /metrics through the edge, which checks the key, and the serving gate, with the API key the role
copied) and every host's node
exporter; each worker's rpc-server is up (its textfile metrics, written by the rpc_server role's timer), and
serves llama-server on every endpoint of the plan; llama-server's own counters arrive; the gate reports each worker
link of the plan (RTT, bytes each way, retransmits). A second run changes nothing. Prometheus and the node
exporters are stopped at the end, so that later tests (the benchmarks) time the cluster alone.
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.parse

import pytest
import yaml

from llamafleet.bench.fleet_bench import load_seconds
from llamafleet.cluster import Endpoint, read_plan
from llamafleet.core import constants
from llamafleet.core.gate_config import plan_workers
from tests.helpers import playbook

# The lab reaches no third-party repository.
EXTRA = ["-e", json.dumps({"monitoring_grafana": False})]
# Prometheus scrapes every 15 s (monitoring_scrape_interval) and the workers write their facts every 15 s.
SCRAPE_WAIT = 90.0


@pytest.fixture(scope="module")
def monitoring_inventory(fleet, tmp_path_factory):
    """A second inventory source: the orchestrator in the llamafleet_monitoring group."""
    path = tmp_path_factory.mktemp("monitoring") / "monitoring.yml"
    path.write_text(yaml.safe_dump({"all": {"children": {
        constants.GROUP_MONITORING: {"hosts": {fleet.orchestrator.name: None}}}}}))
    return ["-i", str(path)]


@pytest.fixture(scope="module")
def monitored(deployed, fleet, monitoring_inventory):
    run = playbook("monitoring.yml", *monitoring_inventory, *EXTRA, timeout=1800)
    assert run.rc == 0, run.output[-8000:]
    yield run
    fleet.run("systemctl disable --now prometheus.service prometheus-node-exporter.service 2>/dev/null; true",
              timeout=120)


def api(fleet, path: str) -> dict:
    """An API answer's data, asked on the monitoring host (Prometheus listens on its loopback)."""
    url = "http://127.0.0.1:%d/api/v1/%s" % (constants.PROMETHEUS_PORT, path)
    script = "import urllib.request; print(urllib.request.urlopen(%r, timeout=10).read().decode())" % url
    answer = json.loads(fleet.run_one("python3 -c %s" % shlex.quote(script), fleet.orchestrator,
                                      what="Prometheus API %s" % path))
    assert answer["status"] == "success", answer
    return answer["data"]


def query(fleet, expr: str) -> list[dict]:
    """An instant query's result vector."""
    return api(fleet, "query?query=%s" % urllib.parse.quote(expr))["result"]


def by_target(result: list[dict]) -> dict[tuple[str, str], str]:
    """``{(job, llamafleet_host or instance): value}`` of a result vector."""
    return {(r["metric"].get("job", ""), r["metric"].get("llamafleet_host", r["metric"].get("instance", ""))):
            r["value"][1] for r in result}


def wait_for(fleet, expr: str, done, timeout: float = SCRAPE_WAIT) -> list[dict]:
    """Query until ``done(result)`` holds (scrapes and textfile writes come every 15 s); the last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = query(fleet, expr)
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(3)


def active_targets(fleet) -> dict[tuple[str, str], str]:
    """``{(job, llamafleet_host or instance): health}`` of the targets Prometheus scrapes now."""
    return {(t["labels"].get("job", ""), t["labels"].get("llamafleet_host", t["labels"].get("instance", ""))): t["health"]
            for t in api(fleet, "targets?state=active")["activeTargets"]}


def test_every_target_is_up(monitored, fleet):
    orch = fleet.orchestrator.name
    hosts = sorted([orch] + [w.name for w in fleet.workers])
    expected = {(constants.PROMETHEUS_JOB_LLAMA_SERVER, orch): "up", (constants.PROMETHEUS_JOB_GATE, orch): "up",
                ("prometheus", "127.0.0.1:%d" % constants.PROMETHEUS_PORT): "up"}
    expected.update({(constants.PROMETHEUS_JOB_NODE, host): "up" for host in hosts})
    deadline = time.monotonic() + SCRAPE_WAIT
    while (targets := active_targets(fleet)) != expected and time.monotonic() < deadline:
        time.sleep(3)
    # every llama-server scrape went through the edge and the gate with the key (a refused key is down), every node
    # exporter answers
    assert targets == expected, targets
    # and the series agree: up == 1 for each target (the package's own localhost job never ran: policy-rc.d kept
    # Prometheus stopped until the role had configured it, so no series of it lingers)
    up = by_target(query(fleet, "up"))
    assert up == {key: "1" for key in expected}, up


def test_llama_servers_counters_arrive(monitored, fleet):
    endpoint = Endpoint.of(fleet)
    before = query(fleet, "llamacpp:tokens_predicted_total")
    answer = endpoint.complete("The capital of France is", n_predict=8)
    assert answer["timings"]["predicted_n"] == 8
    total = float(before[0]["value"][1]) if before else 0.0
    result = wait_for(fleet, "llamacpp:tokens_predicted_total",
                      lambda r: bool(r) and float(r[0]["value"][1]) >= total + 8)
    assert result and float(result[0]["value"][1]) >= total + 8, result
    assert result[0]["metric"]["job"] == constants.PROMETHEUS_JOB_LLAMA_SERVER


def test_every_worker_reports_its_rpc_server(monitored, fleet):
    workers = sorted(w.name for w in fleet.workers)
    result = wait_for(fleet, "llamafleet_rpc_server_up",
                      lambda r: sorted(x["metric"]["llamafleet_host"] for x in r) == workers
                      and all(x["value"][1] == "1" for x in r))
    assert sorted(x["metric"]["llamafleet_host"] for x in result) == workers, result
    assert all(x["value"][1] == "1" and x["metric"]["unit"] == constants.RPC_SERVER_UNIT for x in result), result
    # llama-server holds a connection to every endpoint of its plan, and the journal says since when
    planned = {d["endpoint"] for d in read_plan(fleet)["devices"] if d.get("endpoint")}
    connected = {x["metric"]["endpoint"]: x["value"][1] for x in query(fleet, "llamafleet_rpc_server_client_connected")}
    assert planned and all(connected.get(e) == "1" for e in planned), (planned, connected)
    since = {x["metric"]["endpoint"]: float(x["value"][1])
             for x in query(fleet, "llamafleet_rpc_server_client_connected_since_seconds")}
    assert set(since) >= planned and all(0 < time.time() - s < 86400 for s in since.values()), since
    errors = query(fleet, "llamafleet_rpc_metrics_errors")
    assert sorted(x["metric"]["llamafleet_host"] for x in errors) == workers
    assert all(x["value"][1] == "0" for x in errors), errors


def test_the_gate_reports_each_worker_link(monitored, fleet):
    """The gate's per-link metrics (the kernel's view of llama-server's connections, ss -tin): one series per worker
    endpoint of the plan, label worker "host:port", connected, the model's bytes sent and answers received, a
    round-trip time under a second, and every family of the link there for each worker."""
    gate = '{job="%s"}' % constants.PROMETHEUS_JOB_GATE
    expected = {"%s:%d" % (w["host"], w["port"]) for w in plan_workers(read_plan(fleet)["devices"])}
    assert expected, "the plan has no remote worker"
    connected = wait_for(fleet, "llamafleet_gate_link_connected" + gate,
                         lambda r: {x["metric"].get("worker") for x in r} == expected)
    assert {x["metric"].get("worker"): x["value"][1] for x in connected} == {w: "1" for w in expected}, connected
    figures = {name: {x["metric"]["worker"]: float(x["value"][1]) for x in query(fleet, name + gate)}
               for name in ("llamafleet_gate_link_rtt_seconds", "llamafleet_gate_link_sent_bytes_total",
                            "llamafleet_gate_link_received_bytes_total", "llamafleet_gate_link_retransmits_total",
                            "llamafleet_gate_link_unacked_bytes", "llamafleet_gate_link_stalls_total")}
    assert all(set(values) == expected for values in figures.values()), figures
    assert all(0 < v < 1.0 for v in figures["llamafleet_gate_link_rtt_seconds"].values()), figures
    assert all(v > 0 for v in figures["llamafleet_gate_link_sent_bytes_total"].values()), figures
    assert all(v > 0 for v in figures["llamafleet_gate_link_received_bytes_total"].values()), figures


def test_the_gate_reports_how_long_the_model_load_took(monitored, fleet):
    """A restart of llama-server: the gate's metrics count one more load, and its duration is llama.cpp's own
    (the unit's start to the journal's ``model loaded`` line), plus at most the gate's poll and /health."""
    orch, unit = fleet.orchestrator, constants.LLAMA_SERVER_UNIT
    gate = '{job="%s"}' % constants.PROMETHEUS_JOB_GATE
    loads = wait_for(fleet, "llamafleet_llama_server_loads_total" + gate, bool)
    assert loads, "the gate's metrics never arrived"
    before = float(loads[0]["value"][1])
    fleet.run_one("systemctl restart %s" % unit, orch, what="restart llama-server", timeout=120)
    result = wait_for(fleet, "llamafleet_llama_server_loads_total" + gate,
                      lambda r: bool(r) and float(r[0]["value"][1]) > before, timeout=SCRAPE_WAIT + 120)
    assert result and float(result[0]["value"][1]) == before + 1, (before, result)
    seconds = float(query(fleet, "llamafleet_llama_server_load_seconds" + gate)[0]["value"][1])
    start, line = fleet.run_one(
        "systemctl show -p ExecMainStartTimestampMonotonic --value %s; "
        "journalctl _PID=$(systemctl show -p MainPID --value %s) -o short-monotonic --no-pager | grep -m1 'model loaded'"
        % (unit, unit), orch, what="llama-server's start and load").splitlines()
    expected = load_seconds(start, line)
    assert expected is not None and expected > 0, (start, line)
    assert expected <= seconds <= expected + 3.0, (seconds, expected, line)
    serving = 'llamafleet_gate_state{job="%s",state="serving"} == 1' % constants.PROMETHEUS_JOB_GATE
    state = wait_for(fleet, serving, bool)
    assert len(state) == 1 and state[0]["metric"]["llamafleet_host"] == orch.name, state


def test_prometheus_reads_the_key_only_it_may_read(monitored, fleet):
    orch = fleet.orchestrator
    meta = fleet.run_one("stat -c '%a %U %G' /etc/prometheus/llamafleet-llama-server.key", orch)
    assert meta.split() == ["640", "root", "prometheus"], meta


def test_a_second_run_changes_nothing(monitored, fleet, monitoring_inventory):
    run = playbook("monitoring.yml", *monitoring_inventory, *EXTRA, timeout=900)
    assert run.rc == 0, run.output[-6000:]
    assert run.changed == 0, run.output[-6000:]
