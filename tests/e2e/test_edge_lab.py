"""The edge (roles/edge, Debian's HAProxy), on by default, on the deployed lab: attacked, measured, turned off and on.

Runs after test_serving_tls.py on the converged plain-HTTP lab, which the first deploy.yml gave the edge without
being asked (``llamafleet_edge`` unset: lab1 installed Debian's haproxy through the lab's package proxy, and the gate
listens on 127.0.0.1:llama_server_gate_port). Against the deployed endpoint:

- HAProxy holds the clients' port, the gate is behind it on loopback, llama-server answers through both;
- llamafleet.bench.hostile's cases from the controller: each as expected (4xx, or a close for a silent
  connection; never a reset), only the suite's control cases reach the gate (the gate's own request counter), and a
  keyed completion is answered afterwards;
- the controller holds 1,000 trickling connections while lab3 sends keyed probes (``hostile --probes-only``):
  each answered within 1 s;
- keyless requests to a path of their own get 401 and reach nothing behind the edge: the gate's request counter does
  not move for them (and moves for the same path with the key), and the edge's access log in lab1's journal shows
  each of them refused there and the keyed one sent on;
- the gate's metrics need the key at the edge;
- what the edge costs: streamed completions (llamafleet.bench.measure, run on lab1) to the gate on loopback and
  through the edge, time to first token and tok/s printed;
- last, the opt-out: a deploy with ``llamafleet_edge=none`` (and a TLS pair, so that the gate's own TLS, which ships
  for the opt-out, is served too) stops HAProxy and puts the gate back on the clients' port (llama-server not
  restarted, a keyed completion answered over https); a plain deploy then gives the lab its edge back as it was
  found.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import ssl
import statistics
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest

from llamafleet.bench import hostile
from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from llamafleet.layout import orchestrator_layout
from tests.helpers import (BIN, INVENTORY, REPO, TLS_DIR, env, invocation, listeners, playbook, put_tls_file,
                           self_signed_pair)

# The opt-out of the edge (on by default).
NO_EDGE = ["-e", "llamafleet_edge=none"]
# The library files the lab hosts run with their python3 (stdlib only), under their library names.
SHIPPED = {"llamafleet/bench/hostile.py": REPO / "llamafleet" / "bench" / "hostile.py",
           "llamafleet/bench/measure.py": REPO / "llamafleet" / "bench" / "measure.py",
           "llamafleet/core/http_wire.py": REPO / "plugins" / "module_utils" / "http_wire.py"}
REMOTE = "/root/llamafleet-edge-e2e"
# streamed completions each way in the edge's cost, gate and edge taking turns
ROUNDS = 5
# The edge's head timeout is 10 s (edge_timeout_head): the suite's slow senders trickle past it.
SLOW_SECONDS = 12.0
PROBE_HOST = "lab3"


def gate_config(fleet) -> dict:
    return json.loads(fleet.run_one(f"cat {constants.GATE_CONFIG_PATH}", fleet.orchestrator))


def ship(fleet, hosts) -> None:
    """The SHIPPED files into REMOTE on ``hosts`` (a namespace package ``llamafleet``: python3 -m finds them), one
    command per file (a command line is one argument of at most 128 KiB)."""
    commands = [f"install -d -m 0700 {REMOTE} {REMOTE}/llamafleet/bench {REMOTE}/llamafleet/core"]
    commands += [f"echo {base64.b64encode(src.read_bytes()).decode()} | base64 -d > {REMOTE}/{dest}"
                 for dest, src in SHIPPED.items()]
    for command in commands:
        failed = fleet.run(command, hosts).failed
        assert not failed, {name: res.reason for name, res in failed.items()}


def gate_requests(endpoint: Endpoint) -> int:
    """The gate's count of client requests it read (llamafleet_gate_requests_total; its metrics are not counted)."""
    req = urllib.request.Request(endpoint.url + "/llamafleet/metrics",
                                 headers={"Authorization": f"Bearer {endpoint.api_key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - the lab's endpoint
        text = resp.read().decode()
    found = re.search(r"^llamafleet_gate_requests_total (\S+)$", text, re.M)
    assert found, text[:2000]
    return int(float(found.group(1)))


def status_of(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - the lab's endpoint
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def assert_answers(endpoint: Endpoint) -> None:
    done = endpoint.complete("The capital of France is", n_predict=8)
    assert done.get("content", "").strip(), done


def serves_through_the_edge(fleet, port: int) -> dict:
    """Asserts the edge's shape on lab1: HAProxy alone on the clients' ``port``, the gate on loopback behind it in
    plain HTTP, HAProxy enabled; the gate's configuration."""
    config = gate_config(fleet)
    assert config["listen_host"] == "127.0.0.1" and config["listen_port"] != port, config
    assert config.get("tls_cert", "") == "", config
    assert [line.split()[0] for line in listeners(fleet, port)] == ["haproxy"]
    assert listeners(fleet, config["listen_port"]) == [f"python3 127.0.0.1:{config['listen_port']}"]
    assert fleet.run_one("systemctl is-enabled haproxy.service || true", fleet.orchestrator).strip() == "enabled"
    return config


@pytest.fixture(scope="module")
def edge(deployed, fleet):
    """The lab as the plain deploy left it: the edge on by default (no deploy here); the probe files shipped."""
    orch = fleet.orchestrator
    assert orch.var("llamafleet_edge", None) is None, "the lab inventory sets llamafleet_edge: this tests the default"
    endpoint = Endpoint.of(fleet)
    serves_through_the_edge(fleet, endpoint.port)
    ship(fleet, [orch, fleet.hosts[PROBE_HOST]])
    try:
        yield endpoint
    finally:
        fleet.run(f"rm -rf {REMOTE}", [orch, fleet.hosts[PROBE_HOST]])


def test_the_edge_holds_the_clients_port_and_the_gate_is_behind_it(edge, fleet) -> None:
    serves_through_the_edge(fleet, edge.port)
    orch = fleet.orchestrator
    # Debian's unit with the role's drop-in; the worker runs as haproxy, chrooted
    assert "llamafleet.conf" in fleet.run_one("systemctl show -p DropInPaths --value haproxy.service", orch)
    assert "haproxy" in fleet.run_one("ps -o user= -C haproxy", orch).split()
    assert status_of(edge.url + "/health")[0] == 200
    assert_answers(edge)


def test_the_hostile_suite_gets_its_answers_and_nothing_else_reaches_the_gate(edge) -> None:
    endpoint = hostile.Endpoint.from_url(edge.url)
    before = gate_requests(edge)
    results = hostile.run_suite(endpoint, edge.api_key, f"{edge.address}:{edge.port}", slow_seconds=SLOW_SECONDS,
                                workers=8)
    reached = gate_requests(edge) - before
    print(hostile.table(results))
    assert len(results) >= 100
    assert [r.case.name for r in results if not r.ok] == []
    assert not [r.case.name for r in results if r.outcome == "reset"]
    # the control cases, and only they, were sent on
    assert reached == len([r for r in results if r.case.backend]), reached
    assert_answers(edge)


def test_a_flood_from_one_address_leaves_another_served_within_a_second(edge, fleet) -> None:
    probe_host = fleet.hosts[PROBE_HOST]
    fleet.run_one(f"umask 077 && printf '%s\\n' {shlex.quote(edge.api_key)} > {REMOTE}/key", probe_host)
    command = (f"cd {REMOTE} && PYTHONPATH={REMOTE} python3 -m llamafleet.bench.hostile {shlex.quote(edge.url)} "
               f"--key-file {REMOTE}/key --probes-only 10")
    with hostile.Flood(hostile.Endpoint.from_url(edge.url), 1000, f"{edge.address}:{edge.port}") as attack:
        time.sleep(1.0)
        held_at_start = attack.held
        result = fleet.run(command, [probe_host], timeout=60)[PROBE_HOST]
        counts = dict(attack.counts)
    print(f"flood from the controller: {held_at_start} connections held at the start, {counts}; "
          f"{PROBE_HOST}'s probes: {result.stdout.strip()}")
    report = json.loads(result.stdout)
    assert result.ok and report["ok"], (result.stdout, result.stderr)
    assert report["served_in_time"] == 10 and report["slowest_s"] <= 1.0, report
    # the edge shed the flood: connections past its per-address cap refused or dropped
    assert counts["refused"] + counts["dropped"] > 0, counts
    assert_answers(edge)


def test_no_keyless_request_reaches_the_gate(edge, fleet) -> None:
    marker = f"/v1/llamafleet-edge-e2e-{uuid.uuid4().hex}"
    wrong = [{}, {"Authorization": "Bearer not-the-key-0123456789"}, {"Authorization": "Basic " + edge.api_key},
             {"Authorization": edge.api_key}, {"Authorization": "Bearer " + edge.api_key + "x"},
             {"X-Api-Key": edge.api_key}]
    since = fleet.run_one("date '+%Y-%m-%d %H:%M:%S'", fleet.orchestrator).strip()
    before = gate_requests(edge)
    statuses = [status_of(edge.url + marker, headers)[0] for headers in wrong * 3]
    after = gate_requests(edge)
    assert statuses == [401] * len(wrong) * 3
    assert after == before, f"{after - before} keyless requests reached the gate"
    # the same path with the key goes through (llama-server has no such path): the count does move
    assert status_of(edge.url + marker, {"Authorization": f"Bearer {edge.api_key}"})[0] == 404
    assert gate_requests(edge) == after + 1
    # the edge's access log (lab1's journal): each keyless one refused at the edge, the keyed one sent to the gate
    lines: list[str] = []
    for _attempt in range(20):
        lines = [line for line in fleet.run_one(
            f"journalctl -u haproxy.service --since {shlex.quote(since)} --no-pager -o cat",
            fleet.orchestrator).splitlines() if marker in line]
        if len(lines) == len(statuses) + 1:
            break
        time.sleep(0.5)
    assert len(lines) == len(statuses) + 1, lines
    refused = [line for line in lines if "<NOSRV>" in line]
    assert len(refused) == len(statuses) and all(" 401 " in line for line in refused), lines
    assert [line for line in lines if "<NOSRV>" not in line and " 404 " in line and "/gate " in line], lines
    assert edge.api_key not in "\n".join(lines)


def test_metrics_need_the_key_at_the_edge(edge) -> None:
    for path in ("/llamafleet/metrics", "/metrics"):
        for headers in ({}, {"Authorization": "Bearer not-the-key-0123456789"}):
            status, body = status_of(edge.url + path, headers)
            assert status == 401 and b"invalid or missing API key" in body, (path, headers, status, body[:300])
    status, body = status_of(edge.url + "/llamafleet/metrics", {"Authorization": f"Bearer {edge.api_key}"})
    assert status == 200 and b"llamafleet_gate_state" in body


def test_what_the_edge_costs(edge, fleet) -> None:
    """Streamed completions from lab1 itself, to the gate on loopback and through the edge, taking turns (so that a
    lab busy with something else weighs on both alike)."""
    config = gate_config(fleet)
    urls = {"gate": f"http://127.0.0.1:{config['listen_port']}", "edge": edge.url}
    runs: dict[str, list] = {name: [] for name in urls}
    for _round in range(ROUNDS):
        for name, url in urls.items():
            out = fleet.run_one(
                f"cd {REMOTE} && PYTHONPATH={REMOTE} python3 -m llamafleet.bench.measure --url {shlex.quote(url)} "
                f"--api-key-file {constants.API_KEY_PATH} --repetitions 1 --n-predict 32", fleet.orchestrator,
                timeout=300)
            runs[name] += json.loads(out)["repetitions"]
    assert all(r["ok"] for name in runs for r in runs[name]), runs
    figures = {name: (statistics.median(r["ttft_s"] for r in got), statistics.median(r["tok_s"] for r in got))
               for name, got in runs.items()}
    print(f"what the edge costs (lab1 to itself, {ROUNDS} streamed completions of 32 tokens each way, taking turns, "
          "medians): "
          + ", ".join(f"{name} {ttft * 1000:.1f} ms to the first token, {tok_s:.1f} tok/s"
                      for name, (ttft, tok_s) in figures.items()))
    assert all(ttft > 0 and tok_s > 0 for ttft, tok_s in figures.values()), figures


def test_the_edge_turned_off_then_on_again(edge, fleet, tmp_path) -> None:
    """The opt-out, ``llamafleet_edge=none``, with a TLS pair: HAProxy stopped and disabled, the gate back on the
    clients' port holding TLS itself (its own TLS code, which ships for the opt-out: https with the given
    certificate, plain HTTP refused), llama-server not restarted and answering; then the default again (a plain
    deploy): the edge as found, in plain HTTP. Last in this module: the other tests need the edge. (The same deploy
    that turns the edge off gives the gate its TLS: one case of the gate's TLS at no deploy of its own.)"""
    orch = fleet.orchestrator
    port = edge.port
    found = listeners(fleet, port)
    llama_server = invocation(fleet, orch.name, constants.LLAMA_SERVER_UNIT)
    cert, key = self_signed_pair(orch.cluster_address)
    put_tls_file(fleet, orch, f"{TLS_DIR}/gate.pem", cert, "0644")
    put_tls_file(fleet, orch, f"{TLS_DIR}/gate.key", key, "0640")
    (tmp_path / "gate.pem").write_bytes(cert)
    context = ssl.create_default_context(cafile=str(tmp_path / "gate.pem"))
    tls = ["-e", f"llama_server_tls_cert={TLS_DIR}/gate.pem", "-e", f"llama_server_tls_key={TLS_DIR}/gate.key"]
    try:
        started = time.monotonic()
        off = playbook("deploy.yml", *NO_EDGE, *tls, timeout=1200)
        print(f"deploy with llamafleet_edge=none and TLS at the gate: {time.monotonic() - started:.0f} s")
        assert off.rc == 0, off.output[-8000:]
        assert [line.split()[0] for line in listeners(fleet, port)] == ["python3"]
        config = gate_config(fleet)
        assert (config["listen_host"], config["listen_port"], config.get("tls_cert")) == (
            edge.address, port, f"{TLS_DIR}/gate.pem"), config
        assert fleet.run_one("systemctl is-active haproxy.service || true", orch).strip() != "active"
        assert fleet.run_one("systemctl is-enabled haproxy.service || true", orch).strip() != "enabled"
        assert invocation(fleet, orch.name, constants.LLAMA_SERVER_UNIT) == llama_server
        # where the deployment record says clients connect (the inventory alone does not know: -e gave the pair)
        gate = Endpoint.of(fleet, layout=orchestrator_layout(fleet))
        assert gate.url == edge.url.replace("http://", "https://"), (gate.url, edge.url)
        req = urllib.request.Request(gate.url + "/completion", method="POST", data=json.dumps(
            {"prompt": "The capital of France is", "n_predict": 4}).encode(),
            headers={"Authorization": f"Bearer {gate.api_key}"})
        with urllib.request.urlopen(req, timeout=60, context=context) as resp:  # noqa: S310 - the lab's gate
            assert resp.status == 200 and json.loads(resp.read())["content"].strip()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(edge.url + "/health", timeout=10)  # noqa: S310 - plain HTTP is not spoken
    finally:
        started = time.monotonic()
        restore = playbook("deploy.yml", timeout=1200)
        print(f"deploy with the edge again (the default): {time.monotonic() - started:.0f} s")
        fleet.run(f"rm -rf {TLS_DIR}", [orch])
    assert restore.rc == 0, restore.output[-8000:]
    assert listeners(fleet, port) == found
    serves_through_the_edge(fleet, port)
    assert invocation(fleet, orch.name, constants.LLAMA_SERVER_UNIT) == llama_server
    assert Endpoint.of(fleet).url == edge.url
    Endpoint.of(fleet).wait_healthy(timeout=120)
    assert_answers(Endpoint.of(fleet))


def test_a_reload_haproxy_cannot_load_fails_and_the_edge_serves_on(edge, fleet) -> None:
    """A configuration that passes ``haproxy -c`` but cannot load (its port held by another program): the edge's
    reload handler (edge_reload) fails naming the unit and HAProxy's "Loading failure!", where ``systemctl reload``
    alone reports success; the old workers keep serving. Then the true configuration reloads and reports so."""
    orch = fleet.orchestrator
    config, port, marker = "/etc/haproxy/haproxy.cfg", 18099, "llamafleet-test-holder"
    holder = (f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
              f"time.sleep(600)")

    def reload() -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "ansible"), "-i", str(INVENTORY), orch.name, "-m",
                               "llamafleet.cluster.edge_reload"], cwd=REPO, env=env(), capture_output=True, text=True,
                              timeout=120, check=False)

    fleet.run_one(f"cp -p {config} {config}.{marker} && (setsid python3 -c {shlex.quote(holder)} {marker} "
                  f"</dev/null >/dev/null 2>&1 &) && sleep 1 && printf 'frontend {marker}\\n  bind 127.0.0.1:{port}\\n"
                  f"  http-request deny\\n' >> {config}", orch)
    try:
        assert fleet.run_one(f"haproxy -c -q -f {config} && echo passes", orch).strip() == "passes"
        assert listeners(fleet, port), f"nothing holds port {port} on {orch.name}"
        failed = reload()
        out = failed.stdout + failed.stderr
        assert failed.returncode != 0, out
        assert "haproxy.service: HAProxy could not load the new configuration (Loading failure!)" in out, out
        assert "cannot bind socket" in out, out
        assert_answers(edge)
    finally:
        fleet.run(f"mv {config}.{marker} {config}; pkill -f {marker} || true", [orch])
    done = reload()
    assert done.returncode == 0 and "CHANGED" in done.stdout, done.stdout + done.stderr
    assert not listeners(fleet, port)
    assert_answers(edge)
