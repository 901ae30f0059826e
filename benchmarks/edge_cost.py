#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the edge (Debian's HAProxy in front of the gate) costs a client: time to the first token and tok/s, paired.

On the deployed lab with the edge on (the default), one process on the orchestrator streams completions to the gate
on loopback and through the edge, one of each per round, the order swapped every round, so that whatever else the
machine does weighs on both alike. Each round gives a pair; the figures are the medians of the pairs' differences
(time to the first token) and ratios (tok/s), with a 95 % bootstrap interval of each median, beside the plain
medians of each path. The issue's goal: the edge costs at most 1 % of tok/s and of time to the first token.

    python -m benchmarks.edge_cost [--rounds 30] [--n-predict 64] [--requests 500] [--json FILE]

Then each relay on the same stream: ``--relay-rounds`` pairs of completions that ask llama-server for its timings
with every token (``timings_per_token``). Per stream, the decode time the client saw (first token to last) against
the decode time llama-server reports for the same tokens, and the time to the first token beyond llama-server's own
prompt and first-token work: whatever the model's speed that round, what is left is the relays' share, so the
paired figures compare the edge with the gate without the model's spread.

Last, the hop alone: ``--requests`` GET /health each way on new connections, so that what HAProxy adds to one
request shows in microseconds.

Needs root and the lab deployed with the edge (``make demo``, or ``llamafleet lab up`` and deploy.yml).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from llamafleet.fleet import Fleet
from tests.e2e.test_edge_lab import REMOTE, gate_config, ship
from tests.helpers import INVENTORY

# Runs on the orchestrator with its python3 (stdlib and the shipped llamafleet.bench.measure): one warm-up through
# each path, then, each path in turn (the order swapped every round): the plain rounds ("gate"/"edge":
# [[ok, ttft_s, tok_s], ...]); the streams with llama-server's timings per token ("relay": per path
# [[status, [[client s, prompt_ms, predicted_ms, predicted_n], ...]], ...]); the hop alone, GET /health (answered by
# llama-server, no model work) on a new connection ("health": per path [[status, seconds], ...]). Prints it as JSON.
REMOTE_SCRIPT = """
import http.client, json, sys, time
from urllib.parse import urlsplit
from llamafleet.bench.measure import DEFAULT_PROMPT, request_body, sse_data, stream_completion
urls = json.loads(sys.argv[1]); rounds = int(sys.argv[2]); n_predict = int(sys.argv[3])
key = open(sys.argv[4]).read().split()[0]; requests = int(sys.argv[5]); relay_rounds = int(sys.argv[6])
def in_turn(count, measure):
    got = {name: [] for name in urls}
    for i in range(count):
        for name in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
            got[name].append(measure(urls[name]))
    return got
def plain(url):
    r = stream_completion(url, n_predict=n_predict, api_key=key, timeout=300)
    return [r.ok, r.ttft_s, r.tok_s]
def timed_stream(url):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    body = json.dumps(request_body("/completion", DEFAULT_PROMPT, n_predict, {"timings_per_token": True})).encode()
    started = time.perf_counter()
    conn.request("POST", "/completion", body=body, headers={"Authorization": "Bearer " + key,
                                                           "Content-Type": "application/json"})
    resp = conn.getresponse()
    points = []
    for data in sse_data(iter(resp.readline, b"")):
        now = time.perf_counter()
        try:
            t = json.loads(data).get("timings") or {}
        except ValueError:
            continue
        if "predicted_ms" in t:
            points.append([now - started, t.get("prompt_ms", 0.0), t["predicted_ms"], t.get("predicted_n", 0)])
    conn.close()
    return [resp.status, points]
def health(url):
    parts = urlsplit(url)
    started = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/health", headers={"Authorization": "Bearer " + key})
    status = conn.getresponse().status
    conn.close()
    return [status, time.perf_counter() - started]
for url in urls.values():
    stream_completion(url, n_predict=8, api_key=key, timeout=300)
out = in_turn(rounds, plain)
out["relay"] = in_turn(relay_rounds, timed_stream)
out["health"] = in_turn(requests, health)
print(json.dumps(out))
"""


