"""Faults on a serving cluster, with a client sending completions all along, through the edge (Debian's HAProxy, on
by default, which passes the gate's answers on as the gate sent them) and the gate behind it.

Each fault is real: a killed process, a silent partition (nftables drop rules, no reset), a worker host
powered off and on, a worker whose disk is full. For each the test measures, from the client's side:

- time to a fast error: from the fault until the client gets the gate's 503 (through the edge);
- time to serving again: from the end of the fault until a completion succeeds;
- requests lost: completions that failed (each a 503 with a reason, from the gate or from llama-server while it
  loads; never a hang);
- the slowest request: no request may take longer than the gate's deadline allows.

The figures are printed as a table and written to ``$LLAMAFLEET_RESULTS`` (default
``bench-results/faults.json``) for the README. Runs after test_deploy.py, on its converged lab.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from tests.helpers import REPO, cli, invocation, playbook

# What the gate promises (role defaults): an error within the deadline, a restart after a lasting stall.
DEADLINE = 10.0
SLACK = 3.0
PARTITION_SECONDS = 120
# after a fault ends: the worker's guard (20 s), llama-server's wait for HELLO and the model load
SERVING_AGAIN_WITHIN = 150.0
RESULTS = Path(os.environ.get("LLAMAFLEET_RESULTS", REPO / "bench-results")) / "faults.json"


@dataclass
class Outcome:
    start: float
    end: float
    status: int
    message: str = ""


@dataclass
class Load:
    """One client sending a short completion every ``pause`` seconds until stopped."""

    endpoint: Endpoint
    pause: float = 0.25
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _one(self) -> Outcome:
        body = json.dumps({"prompt": "The capital of France is", "n_predict": 8, "cache_prompt": False}).encode()
        req = urllib.request.Request(self.endpoint.url + "/completion", data=body, method="POST")
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {self.endpoint.api_key}")
        start = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - the lab's endpoint
                json.loads(resp.read())
                return Outcome(start, time.monotonic(), resp.status)
        except urllib.error.HTTPError as exc:
            return Outcome(start, time.monotonic(), exc.code, exc.read().decode(errors="replace")[:300])
        except (OSError, ValueError) as exc:
            return Outcome(start, time.monotonic(), 0, f"{type(exc).__name__}: {exc}"[:300])

    def run(self) -> None:
        while not self._stop.is_set():
            self.outcomes.append(self._one())
            time.sleep(self.pause)

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)

    def serving_since(self, since: float, timeout: float) -> float | None:
        """Wait until a completion that started after ``since`` succeeded; seconds from ``since`` to its end."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [o for o in list(self.outcomes) if o.start >= since and o.status == 200]
            if done:
                return done[0].end - since
            time.sleep(0.5)
        return None


def summarize(name: str, load: Load, fault_at: float, healed_at: float, serving_again: float | None) -> dict:
    after = [o for o in load.outcomes if o.end >= fault_at]
    failed = [o for o in after if o.status != 200]
    return {
        "fault": name,
        "fast_error_s": round(min(o.end for o in failed) - fault_at, 2) if failed else None,
        "serving_again_s": round(serving_again, 1) if serving_again is not None else None,
        "fault_lasted_s": round(healed_at - fault_at, 1),
        "requests": len(after),
        "lost": len(failed),
        "slowest_s": round(max((o.end - o.start for o in load.outcomes), default=0.0), 2),
        "errors": sorted({f"{o.status} {o.message[:160]}" for o in failed})[:4],
    }


