"""Issue benchmark: zero weight transfer. Load bytes and time, unseeded vs seeded worker caches.

For the real gemma model and a synthetic llama model whose bytes sit mostly in
tensors over llama.cpp's 10 MiB hash threshold, with the orchestrator-worker
links shaped (tbf) to a given rate: workers' caches are emptied (unseeded) or
filled from the workers' own copy of the GGUF (seeded), rpc-servers restarted,
and the first load measured from the workers' interface counters.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..cluster import RPC_UNIT
from ..errors import UserError
from ..fleet import Fleet
from .runner import Measurement, deployed_argv, replace_flag, restore_service, run_variant, stop_service

CACHE_DIR = "/var/lib/llamafleet-rpc/cache/rpc"
MODEL_ROOT = "/var/lib/llamafleet/models"
REPO = Path(__file__).resolve().parents[2]


def ansible_module(inventory: Path, hosts: str, module: str, args: dict) -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "ansible")
    cmd = [exe, hosts, "-i", str(inventory), "-m", module, "-a", json.dumps(args)]
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise UserError(f"ansible {module} on {hosts} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")


def ensure_synthetic(inventory: Path, cache_root: Path) -> str:
    """Generate the synthetic model once, publish it on the lab mirror, fetch it on every host."""
    from ..core.fetch import sha256_file
    from ..lab.mirror import publish
    from .synth import main as synth_main

    path = cache_root / "models" / "synthetic-llama-f16.gguf"
    if not path.exists():
        print(f"==> generating {path}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        synth_main([str(path)])
    url = publish(path, "models")
    sha = sha256_file(str(path)).hexdigest()
    ansible_module(inventory, "llamafleet", "llamafleet.cluster.model_fetch",
                   {"files": [{"url": url, "sha256": sha}], "dest": f"{MODEL_ROOT}/synthetic"})
    return f"{MODEL_ROOT}/synthetic/{path.name}"


def reset_workers(fleet: Fleet, inventory: Path, model: str | None, hasher: str) -> None:
    """Stop rpc-servers, empty their caches, optionally seed them from ``model``, start them again."""
    fleet.run(f"systemctl stop {RPC_UNIT} && rm -rf {CACHE_DIR} && install -d -m 0700 -o llamafleet-rpc "
              f"-g llamafleet-rpc {CACHE_DIR}", fleet.workers)
    if model:
        ansible_module(inventory, "llamafleet_workers", "llamafleet.cluster.rpc_cache_seed",
                       {"model": [model], "cache_dir": CACHE_DIR, "hasher": hasher, "owner": "llamafleet-rpc",
                        "group": "llamafleet-rpc", "prune": False})
    fleet.run(f"systemctl start {RPC_UNIT}", fleet.workers)
    endpoints = " ".join(f"{w.cluster_address}:{int(w.vars.get('rpc_server_port', 50052))}" for w in fleet.workers)
    res = fleet.run(f"/usr/local/libexec/llamafleet-rpc-wait --timeout 60 {endpoints}", [fleet.orchestrator])
    if not res[fleet.orchestrator.name].ok:
        raise UserError(f"workers did not answer HELLO after restart: {res[fleet.orchestrator.name].stderr}")


def table(rows: list[Measurement]) -> str:
    lines = [
        "| model | cache | load s | sent to workers MB | share of model bytes | greedy output |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.extra['model']} | {r.extra['cache']} | {r.load_s:.2f} | {r.bytes_to_workers / 1e6:.1f} | "
            f"{100 * r.bytes_to_workers / r.extra['model_bytes']:.1f}% | {r.extra.get('same_output', '')} |"
        )
    return "\n".join(lines)


def run(fleet: Fleet, inventory: Path, cache_root: Path, rate: str = "240mbit") -> list[Measurement]:
    from ..lab.core import shape

    base = deployed_argv(fleet)
    hasher = str(Path(base[0]).parent / "llamafleet-fnv1a64")
    deployed_model = base[base.index("-m") + 1]
    models = {"gemma-3-270m": (deployed_model, base)}
    synth = ensure_synthetic(inventory, cache_root)
    models["synthetic-llama"] = (synth, replace_flag(replace_flag(base, "-m", synth), "-ts", "1,1"))
    sizes = {}
    for name, (path, _) in models.items():
        res = fleet.run(f"stat -c %s {shlex.quote(path)}", [fleet.orchestrator])[fleet.orchestrator.name]
        sizes[name] = int(res.stdout.strip())
    rows: list[Measurement] = []
    try:
        for worker in fleet.workers:
            shape(worker.name, rate)
        for name, (path, argv) in models.items():
            outputs = {}
            for cache in ("unseeded", "seeded"):
                print(f"==> {name}, {cache} caches, links at {rate}", flush=True)
                stop_service(fleet)
                reset_workers(fleet, inventory, path if cache == "seeded" else None, hasher)
                row = run_variant(fleet, f"{name}/{cache}", argv, runs=1, n_predict=32)
                row.extra = {"model": name, "cache": cache, "model_bytes": sizes[name]}
                outputs[cache] = row.content
                print(f"    load {row.load_s:.2f} s, {row.bytes_to_workers / 1e6:.1f} MB sent", flush=True)
                rows.append(row)
            same = outputs["seeded"] == outputs["unseeded"]
            for row in rows[-2:]:
                row.extra["same_output"] = "identical" if same else "DIFFERENT"
    finally:
        for worker in fleet.workers:
            shape(worker.name, None)
        stop_service(fleet)
        reset_workers(fleet, inventory, deployed_model, hasher)
        restore_service(fleet)
    return rows
