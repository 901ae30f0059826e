#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Print the split plan for an example mixed fleet (figures for the notes).

The fleet: an orchestrator with an RTX 4090 (24 GiB), workers with an RTX 3060
(12 GiB), two RTX 3070 behind one rpc-server (8 GiB each), an M2 Pro Mac (32 GiB
unified, Metal) and a CPU-only box capped at 16 GiB. The default model is a
Llama-3-70B-shaped Q4_K_M (80 layers, 8 KV heads of 128; tensor sizes
approximated from its quantisation, not read from a file); ``--model`` plans a
real GGUF instead, with the facts the GGUF reader gives.

    python -m benchmarks.plan_demo [--model FILE.gguf] [--ctx 8192] [--parallel 2] [--cache-type q8_0]
                                   [--policy balanced|even|fewest_hops|fit] [--rtt-ms 2.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from llamafleet.core import gguf_facts, llama_flags, split_plan

MIB = 1024 * 1024
HELP_FIXTURE = os.path.join(ROOT, "tests", "unit", "fixtures", "llamacpp", "llama-server_0c1e570_help_real.txt")


def llama70b_q4km() -> dict:
    """Approximate facts of a Llama-3-70B Q4_K_M: ~530 MiB per layer, 128256-token vocabulary."""
    n_layer = 80
    return {
        "arch": "llama", "n_layer": n_layer, "n_embd": 8192, "n_head": 64, "n_head_kv": 8,
        "n_embd_k_gqa": [1024] * n_layer, "n_embd_v_gqa": [1024] * n_layer, "n_ctx_train": 131072,
        "layer_bytes": [530 * MIB] * n_layer,
        "output_bytes": 822 * MIB,          # output.weight (Q6_K) + output_norm
        "token_embd_bytes": 564 * MIB,      # Q4_K, stays in the orchestrator's RAM
        "other_bytes": 0,
        "kv_bytes_per_token_f16": n_layer * 2048 * 2,
        "sliding_window": None,
    }


def gpu(backend: str, index: int, name: str, total: int, free: int, bandwidth: float, reserve: int = 0) -> dict:
    """A device dict; ``bandwidth`` is the vendor's memory bandwidth, GB/s (the planner's per-token estimate)."""
    return {"backend": backend, "index": index, "name": name, "total_mib": total, "free_mib": free,
            "integrated": False, "reserve_mib": reserve, "bandwidth_gbs": bandwidth}


FLEET = {
    "workers": [
        {"host": "ws2", "address": "192.168.1.12", "port": 50052,
         "devices": [gpu("cuda", 0, "NVIDIA GeForce RTX 3060", 12288, 11874, 360)]},
        {"host": "ws3", "address": "192.168.1.13", "port": 50052,
         "devices": [gpu("cuda", 0, "NVIDIA GeForce RTX 3070", 8192, 7800, 448),
                     gpu("cuda", 1, "NVIDIA GeForce RTX 3070", 8192, 7950, 448)]},
        {"host": "mac1", "address": "192.168.1.14", "port": 50052,
         "devices": [gpu("metal", 0, "Apple M2 Pro", 21845, 21845, 200, reserve=2048)]},
        {"host": "nas1", "address": "192.168.1.15", "port": 50052,
         "devices": [{"backend": "cpu", "index": 0, "name": "Intel Xeon E-2236", "total_mib": 32000,
                      "free_mib": 29500, "reserve_mib": 1024, "max_mib": 16384, "bandwidth_gbs": 41.6}]},
    ],
    "orchestrator": {"host": "ws1",
                     "devices": [gpu("cuda", 0, "NVIDIA GeForce RTX 4090", 24564, 24108, 1008, reserve=512)]},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="plan this GGUF instead of the 70B-shaped example")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--cache-type", default="f16")
    parser.add_argument("--policy", default=split_plan.DEFAULT_POLICY, choices=split_plan.POLICIES)
    parser.add_argument("--rtt-ms", type=float, help="measured round trip to every worker (lets balanced weigh hops)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args()

    facts = gguf_facts.model_facts(args.model) if args.model else llama70b_q4km()
    try:
        plan = split_plan.plan_split(FLEET["workers"], FLEET["orchestrator"], facts, ctx_size=args.ctx,
                                     n_parallel=args.parallel, cache_type_k=args.cache_type, policy=args.policy,
                                     link_rtt_ms=args.rtt_ms)
    except split_plan.PlanError as exc:
        print("no plan: %s" % exc, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan, indent=1))
        return 0

    header = "%-6s %-20s %-6s %-26s %-14s %5s %9s %8s %8s %9s %8s %6s" % (
        "device", "endpoint", "host", "description", "units", "count", "weights", "KV", "compute", "total",
        "usable", "fill")
    print(header)
    print("-" * len(header))
    for dev in plan["devices"]:
        if dev["layers"] is None:  # policy fit: llama.cpp decides at load time
            print("%-6s %-20s %-6s %-26s %-14s %5s %9s %8s %8s %9s %8d %6s" % (
                dev["name"], dev["endpoint"] or "local", dev["host"], dev["description"][:26], "(llama.cpp)",
                "-", "-", "-", "-", "-", dev["usable_mib"], "-"))
            continue
        print("%-6s %-20s %-6s %-26s %-14s %5d %9.0f %8.0f %8.0f %9.0f %8d %5.1f%%" % (
            dev["name"], dev["endpoint"] or "local", dev["host"], dev["description"][:26], dev["layers"]["range"],
            dev["layers"]["count"], dev["weights_mib"], dev["kv_mib"], dev["compute_mib"], dev["total_mib"],
            dev["usable_mib"], dev["fill_pct"]))
    totals = plan["totals"]
    print("-" * len(header))
    print("total: weights %.0f MiB, KV %.0f MiB, compute %.0f MiB = %.0f MiB of %d MiB usable; %.0f MiB stays in "
          "%s's RAM" % (totals["weights_mib"], totals["kv_mib"], totals["compute_mib"], totals["total_mib"],
                        totals["usable_mib"], plan["host_mib"], plan["orchestrator"]))
    print()
    for line in plan["explanation"]:
        if not line.startswith(tuple(dev["name"] + " " for dev in plan["devices"])):
            print(line)
    for warning in plan["warnings"]:
        print("warning:", warning)
    with open(HELP_FIXTURE, encoding="utf-8") as handle:
        features = llama_flags.server_features(handle.read())
    argv = llama_flags.render_llama_server_argv("/opt/llamafleet/llama.cpp/bin/llama-server", plan, features,
                                                args.model or "/var/lib/llamafleet/models/llama-3-70b-q4_k_m.gguf",
                                                host="0.0.0.0", metrics=True)
    print()
    print("llama-server (flags of llama.cpp 0c1e570):")
    print("  " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
