#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What batching can give on this machine at all: one llama-server, no RPC, 1 client against N.

The lab's hosts share this machine's cores, so the 16-client figure of the distributed cluster
(benchmarks.serving_load, bench.yml's sweep) cannot beat what a single llama-server on the same
cores gets from batching the same load. This runs the deploy's own build (the controller's artifact
cache) and model with every core and N slots on a unified KV cache, then streams 64-token completions
from 1 client and from N clients for a fixed time each, and prints tok/s, the ratio, p95 and errors.

    python -m benchmarks.serving_ceiling [--clients 16] [--seconds 60] [--threads 2] [--json FILE]

Needs a CPU build in $LLAMAFLEET_CACHE/artifacts and the model in $LLAMAFLEET_CACHE/models (make e2e-test
or make demo leaves both).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from llamafleet.bench.measure import DEFAULT_PROMPT, stream_completion, sweep
from llamafleet.lab.artifacts import LLAMA_CPP_COMMIT, MODEL
from llamafleet.lab.paths import cache_root

N_PREDICT = 64


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}) before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:  # noqa: S310 - local
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("llama-server was not healthy within %.0f s" % timeout)


def measure_ceiling(clients: int, seconds: float, threads: int, model: Path | None = None, ctx: int | None = None,
                    cache_type: str | None = None, timeout: float = 120.0, prompt: str = DEFAULT_PROMPT) -> dict:
    """One llama-server with the lab's own build and ``model`` (the lab's gemma by default), ``clients`` slots on a
    unified cache of ``ctx`` tokens (512 a slot by default) with ``cache_type`` K and V (llama.cpp's default f16), no
    RPC: 1 client and ``clients`` clients for ``seconds`` each, each request bounded by ``timeout``. Returns
    ``{"threads", "ctx", "model", "ratio", "steps": {1: ..., clients: ...}}``."""
    cache = cache_root()
    # the lab's own release and model, as the cluster it is compared with runs them (not whatever was built last)
    artifacts = sorted((cache / "artifacts").glob(f"{LLAMA_CPP_COMMIT[:12]}-cpu-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    model = model or MODEL.path(cache)
    if not artifacts or not model.is_file():
        raise SystemExit(f"no CPU build of {LLAMA_CPP_COMMIT[:12]} in {cache}/artifacts or no {model}: run make "
                         "e2e-test first")
    ctx = ctx or 512 * clients
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(artifacts[-1]) as tar:
            tar.extractall(tmp, filter="data")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [f"{tmp}/bin/llama-server", "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(clients), "-c", str(ctx), "--kv-unified", "-t", str(threads)]
        if cache_type:
            argv += ["-ctk", cache_type, "-ctv", cache_type]
        print(f"==> {' '.join(argv[1:])} ({artifacts[-1].name})", flush=True)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(url, proc, timeout=max(120.0, timeout))
            stream_completion(url, prompt, n_predict=8, timeout=timeout)  # warm up
            steps = {n: sweep(lambda: stream_completion(url, prompt, n_predict=N_PREDICT, timeout=timeout), n,
                              duration_s=seconds) for n in (1, clients)}
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    one, many = steps[1], steps[clients]
    ratio = many.aggregate_tok_s / one.aggregate_tok_s if one.aggregate_tok_s else 0.0
    return {"threads": threads, "ctx": ctx, "model": model.name, "ratio": ratio,
            "steps": {n: asdict(s) for n, s in steps.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure_ceiling(args.clients, args.seconds, args.threads)
    print(f"{'clients':>7} {'tok/s':>8} {'p95 s':>7} {'errors':>6}")
    for n, step in result["steps"].items():
        p95 = f"{step['latency_p95_s']:.1f}" if step["latency_p95_s"] is not None else "-"
        print(f"{n:>7} {step['aggregate_tok_s']:>8.1f} {p95:>7} {step['errors']:>6}")
    print(f"{args.clients} clients / 1 client: {result['ratio']:.2f}x (one llama-server, {args.threads} threads, "
          "no RPC)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
