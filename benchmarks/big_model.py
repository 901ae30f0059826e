#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The model no lab host can hold, from bare hosts to many clients: where its bytes go and what it serves.

On a 3-host lab whose hosts each have an enforced 4096 MiB (``lab up --memory-mib``), with the synthetic 6.41 GiB
llama-2-7B shape (``llamafleet.lab.artifacts.BIG_MODEL``) as the model's source on the lab mirror:

1. ``lab down``, ``lab up`` (bare hosts), ``deploy.yml`` with the big model, the first completion: the time from
   bare hosts to the first token;
2. bytes from the source, per client address (the mirror's log of what it sent): once, to the controller;
3. bytes into each host over the LAN during the deploy (its veth's counter on the controller) and its disk used
   (the rpc-server cache and the models folder) against the share its plan gives it; the seeding rate; llama.cpp's
   model, KV and compute buffers per device against the plan's weights, KV and compute margin (its load log);
4. load time and bytes sent to the workers at load, seeded (the deployed caches) against unseeded (caches moved
   aside, then back);
5. decode tok/s of the cluster against one llama-server of the same build and model on this machine with no memory
   limit, in the same run;
6. ``--clients`` clients filling the whole context together: aggregate tok/s and errors, and each rpc-server's peak
   RSS against its host's limit, and the OOM kills of every host's memory cgroup.

Then it deploys gemma again. Needs root and about 30 GB of disk.

    python -m benchmarks.big_model [--clients 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from llamafleet.bench.cache import CACHE_DIR
from llamafleet.bench.measure import stream_completion, sweep
from llamafleet.cluster import Endpoint, api_key_of, read_plan, server_log
from llamafleet.core.log_parse import buffers_against_plan, parse_load_log
from llamafleet.fleet import Fleet
from llamafleet.lab import LabPaths
from llamafleet.lab.artifacts import (
    BIG_MODEL,
    BIG_MODEL_CTX,
    BIG_MODEL_NAME,
    LLAMA_CPP_COMMIT,
    big_model_extra_vars,
    ensure_artifact,
)
from llamafleet.lab.core import DEFAULT_MEMORY_MIB
from llamafleet.lab.memory import PEAK_RSS_COMMAND, oom_kills
from llamafleet.lab.mirror import mirror_url, publish
from tests.helpers import INVENTORY, cli, playbook

CTX = BIG_MODEL_CTX
CACHE = CACHE_DIR
MODELS = "/var/lib/llamafleet/models"
SENT = re.compile(r" INFO (\S+) sent (\d+) bytes of /(\S+)$")


def veth_tx(name: str) -> int:
    """Bytes the controller's end of host ``name``'s link sent into it (everything the host received)."""
    return int(Path(f"/sys/class/net/vb-{name}/statistics/tx_bytes").read_text())


def source_bytes(log: Path, start: int, path: str) -> dict[str, int]:
    """Bytes of ``path`` the mirror sent to each client address since byte ``start`` of its log."""
    out: dict[str, int] = {}
    with log.open(encoding="utf-8", errors="replace") as handle:
        handle.seek(start)
        for line in handle:
            found = SENT.search(line.rstrip("\n"))
            if found and found.group(3) == path:
                out[found.group(1)] = out.get(found.group(1), 0) + int(found.group(2))
    return out


def decode_tok_s(url: str, key: str, runs: int = 2) -> float:
    results = [stream_completion(url, "Once upon a time", n_predict=32, api_key=key, timeout=600) for _ in range(runs)]
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise SystemExit(f"completions failed: {bad}")
    return max(r.tok_s for r in results if r.tok_s)


def load(fleet: Fleet, key: str) -> tuple[float, int]:
    """Restart llama-server; (seconds until /health answers 200, bytes the workers received meanwhile)."""
    before = sum(veth_tx(w.name) for w in fleet.workers)
    started = time.monotonic()
    fleet.run_one("systemctl restart llamafleet-llama-server", fleet.orchestrator, what="restart llama-server")
    Endpoint.of(fleet, api_key=key).wait_healthy(timeout=900)
    return time.monotonic() - started, sum(veth_tx(w.name) for w in fleet.workers) - before


def local_tok_s(model: Path, threads: int = 2) -> float:
    """One llama-server of the lab's build on this machine, the whole model in its memory."""
    artifact = sorted((LabPaths.default().root / "artifacts").glob(f"{LLAMA_CPP_COMMIT[:12]}-cpu-*.tar.gz"))[-1]
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(artifact) as tar:
            tar.extractall(tmp, filter="data")
        port = 18123
        server = subprocess.Popen([f"{tmp}/bin/llama-server", "-m", str(model), "-c", str(CTX), "-np", "1",
                                   "-t", str(threads), "--host", "127.0.0.1", "--port", str(port)],
                                  env={"LD_LIBRARY_PATH": f"{tmp}/lib"}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    time.sleep(1)
            return decode_tok_s(url, "")
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures: dict[str, object] = {}
    path = ensure_artifact(BIG_MODEL, LabPaths.default().root)
    size = path.stat().st_size
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as extra:
        json.dump(big_model_extra_vars(mirror_url(BIG_MODEL.subdir, BIG_MODEL.name)), extra)
    # the controller's cached copy goes, so the source is asked again: bytes from the source are measured
    controller_copy = LabPaths.default().root / "models" / BIG_MODEL_NAME
    subprocess.run(["rm", "-rf", str(controller_copy)], check=True)
    print("==> bare hosts: lab down, lab up", flush=True)
    started = time.monotonic()
    cli("lab", "down", timeout=300)
    cli("lab", "up", "--hosts", "3", timeout=1200)
    publish(path, BIG_MODEL.subdir)
    mirror_log = LabPaths.default().run_dir / "mirror.log"
    log_start = mirror_log.stat().st_size
    fleet = Fleet.from_inventory(INVENTORY)
    tx_before = {name: veth_tx(name) for name in fleet.hosts}
    print("==> deploy.yml with the big model", flush=True)
    deploy_started = time.monotonic()
    run = playbook("deploy.yml", "-e", f"@{extra.name}", timeout=3600)
    deploy_s = time.monotonic() - deploy_started
    if run.rc != 0:
        print(run.output[-6000:])
        return 1
    key = api_key_of(fleet)
    endpoint = Endpoint.of(fleet, api_key=key)
    endpoint.wait_healthy(timeout=900)
    first = stream_completion(endpoint.url, "Hello", n_predict=1, api_key=key, timeout=600)
    figures["bare_hosts_to_first_token_s"] = round(time.monotonic() - started, 1)
    figures["deploy_s"] = round(deploy_s, 1)
    figures["first_answer_ok"] = first.ok
    figures["model_bytes"] = size
    figures["from_source_bytes_by_address"] = source_bytes(mirror_log, log_start, f"models/{BIG_MODEL.name}")
    plan = read_plan(fleet)
    # llama.cpp's model, KV and compute buffers per device against the plan, from the deploy's load (before the
    # loads below restart llama-server)
    rows, problems = buffers_against_plan(plan, parse_load_log(server_log(fleet)))
    figures["buffers_against_plan"] = {"devices": rows, "problems": problems}
    planned = {}
    for device in plan["devices"]:
        host = device.get("host") or fleet.orchestrator.name
        planned[host] = planned.get(host, 0) + int(float(device.get("weights_mib") or 0) * 1048576)
    rates = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(lab\d+): .*?([0-9.]+) MB/s", run.output, re.MULTILINE)}
    hosts = {}
    for host in fleet.hosts.values():
        du = fleet.run_one(f"du -sbc {CACHE} {MODELS} 2>/dev/null | tail -1 | cut -f1", host,
                           what="disk use")
        hosts[host.name] = {"lan_in_bytes": veth_tx(host.name) - tx_before[host.name], "disk_bytes": int(float(du or 0)),
                            "planned_weights_bytes": planned.get(host.name, 0), "seed_mb_s": rates.get(host.name)}
    figures["hosts"] = hosts
    save(args.json, figures)
    seeded_s, seeded_sent = load(fleet, key)
    fleet.run(f"systemctl stop llamafleet-rpc-server; mv {CACHE} {CACHE}.off; mkdir -m 0700 {CACHE}; "
              f"chown llamafleet-rpc: {CACHE}; systemctl start llamafleet-rpc-server", fleet.workers)
    try:
        unseeded_s, unseeded_sent = load(fleet, key)
    finally:
        fleet.run(f"systemctl stop llamafleet-rpc-server; rm -rf {CACHE}; mv {CACHE}.off {CACHE}; "
                  "systemctl start llamafleet-rpc-server", fleet.workers)
    load(fleet, key)
    figures["load"] = {"seeded_s": round(seeded_s, 1), "seeded_sent_bytes": seeded_sent,
                       "unseeded_s": round(unseeded_s, 1), "unseeded_sent_bytes": unseeded_sent}
    save(args.json, figures)
    cluster = decode_tok_s(endpoint.url, key)
    local = local_tok_s(path)
    figures["decode"] = {"cluster_tok_s": round(cluster, 2), "one_host_tok_s": round(local, 2),
                         "ratio": round(cluster / local, 2)}
    save(args.json, figures)
    kills = oom_kills()
    prompt = "Tell me a story. " * max(1, (CTX // args.clients - 24) // 5)
    result = sweep(lambda: stream_completion(endpoint.url, prompt, n_predict=24, api_key=key, timeout=900),
                   args.clients, requests=args.clients)
    peaks = {}
    for name, res in fleet.run(PEAK_RSS_COMMAND, fleet.workers).items():
        peaks[name] = max(int(v) for v in re.findall(r"VmHWM:\s+(\d+) kB", res.stdout)) // 1024
    figures["clients"] = {"clients": args.clients, "aggregate_tok_s": round(result.aggregate_tok_s, 2),
                          "errors": result.errors, "p95_s": result.latency_p95_s,
                          "rpc_server_peak_rss_mib": peaks, "host_limit_mib": DEFAULT_MEMORY_MIB,
                          "oom_kills_during": {h: oom_kills()[h] - kills.get(h, 0) for h in kills}}
    print(json.dumps(figures, indent=2))
    save(args.json, figures)
    print("==> deploying gemma again", flush=True)
    restore = playbook("deploy.yml", timeout=3600)
    return 0 if restore.rc == 0 else 1


def save(path: Path | None, figures: dict) -> None:
    """The figures so far, written after each stage so a later failure keeps them (and printed)."""
    print(json.dumps(figures), flush=True)
    if path:
        path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