def record(row: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    rows = [r for r in rows if r["fault"] != row["fault"]] + [row]
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    if "serving_degraded_after_s" in row:
        print(f"\n{row['fault']}: fast error after {row['fast_error_s']} s, serving degraded "
              f"{row['serving_degraded_after_s']} s after the host went off, full plan again "
              f"{row['full_plan_after_return_s']} s after it was started, {row['lost']} of {row['requests']} "
              f"requests answered 503, slowest {row['slowest_s']} s")
        return
    print(f"\n{row['fault']}: fast error after {row['fast_error_s']} s, serving again {row['serving_again_s']} s "
          f"after the fault ended ({row['fault_lasted_s']} s), {row['lost']} of {row['requests']} requests lost, "
          f"slowest {row['slowest_s']} s")


# The clear errors a client may get: the gate's 503 with its reason, or, while llama-server loads (the gate relays
# then), llama-server's own 503; the edge passes both on as they are (it retries only a failed connect to the gate),
# and its own 503, were the gate not to answer, starts with "llamafleet: " too (roles/edge/templates/haproxy.cfg.j2).
# One client (0.25 s between requests), or 16 for 32 requests, stays far under the edge's per-address limits
# (edge_max_conn_per_address 64, edge_max_requests_per_address 600 per 10 s): no 429 and no refused connection.
CLEAR_503 = ("llamafleet: ", "Loading model")


def check(row: dict, load: Load) -> None:
    """No hang, only clear 503 errors, and serving again with no human."""
    assert row["serving_again_s"] is not None, row
    assert row["slowest_s"] <= DEADLINE + SLACK, row
    for outcome in load.outcomes:
        if outcome.status != 200:
            assert outcome.status == 503 and any(text in outcome.message for text in CLEAR_503), outcome
    assert row["lost"] == 0 or row["fast_error_s"] is not None


@pytest.fixture
def endpoint(deployed, fleet) -> Endpoint:
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=180)
    return endpoint


def gate_state(fleet) -> dict:
    orch = fleet.orchestrator
    res = fleet.run(f"cat {constants.GATE_STATE_PATH}", [orch])[orch.name]
    assert res.ok, res.stderr
    return json.loads(res.stdout)


def on(fleet, host, command: str) -> str:
    """Run a fault's ``command`` on ``host`` and assert it worked: a fault that failed to happen fails the test."""
    res = fleet.run(command, [host])[host.name]
    assert res.ok, f"{host.name}: {command}: {res.error or res.stderr}"
    return res.stdout


def killed(fleet, host, unit: str):
    """A fault that SIGKILLs ``unit`` on ``host``, and a check that it took effect: systemd started the unit again
    (its InvocationID changed) and the process that served before is gone."""
    before = invocation(fleet, host.name, unit)
    pid = on(fleet, host, f"systemctl show -p MainPID --value {unit}").strip()
    assert before and pid not in ("", "0"), (host.name, unit, before, pid)

    def inject() -> None:
        on(fleet, host, f"systemctl kill -s KILL {unit}")

    def took_effect() -> None:
        after = invocation(fleet, host.name, unit)
        assert after and after != before, f"{host.name}: {unit} was not restarted (InvocationID {before} -> {after})"
        assert not fleet.run(f"kill -0 {pid}", [host])[host.name].ok, f"{host.name}: pid {pid} of {unit} still runs"

    return inject, took_effect


def run_fault(fleet, endpoint: Endpoint, name: str, inject, heal=None, lasting: float = 0.0) -> dict:
    with Load(endpoint) as load:
        time.sleep(3)
        fault_at = time.monotonic()
        inject()
        if lasting:
            time.sleep(lasting)
        if heal:
            heal()
        healed_at = time.monotonic()
        serving_again = load.serving_since(healed_at, SERVING_AGAIN_WITHIN)
        time.sleep(2)
    row = summarize(name, load, fault_at, healed_at, serving_again)
    record(row)
    check(row, load)
    endpoint.wait_healthy(timeout=60)
    assert gate_state(fleet)["state"] == "serving"
    return row


def test_sixteen_clients_all_get_answers(fleet, endpoint):
    """16 clients streaming through the edge and the gate at once, on the planned slots: every request answered."""
    from llamafleet.bench.measure import stream_completion, sweep
    from llamafleet.cluster import read_plan

    plan = read_plan(fleet)
    assert plan["n_parallel"] > 1 and plan["kv_unified"], plan.get("explanation")
    result = sweep(lambda: stream_completion(endpoint.url, n_predict=16, api_key=endpoint.api_key, timeout=120.0),
                   16, requests=32)
    print(f"\n16 clients, {plan['n_parallel']} slots: {result.aggregate_tok_s:.1f} tok/s aggregate, "
          f"p95 {result.latency_p95_s:.1f} s, {result.errors} errors")
    assert result.errors == 0, result.error_samples
    assert result.requests == 32 and result.tokens >= 32 * 15


