"""Issue benchmark: zero weight transfer. Load bytes and time, unseeded vs seeded worker caches.

For the real gemma model and a synthetic llama model whose bytes sit mostly in
tensors over llama.cpp's 10 MiB hash threshold, with the orchestrator-worker
links shaped (tbf) to a given rate: workers' caches are emptied (unseeded) or
filled from the workers' own copy of the GGUF (seeded), rpc-servers restarted,
and the first load measured from the workers' interface counters.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from ..core import constants
from ..errors import UserError
from ..fleet import Fleet, Host, tool
from ..layout import HostLayout, host_layout, orchestrator_layout, rpc_endpoints, service_user
from .runner import (
    Measurement,
    deployed_argv,
    replace_flag,
    run_variant,
    serving_paused,
    stop_service,
)

# The weight cache of a worker with the roles' defaults (each worker's own comes from its rpc_server_home).
CACHE_DIR = constants.rpc_cache_dir()


def ansible_module(inventory: Path, hosts: str, module: str, args: dict) -> None:
    cmd = [tool("ansible"), hosts, "-i", str(inventory), "-m", module, "-a", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise UserError(f"ansible {module} on {hosts} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")


def ensure_synthetic(fleet: Fleet, inventory: Path, cache_root: Path) -> str:
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
    dest = f"{fleet.orchestrator.var('model_dir', constants.MODEL_DIR)}/synthetic"
    ansible_module(inventory, constants.GROUP_FLEET, "llamafleet.cluster.model_fetch",
                   {"files": [{"url": url, "sha256": sha}], "dest": dest})
    return f"{dest}/{path.name}"


def empty_cache_command(fleet: Fleet, host: Host) -> str:
    """Stop a worker's rpc-servers and leave it an empty weight cache owned by the service user."""
    layout = host_layout(fleet, host)
    user, _ = service_user(host, "rpc_server")
    cache = shlex.quote(layout.rpc_cache_dir or CACHE_DIR)
    return (f"systemctl stop {shlex.join(layout.rpc_units)} && rm -rf {cache} && "
            f"install -d -m 0700 -o {shlex.quote(user)} -g {shlex.quote(user)} {cache}")


def seed_groups(fleet: Fleet) -> dict[tuple[str, str], list[str]]:
    """Workers grouped by (cache directory, service user): one rpc_cache_seed call per group."""
    groups: dict[tuple[str, str], list[str]] = {}
    for worker in fleet.workers:
        key = (host_layout(fleet, worker).rpc_cache_dir or CACHE_DIR, service_user(worker, "rpc_server")[0])
        groups.setdefault(key, []).append(worker.name)
    return groups


def reset_workers(fleet: Fleet, inventory: Path, model: str | None, hasher: str) -> None:
    """Stop rpc-servers, empty their caches, optionally seed them from ``model``, start them again."""
    failed = fleet.run(lambda h: empty_cache_command(fleet, h), fleet.workers).failed
    if failed:
        raise UserError("; ".join(f"{name}: emptying the weight cache failed: {res.reason}"
                                  for name, res in failed.items()))
    if model:
        for (cache_dir, user), names in seed_groups(fleet).items():
            ansible_module(inventory, ":".join(names), "llamafleet.cluster.rpc_cache_seed",
                           {"model": [model], "cache_dir": cache_dir, "hasher": hasher, "owner": user,
                            "group": user, "prune": False})
    failed = fleet.run(lambda h: f"systemctl start {shlex.join(host_layout(fleet, h).rpc_units)}", fleet.workers).failed
    if failed:
        raise UserError("; ".join(f"{name}: starting rpc-server failed: {res.reason}" for name, res in failed.items()))
    endpoints = " ".join(e for w in fleet.workers for e in rpc_endpoints(w))
    fleet.run_one(f"{constants.RPC_WAIT_HELPER} --timeout 60 {endpoints}", fleet.orchestrator,
                  what="workers did not answer HELLO after restart")


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

    layout = orchestrator_layout(fleet)  # read once: every step below stops and starts its units
    base = deployed_argv(fleet, layout)
    hasher = str(Path(base[0]).parent / "llamafleet-fnv1a64")
    deployed_model = base[base.index("-m") + 1]
    # the seeded case fills each worker's cache from its own copy of the whole model, which only
    # model_worker_copy: whole keeps (the default keeps each worker's share alone): say so before anything stops
    lacking = sorted(name for name, res in fleet.run(f"test -f {shlex.quote(deployed_model)}", fleet.workers).items()
                     if not res.ok)
    if lacking:
        raise UserError(f"{', '.join(lacking)}: no copy of the whole model ({deployed_model}) to seed a cache from; "
                        "`llamafleet bench cache` needs the deploy's model_worker_copy: whole (the default, share, "
                        "keeps each worker's share only; benchmarks/big_model.py measures seeded against unseeded "
                        "loads with the shares)")
    models = {"gemma-3-270m": (deployed_model, base)}
    synth = ensure_synthetic(fleet, inventory, cache_root)
    models["synthetic-llama"] = (synth, replace_flag(replace_flag(base, "-m", synth), "-ts", "1,1"))
    sizes = {}
    for name, (path, _) in models.items():
        sizes[name] = int(fleet.run_one(f"stat -c %s {shlex.quote(path)}", fleet.orchestrator).strip())
    rows: list[Measurement] = []
    with serving_paused(fleet, layout=layout):
        try:
            for worker in fleet.workers:
                shape(worker.name, rate)
            for name, (path, argv) in models.items():
                rows += measure_model(fleet, inventory, name, path, argv, sizes[name], rate, hasher, layout)
        finally:
            for worker in fleet.workers:
                shape(worker.name, None)
            stop_service(fleet, layout)
            reset_workers(fleet, inventory, deployed_model, hasher)
    return rows


def measure_model(fleet: Fleet, inventory: Path, name: str, path: str, argv: list[str], size: int, rate: str,
                  hasher: str, layout: HostLayout) -> list[Measurement]:
    """First load of one model with unseeded, then seeded worker caches; whether both answered the same."""
    rows = []
    for cache in ("unseeded", "seeded"):
        print(f"==> {name}, {cache} caches, links at {rate}", flush=True)
        stop_service(fleet, layout)
        reset_workers(fleet, inventory, path if cache == "seeded" else None, hasher)
        row = run_variant(fleet, f"{name}/{cache}", argv, runs=1, n_predict=32, layout=layout)
        row.extra = {"model": name, "cache": cache, "model_bytes": size}
        print(f"    load {row.load_s:.2f} s, {row.bytes_to_workers / 1e6:.1f} MB sent", flush=True)
        rows.append(row)
    same = rows[0].content == rows[1].content
    for row in rows:
        row.extra["same_output"] = "identical" if same else "DIFFERENT"
    return rows