def bootstrap_median(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def paired(gate: list[list], edge: list[list]) -> dict[str, float]:
    """The pairs' figures: the medians of each path, the median of the pairs' tok/s ratios (edge / gate) and of
    their differences in time to the first token (edge - gate), each with its 95 % interval."""
    ratios = [e[2] / g[2] for g, e in zip(gate, edge) if g[2] and e[2]]
    extra_ms = [(e[1] - g[1]) * 1000 for g, e in zip(gate, edge) if g[1] and e[1]]
    gate_ttft = statistics.median(g[1] for g in gate)
    return {
        "gate_ttft_ms": gate_ttft * 1000, "edge_ttft_ms": statistics.median(e[1] for e in edge) * 1000,
        "gate_tok_s": statistics.median(g[2] for g in gate), "edge_tok_s": statistics.median(e[2] for e in edge),
        "tok_s_ratio": statistics.median(ratios), "tok_s_ratio_95": bootstrap_median(ratios),
        "ttft_extra_ms": statistics.median(extra_ms), "ttft_extra_ms_95": bootstrap_median(extra_ms),
        "ttft_extra_share": statistics.median(extra_ms) / (gate_ttft * 1000), "pairs": len(ratios),
    }


def stream_shares(points: list[list[float]]) -> tuple[float, float]:
    """One stream's (seen, overhead_ms): the share of llama-server's decode speed the client saw (llama-server's decode
    time over the client's, first token to last), and the time to the first token beyond llama-server's own prompt
    and first-token work. ``points``: [client seconds since the request, prompt_ms, predicted_ms, predicted_n]."""
    first, last = points[0], points[-1]
    seen = (last[2] - first[2]) / ((last[0] - first[0]) * 1000)
    return seen, first[0] * 1000 - first[1] - first[2]


def relay_figures(gate: list[list], edge: list[list]) -> dict[str, Any]:
    """The relays compared on pairs of streams: medians of each path's share and overhead, the median of the pairs'
    ratios of shares (edge / gate: the tok/s the edge keeps) and differences of overhead, with 95 % intervals."""
    pairs = [(stream_shares(g[1]), stream_shares(e[1])) for g, e in zip(gate, edge)
             if len(g[1]) >= 2 and len(e[1]) >= 2]
    ratios = [e[0] / g[0] for g, e in pairs]
    extra = [e[1] - g[1] for g, e in pairs]
    return {"gate_seen": statistics.median(g[0] for g, _ in pairs),
            "edge_seen": statistics.median(e[0] for _, e in pairs),
            "gate_overhead_ms": statistics.median(g[1] for g, _ in pairs),
            "edge_overhead_ms": statistics.median(e[1] for _, e in pairs),
            "tok_s_ratio": statistics.median(ratios), "tok_s_ratio_95": bootstrap_median(ratios),
            "overhead_extra_ms": statistics.median(extra), "overhead_extra_ms_95": bootstrap_median(extra),
            "pairs": len(pairs)}


def hop_figures(gate: list[list], edge: list[list]) -> dict[str, float]:
    """What the edge adds to one small request: the medians of each path and of the pairs' differences (ms)."""
    extra = [(e[1] - g[1]) * 1000 for g, e in zip(gate, edge)]
    return {"gate_ms": statistics.median(g[1] for g in gate) * 1000,
            "edge_ms": statistics.median(e[1] for e in edge) * 1000,
            "extra_ms": statistics.median(extra), "extra_ms_95": bootstrap_median(extra), "pairs": len(extra)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--requests", type=int, default=500, help="GET /health requests each way (the hop alone)")
    parser.add_argument("--relay-rounds", type=int, default=40,
                        help="pairs of completions with llama-server's timings per token (each relay's share)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    fleet = Fleet.from_inventory(INVENTORY)
    orch = fleet.orchestrator
    config = gate_config(fleet)
    edge = Endpoint.of(fleet)
    gate = f"http://127.0.0.1:{config['listen_port']}"
    if config.get("listen_host") not in ("127.0.0.1", "::1") or edge.url == gate:
        sys.exit(f"{orch.name}: the gate listens on {config.get('listen_host')}:{config['listen_port']}: no edge in "
                 "front of it (deploy with the edge, the default)")
    urls = {"gate": gate, "edge": edge.url}
    ship(fleet, [orch])
    try:
        out = fleet.run_one(
            f"cd {REMOTE} && PYTHONPATH={REMOTE} python3 -c {shlex.quote(REMOTE_SCRIPT)} "
            f"{shlex.quote(json.dumps(urls))} {args.rounds} {args.n_predict} {constants.API_KEY_PATH} {args.requests} "
            f"{args.relay_rounds}", orch, timeout=60 + (args.rounds + args.relay_rounds) * 120 + args.requests)
    finally:
        fleet.run(f"rm -rf {REMOTE}", [orch])
    runs = json.loads(out)
    health = runs.pop("health")
    relay = runs.pop("relay")
    failed = {name: sum(1 for r in got if not r[0]) for name, got in runs.items()}
    failed.update({"health " + name: sum(1 for r in got if r[0] != 200) for name, got in health.items()})
    failed.update({"relay " + name: sum(1 for r in got if r[0] != 200 or len(r[1]) < 2)
                   for name, got in relay.items()})
    if any(failed.values()):
        sys.exit(f"failed completions: {failed}")
    figures = paired(runs["gate"], runs["edge"])
    low, high = figures["tok_s_ratio_95"]
    t_low, t_high = figures["ttft_extra_ms_95"]
    print(f"what the edge costs ({orch.name} to itself, {figures['pairs']} rounds of one streamed "
          f"{args.n_predict}-token completion each way, the order swapped every round):")
    print("| path | time to first token (median) | tok/s (median) |\n| --- | --- | --- |")
    print(f"| gate on loopback | {figures['gate_ttft_ms']:.1f} ms | {figures['gate_tok_s']:.2f} |")
    print(f"| through the edge | {figures['edge_ttft_ms']:.1f} ms | {figures['edge_tok_s']:.2f} |")
    print(f"paired: tok/s edge / gate {figures['tok_s_ratio']:.4f} (95 % interval {low:.4f} to {high:.4f}); "
          f"time to first token {figures['ttft_extra_ms']:+.2f} ms through the edge "
          f"({figures['ttft_extra_share'] * 100:+.2f} % of the gate's; 95 % interval {t_low:+.2f} to {t_high:+.2f} ms)")
    shares = relay_figures(relay["gate"], relay["edge"])
    r_low, r_high = shares["tok_s_ratio_95"]
    o_low, o_high = shares["overhead_extra_ms_95"]
    print(f"each relay on the same stream ({shares['pairs']} pairs with llama-server's timings per token): the "
          f"client saw {shares['gate_seen'] * 100:.2f} % of llama-server's decode speed from the gate and "
          f"{shares['edge_seen'] * 100:.2f} % through the edge (medians); tok/s edge / gate {shares['tok_s_ratio']:.4f} "
          f"(95 % interval {r_low:.4f} to {r_high:.4f}); time to the first token beyond llama-server's own work: gate "
          f"{shares['gate_overhead_ms']:.2f} ms, edge {shares['edge_overhead_ms']:.2f} ms, the edge adds "
          f"{shares['overhead_extra_ms']:+.2f} ms (95 % interval {o_low:+.2f} to {o_high:+.2f} ms), "
          f"{shares['overhead_extra_ms'] / figures['gate_ttft_ms'] * 100:+.2f} % of the time to the first token")
    hop = hop_figures(health["gate"], health["edge"])
    h_low, h_high = hop["extra_ms_95"]
    print(f"the hop alone ({hop['pairs']} GET /health each way, a new connection each): gate "
          f"{hop['gate_ms']:.3f} ms, edge {hop['edge_ms']:.3f} ms (medians); the edge adds {hop['extra_ms']:+.3f} ms "
          f"(95 % interval {h_low:+.3f} to {h_high:+.3f} ms), {hop['extra_ms'] / figures['gate_ttft_ms'] * 100:+.3f} % "
          "of the time to the first token above")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "relay_figures": shares, "hop": hop, "runs": runs,
                                         "relay": relay, "health": health}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