def test_rpc_server_killed(fleet, endpoint):
    worker = fleet.workers[0]
    inject, took_effect = killed(fleet, worker, constants.RPC_SERVER_UNIT)
    row = run_fault(fleet, endpoint, "rpc-server kill -9", inject)
    took_effect()
    assert row["lost"] >= 1  # llama-server aborts on a lost worker: the gate must have answered in between
    assert row["fast_error_s"] is not None and row["fast_error_s"] <= DEADLINE, row


def test_llama_server_killed(fleet, endpoint):
    orch = fleet.orchestrator
    inject, took_effect = killed(fleet, orch, constants.LLAMA_SERVER_UNIT)
    row = run_fault(fleet, endpoint, "llama-server kill -9", inject)
    took_effect()
    # clients saw it: the gate answered 503 (with its reason) while llama-server restarted and loaded
    assert row["lost"] >= 1 and row["fast_error_s"] is not None and row["fast_error_s"] <= DEADLINE, row


def _partition_rules(orch_address: str) -> str:
    return ("nft add table inet lf_fault && "
            "nft add chain inet lf_fault input '{ type filter hook input priority -10; }' && "
            "nft add chain inet lf_fault output '{ type filter hook output priority -10; }' && "
            f"nft add rule inet lf_fault input ip saddr {orch_address} drop && "
            f"nft add rule inet lf_fault output ip daddr {orch_address} drop")


def test_worker_silently_partitioned_for_two_minutes(fleet, endpoint):
    """Drop rules on the worker, both ways, no reset: llama-server blocks, the gate answers 503 within its
    deadline, restarts llama-server after 30 s; when the partition ends, the worker's guard frees rpc-server
    from the dead connection and the cluster serves again."""
    worker = fleet.workers[-1]
    orch = fleet.orchestrator
    fleet.run("nft delete table inet lf_fault", [worker])  # a leftover of an interrupted run
    restarts = gate_state(fleet)["restarts"]
    try:
        row = run_fault(fleet, endpoint, "silent partition 2 min",
                        lambda: on(fleet, worker, _partition_rules(orch.cluster_address)),
                        lambda: on(fleet, worker, "nft delete table inet lf_fault"), lasting=PARTITION_SECONDS)
    finally:
        fleet.run("nft delete table inet lf_fault", [worker])
    assert row["fast_error_s"] is not None and row["fast_error_s"] <= DEADLINE, row
    assert gate_state(fleet)["restarts"] > restarts  # the stall was seen and llama-server restarted


def test_worker_frozen_while_llama_server_waits_for_it(fleet, endpoint):
    """rpc-server stopped (SIGSTOP) on a host that no longer answers the orchestrator's ping: its kernel still
    acknowledges llama-server's requests, so nothing is left unacknowledged and only the gate's ping of the
    host tells the lost worker from a slow one (the shape of a partition that begins while llama-server waits
    for an answer). Clients get 503 within the deadline, llama-server is restarted after 30 s, and once the
    worker runs again the cluster serves."""
    worker = fleet.workers[-1]
    orch = fleet.orchestrator
    unit = constants.RPC_SERVER_UNIT
    drop_ping = ("nft add table inet lf_fault && "
                 "nft add chain inet lf_fault input '{ type filter hook input priority -10; }' && "
                 f"nft add rule inet lf_fault input ip saddr {orch.cluster_address} icmp type echo-request drop")
    fleet.run("nft delete table inet lf_fault", [worker])  # a leftover of an interrupted run
    restarts = gate_state(fleet)["restarts"]
    since = fleet.run("date +%s", [orch])[orch.name].stdout.strip()
    try:
        row = run_fault(fleet, endpoint, "worker frozen, host silent to ping, 45 s",
                        # the process is stopped (state T) once the kill returns, or the fault failed
                        lambda: on(fleet, worker, f"{drop_ping} && systemctl kill -s STOP {unit} && sleep 0.2 && "
                                   f"ps -o stat= -p $(systemctl show -p MainPID --value {unit}) | grep -q T"),
                        lambda: on(fleet, worker, f"systemctl kill -s CONT {unit} && nft delete table inet lf_fault"),
                        lasting=45)
    finally:
        fleet.run(f"systemctl kill -s CONT {unit}; nft delete table inet lf_fault", [worker])
    assert row["fast_error_s"] is not None and row["fast_error_s"] <= DEADLINE, row
    assert gate_state(fleet)["restarts"] > restarts
    journal = fleet.run(f"journalctl -o cat -u {constants.GATE_UNIT} --since @{since}", [orch])[orch.name].stdout
    assert f"worker {worker.name} ({worker.cluster_address}:" in journal and "its host does not answer ping" in journal, \
        journal[-3000:]


