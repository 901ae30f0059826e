#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Many clients on the deployed lab: one slot (`-np 1`) against the slots the planner sizes.

For each slot setting it re-deploys the orchestrator (deploy.yml with `-e llama_server_parallel=N`,
0 = the planner's automatic choice), then runs streamed completions through the gate from 1 client
and from N clients for a fixed time each, and prints aggregate tok/s, its ratio to one client, p50/p95
latency and errors. The deployed default is restored at the end. `--soak` runs one long step instead
(the 4-worker soak: `--hosts 5 --soak 600`).

    python -m benchmarks.serving_load [--hosts 3] [--clients 16] [--seconds 60] [--slots 1,0] [--json FILE]
    python -m benchmarks.serving_load --role-defaults --variant base --variant "threads=rpc_server_threads=2" --ceiling

`--role-defaults` deploys with the roles' own defaults for the context, slots, log level and rpc-server threads (the
lab's inventory sets a smaller context, -lv 5 and one thread per worker for its tests); each `--variant LABEL[=VAR=VALUE ...]` is one deploy with
those extra variables; `--ceiling` also measures benchmarks.serving_ceiling in the same run and prints each
variant's 16/1 ratio against the ceiling's (issue 24's goal: at least 0.9).
    python -m benchmarks.serving_load --hosts 5 --soak 600 --clients 16 --json soak.json
    python -m benchmarks.serving_load --big --role-defaults --variant base --ceiling

`--big` serves the synthetic 6.41 GiB model (``llamafleet.lab.artifacts.BIG_MODEL``, its Q8_0 KV cache) over the
lab's hosts of 4 GiB each, instead of gemma, and its ceiling is that model in one llama-server with no limit, at the
cluster's context and KV type; each request may take up to 15 minutes.

Needs root and the lab (`llamafleet lab up --hosts N` is run if it is not up). Targets: with the planned
slots, 16 clients give at least 2x the single client's tok/s with 0 errors; the soak ends with 0 errors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from llamafleet.bench.measure import DEFAULT_PROMPT, stream_completion, sweep
from llamafleet.cluster import Endpoint, read_plan
from llamafleet.fleet import Fleet
from llamafleet.lab.artifacts import big_model_on_mirror
from llamafleet.lab.paths import cache_root

BIN = Path(sys.executable).parent
INVENTORY = ROOT / "inventories" / "lab" / "hosts.ini"
N_PREDICT = 64


def run(*argv: str, timeout: float = 3600) -> None:
    started = time.monotonic()
    # the lab's cache root (as make exports it), so deploy.yml finds the controller's cached llama.cpp build
    env = dict(os.environ, LLAMAFLEET_CACHE=str(cache_root()))
    done = subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
    print(f"    ({' '.join(Path(a).name if a.startswith('/') else a for a in argv[:3])} ... "
          f"{time.monotonic() - started:.0f} s)", flush=True)


def deploy(*extra: str) -> None:
    run(str(BIN / "ansible-playbook"), "-i", str(INVENTORY), str(ROOT / "playbooks" / "deploy.yml"), *extra)


# The big model's tokenizer (random, llamafleet.bench.synth) makes 457 tokens of measure's default prompt: 16 of
# those and their answers would not fit the 2,048-token cache it fits the lab with. One sentence of it: 57 tokens.
BIG_PROMPT = DEFAULT_PROMPT.split(".")[0] + "."


def step(endpoint: Endpoint, clients: int, seconds: float, timeout: float = 120.0,
         prompt: str = DEFAULT_PROMPT) -> dict:
    result = sweep(lambda: stream_completion(endpoint.url, prompt, n_predict=N_PREDICT, api_key=endpoint.api_key,
                                             timeout=timeout), clients, duration_s=seconds)
    return asdict(result)


def role_defaults() -> list[str]:
    """``-e`` arguments that put back the llama_server role's defaults the lab inventory overrides."""
    import yaml

    extra = []
    for role, names in (("llama_server", ("llama_server_ctx_size", "llama_server_parallel",
                                          "llama_server_log_verbosity")),
                        ("rpc_server", ("rpc_server_threads",))):
        defaults = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text())
        for name in names:
            extra += ["-e", f"{name}={defaults[name]}"]
    return extra


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``LABEL[=VAR=VALUE ...]`` -> the label and its ``-e`` arguments."""
    label, dummy, rest = text.partition("=")
    extra = []
    for pair in rest.split():
        if "=" not in pair:
            raise SystemExit(f"--variant {text!r}: {pair!r} is not VAR=VALUE")
        extra += ["-e", pair]
    return label, extra


def row_text(label: str, one: dict, many: dict) -> str:
    ratio = many["aggregate_tok_s"] / one["aggregate_tok_s"] if one["aggregate_tok_s"] else float("nan")

    def fig(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"  # none: no request of the step answered

    return (f"| {label} | {one['aggregate_tok_s']:.2f} | {many['clients']} | {many['aggregate_tok_s']:.2f} | "
            f"{ratio:.2f}x | {fig(many['latency_p50_s'])} | {fig(many['latency_p95_s'])} | {fig(many['ttft_p95_s'])} | "
            f"{many['requests']} | {many['errors']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slots", default="1,0", help="llama_server_parallel values to compare (0 = planned)")
    parser.add_argument("--soak", type=float, help="one step of this many seconds with the planned slots instead")
    parser.add_argument("--role-defaults", action="store_true",
                        help="deploy with the llama_server role's defaults for context, slots and log level")
    parser.add_argument("--variant", action="append", default=[],
                        help="LABEL[=VAR=VALUE ...]: one deploy with these variables (instead of --slots)")
    parser.add_argument("--ceiling", action="store_true", help="also measure benchmarks.serving_ceiling")
    parser.add_argument("--big", action="store_true", help="the synthetic 6.41 GiB model instead of gemma")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    run(str(BIN / "llamafleet"), "lab", "up", "--hosts", str(args.hosts), timeout=1800)
    fleet = Fleet.from_inventory(INVENTORY)
    results: dict = {"hosts": args.hosts, "clients": args.clients, "n_predict": N_PREDICT, "runs": []}
    lines = ["| slots | 1 client tok/s | clients | aggregate tok/s | x 1 client | p50 s | p95 s | TTFT p95 s "
             "| requests | errors |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    timeout = 900.0 if args.big else 120.0
    prompt = BIG_PROMPT if args.big else DEFAULT_PROMPT
    folder = Path(tempfile.mkdtemp(prefix="llamafleet-serving-load-"))
    # the big model's variables first: --role-defaults' context and the variants' settings come after, and win
    model = ["-e", f"@{big_model_on_mirror(folder)}"] if args.big else []
    plan: dict = {}
    try:
        base = model + (role_defaults() if args.role_defaults else [])
        if args.variant:
            variants = [parse_variant(text) for text in args.variant]
        else:
            settings = [0] if args.soak else [int(s) for s in args.slots.split(",")]
            variants = [(None, ["-e", f"llama_server_parallel={slots}"]) for slots in settings]
        for name, extra in variants:
            print(f"==> deploying with {' '.join(base + extra) or 'the inventory as it is'}", flush=True)
            deploy(*base, *extra)
            endpoint = Endpoint.of(fleet)
            endpoint.wait_healthy(timeout=300)
            plan = read_plan(fleet)
            slots = 0 if plan["n_parallel_auto"] else plan["n_parallel"]
            label = f"{plan['n_parallel']} ({'planned' if slots == 0 else 'fixed'})"
            if name:
                label = f"{name}: {label}"
            print(f"==> {label} slots, {len(plan['rpc'])} workers: 1 client for {args.seconds:.0f} s", flush=True)
            one = step(endpoint, 1, args.seconds, timeout, prompt)
            seconds = args.soak or args.seconds
            print(f"==> {args.clients} clients for {seconds:.0f} s", flush=True)
            many = step(endpoint, args.clients, seconds, timeout, prompt)
            results["runs"].append({"label": label, "deploy_vars": base + extra, "slots": plan["n_parallel"],
                                    "ctx": plan["ctx_size"], "cache_type": plan["cache_type_k"],
                                    "planned": slots == 0, "workers": len(plan["rpc"]), "one": one, "many": many})
            lines.append(row_text(label, one, many))
            print(lines[-1], flush=True)
    finally:
        print("==> restoring the deployed default", flush=True)
        deploy()
        shutil.rmtree(folder, ignore_errors=True)
    if args.ceiling:
        from benchmarks.serving_ceiling import measure_ceiling

        big = None
        if args.big:
            from llamafleet.lab import LabPaths
            from llamafleet.lab.artifacts import BIG_MODEL

            big = BIG_MODEL.path(LabPaths.default().root)
        # the last variant's context and KV type, so the one server batches on the same cache as the cluster did
        ceiling = measure_ceiling(args.clients, args.seconds, os.cpu_count() or 1, model=big,
                                  ctx=plan.get("ctx_size") if args.big else None,
                                  cache_type=plan.get("cache_type_k") if args.big else None, timeout=timeout,
                                  prompt=prompt)
        results["ceiling"] = ceiling
        lines.append("")
        one_c, many_c = ceiling["steps"][1], ceiling["steps"][args.clients]
        lines.append(f"ceiling ({ceiling['model']}, one llama-server, no RPC, {ceiling['threads']} threads, "
                     f"-c {ceiling['ctx']}): 1 client {one_c['aggregate_tok_s']:.2f} tok/s, {args.clients} clients "
                     f"{many_c['aggregate_tok_s']:.2f} tok/s ({many_c['errors']} errors): {ceiling['ratio']:.2f}x")
        for run_ in results["runs"]:
            one_tok, many_tok = run_["one"]["aggregate_tok_s"], run_["many"]["aggregate_tok_s"]
            ratio = many_tok / one_tok if one_tok else 0.0
            run_["against_ceiling"] = ratio / ceiling["ratio"] if ceiling["ratio"] else 0.0
            lines.append(f"{run_['label']}: {ratio:.2f}x, {run_['against_ceiling']:.2f} of the ceiling's "
                         f"(goal 0.9)")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["many"]["errors"] == 0 for r in results["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