def _reachable(host) -> bool:
    """Whether ``host`` accepts a TCP connection on its SSH port."""
    import socket

    try:
        with socket.create_connection((host.address, host.port), timeout=2):
            return True
    except OSError:
        return False


def test_worker_host_stopped_and_started(fleet, endpoint):
    worker = fleet.workers[-1]
    unit = constants.RPC_SERVER_UNIT
    before = invocation(fleet, worker.name, unit)
    down: list[bool] = []

    def stop() -> None:
        cli("lab", "stop", worker.name, timeout=120)
        down.append(not _reachable(worker))

    try:
        row = run_fault(fleet, endpoint, "worker host powered off 30 s", stop,
                        lambda: cli("lab", "start", worker.name, timeout=300), lasting=30)
        assert down == [True], f"{worker.name} still answered on port {worker.port} after lab stop"
        after = invocation(fleet, worker.name, unit)
        assert after and after != before, f"{worker.name}: rpc-server is not a new start ({before} -> {after})"
        assert row["lost"] >= 1 and row["fast_error_s"] is not None and row["fast_error_s"] <= DEADLINE, row
    finally:
        if cli("lab", "status", check=False).returncode != 0:
            cli("lab", "up", "--hosts", "3", timeout=1200)


def test_worker_disk_full(fleet, endpoint):
    """The worker's cache folder on a filesystem with no space left, then rpc-server killed: it reloads from
    its seeded cache (reads only) and the cluster serves again."""
    worker = fleet.workers[0]
    cache = constants.rpc_cache_dir()
    fill = (f"set -e; d={cache}; mkdir -p /run/lf-full; "
            f"size=$(( $(du -sk $d | cut -f1) + 256 ))k; mount -t tmpfs -o size=$size,mode=0700 tmpfs /run/lf-full; "
            "cp -a $d/. /run/lf-full/; chown --reference=$d /run/lf-full; "
            "dd if=/dev/zero of=/run/lf-full/.filler bs=64k 2>/dev/null || true; "
            "mount --bind /run/lf-full $d; df -k $d | tail -1")
    empty = f"umount -l {cache} || true; umount -l /run/lf-full || true"
    inject, took_effect = killed(fleet, worker, constants.RPC_SERVER_UNIT)
    filled = fleet.run(fill, [worker])[worker.name]
    try:
        assert filled.ok, filled.stderr
        assert filled.stdout.split()[3] == "0", filled.stdout  # no space left
        row = run_fault(fleet, endpoint, "worker disk full, rpc-server restarted", inject)
        took_effect()
        # still full while rpc-server started again and the cluster served from it
        still = on(fleet, worker, f"df -k {cache} | tail -1").split()
        assert still[3] == "0", still
    finally:
        fleet.run(empty, [worker])
    assert row["serving_again_s"] is not None
    assert row["lost"] >= 1 and row["fast_error_s"] is not None and row["fast_error_s"] <= DEADLINE, row


def _llama_server_rpc(fleet) -> str:
    """The --rpc list of the running llama-server (from its command line)."""
    orch = fleet.orchestrator
    res = fleet.run(f"tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value {constants.LLAMA_SERVER_UNIT})/cmdline",
                    [orch])[orch.name]
    words = res.stdout.split()
    return words[words.index("--rpc") + 1] if "--rpc" in words else ""


def _wait_for(predicate, timeout: float, step: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return None


def test_degraded_mode_serves_without_a_lost_worker_and_restores_the_full_plan(fleet, endpoint):
    """llama_server_degrade: lab3 powered off; the cluster serves on the other workers (the plan the deploy made
    without lab3, put in place by the root switch at the gate's request), then, once lab3 is back and answers
    HELLO, on the full plan again. No human in between."""
    worker = fleet.workers[-1]
    orch = fleet.orchestrator
    endpoint_of_worker = f"{worker.cluster_address}:"
    degrade = ("-e", "llama_server_degrade=true", "-e", "llama_server_degrade_after=20")
    try:
        run = playbook("deploy.yml", *degrade)
        assert run.rc == 0, run.output[-6000:]
        plans = fleet.run(f"ls {constants.DEGRADED_PLANS_DIR}; systemctl is-active {constants.PLAN_SWITCH_PATH_UNIT}",
                          [orch])[orch.name].stdout.split()
        assert plans == sorted(f"without-{w.name}.conf" for w in fleet.workers) + ["active"], plans
        endpoint.wait_healthy(timeout=180)
        assert endpoint_of_worker in _llama_server_rpc(fleet)
        full_rpc = _llama_server_rpc(fleet)
        with Load(endpoint) as load:
            time.sleep(3)
            fault_at = time.monotonic()
            cli("lab", "stop", worker.name, timeout=120)
            degraded = _wait_for(lambda: (gate_state(fleet).get("plan") or {}).get("mode") == "degraded"
                                 and gate_state(fleet)["state"] == "serving", timeout=240)
            degraded_at = time.monotonic()
            assert degraded, gate_state(fleet)
            serving_degraded = load.serving_since(degraded_at - 5, 60)
            assert serving_degraded is not None
            assert endpoint_of_worker not in _llama_server_rpc(fleet)
            state = gate_state(fleet)
            assert state["plan"]["without"] == worker.name, state
            dropin = fleet.run(f"cat {constants.PLAN_DROPIN_PATH}", [orch])[orch.name].stdout
            assert f"without worker {worker.name}" in dropin
            status = cli("status", check=False)
            assert f"degraded, without {worker.name}" in status.stdout, status.stdout
            cli("lab", "start", worker.name, timeout=300)
            back_at = time.monotonic()
            restored = _wait_for(lambda: _llama_server_rpc(fleet) == full_rpc
                                 and gate_state(fleet)["state"] == "serving", timeout=240, step=2)
            restored_at = time.monotonic()
            assert restored, (gate_state(fleet), _llama_server_rpc(fleet))
            full_again = load.serving_since(restored_at - 2, 60)
        failed = [o for o in load.outcomes if o.status != 200]
        for outcome in failed:
            assert outcome.status == 503 and any(text in outcome.message for text in CLEAR_503), outcome
        assert max(o.end - o.start for o in load.outcomes) <= DEADLINE + SLACK
        assert full_again is not None
        assert fleet.run(f"test ! -e {constants.PLAN_DROPIN_PATH}", [orch])[orch.name].ok
        journal = fleet.run(f"journalctl -o cat -u {constants.GATE_UNIT} -u {constants.PLAN_SWITCH_UNIT} "
                            f"--since '-15 min'", [orch])[orch.name].stdout
        assert f"worker {worker.name} does not answer HELLO: serving degraded without it" in journal, journal[-3000:]
        assert f"worker {worker.name} answers HELLO again" in journal and "switching llama-server to" in journal
        record({"fault": "degraded mode: worker host off, then on",
                "fast_error_s": round(min(o.end for o in failed) - fault_at, 2) if failed else None,
                "serving_degraded_after_s": round(degraded_at - fault_at, 1),
                "full_plan_after_return_s": round(restored_at - back_at, 1),
                "requests": len(load.outcomes), "lost": len(failed),
                "slowest_s": round(max(o.end - o.start for o in load.outcomes), 2)})
    finally:
        if cli("lab", "status", check=False).returncode != 0:
            cli("lab", "up", "--hosts", "3", timeout=1200)
        restore = playbook("deploy.yml")
        assert restore.rc == 0, restore.output[-6000:]
    gone = fleet.run(f"test ! -e {constants.DEGRADED_PLANS_DIR} && ! systemctl cat {constants.PLAN_SWITCH_PATH_UNIT}",
                     [orch])[orch.name]
    assert gone.ok, gone.stdout + gone.stderr
