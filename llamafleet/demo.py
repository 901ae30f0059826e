"""``llamafleet demo``: a real lab on this machine, the deploy playbook, a completion through the cluster.

The demo is the product's main job, end to end, with nothing faked: it brings
up real hosts (``lab up``), runs ``playbooks/deploy.yml`` against their
inventory exactly as an operator would against a fleet, then asks the
orchestrator's OpenAI-compatible endpoint for a completion and shows which
host holds which layers (read from llama-server's own load log) and tok/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

from .cluster import Endpoint, read_plan, server_log
from .core.log_parse import layer_ranges, parse_load_log
from .errors import UserError
from .fleet import Fleet, tool

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="lab up, deploy, and a completion from the distributed cluster")
    parser.add_argument("--hosts", type=int, default=3, help="lab hosts (1 orchestrator + N-1 workers; default 3)")
    parser.add_argument("--prompt", default=PROMPT, help="prompt for the completion")
    parser.add_argument("--tokens", type=int, default=48, help="tokens to generate")
    parser.set_defaults(func=run)


def _playbook(inventory: Path, *extra: str) -> None:
    cmd = [tool("ansible-playbook"), "-i", str(inventory),
           str(REPO / "playbooks" / "deploy.yml"), *extra]
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
    print(f"==> {' '.join(cmd[1:])}", flush=True)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
    if proc.returncode != 0:
        raise UserError(f"deploy.yml failed (exit {proc.returncode}); the output above names the host and task")
    print(f"==> deploy finished in {time.monotonic() - started:.0f} s", flush=True)


def _units_text(units: list[int], n_layer: int) -> str:
    """``0-17 (18)``, ``output (1)``, ``10-17+output (9)``: layer indices, the output layer named."""
    if not units:
        return "-"
    layers = [u for u in units if u < n_layer]
    parts = [f"{layers[0]}-{layers[-1]}"] if layers else []
    if len(layers) != len(units):
        parts.append("output")
    return f"{'+'.join(parts)} ({len(units)})"


def placement_lines(plan: dict, log_text: str) -> list[str]:
    """Which host holds which layers: what llama.cpp logged, next to what the plan said."""
    seen = layer_ranges(parse_load_log(log_text))
    n_layer = int(plan.get("n_layer", 0))
    lines = [f"{'device':<8} {'endpoint':<20} {'host':<8} {'planned':<18} {'llama.cpp loaded':<18}"]
    for dev in plan.get("devices", []):
        name = dev.get("name", "?")
        planned = dev.get("layers") or {}
        units = list(range(planned["start"], planned["end"])) if planned.get("count") else []
        lines.append(
            f"{name:<8} {dev.get('endpoint') or 'local':<20} {dev.get('host', ''):<8} "
            f"{_units_text(units, n_layer):<18} {_units_text(seen.get(name, []), n_layer):<18}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from .lab.core import Lab
    from .lab.paths import require_checkout

    require_checkout("llamafleet demo")

    lab = Lab(hosts=args.hosts)
    print(f"==> bringing up a lab of {args.hosts} real hosts (systemd-nspawn, systemd, sshd)", flush=True)
    lab.up()
    _playbook(lab.inventory)

    fleet = Fleet.from_inventory(lab.inventory)
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=300)
    print(f"==> asking {endpoint.url}/completion: {args.prompt!r}", flush=True)
    answer = endpoint.complete(args.prompt, n_predict=args.tokens)
    timings = answer.get("timings", {})
    print()
    print(f"    {args.prompt}{answer.get('content', '')}")
    print()
    print("==> where the layers are (plan vs llama.cpp's own load log):")
    try:
        for line in placement_lines(read_plan(fleet), server_log(fleet)):
            print("    " + line)
    except UserError as exc:
        print(f"    (could not read the placement: {exc})")
    print(
        f"==> prompt {timings.get('prompt_n', '?')} tokens at {timings.get('prompt_per_second', 0):.1f} tok/s, "
        f"generated {timings.get('predicted_n', '?')} tokens at {timings.get('predicted_per_second', 0):.1f} tok/s"
    )
    print(f"==> the cluster keeps serving at {endpoint.url} (OpenAI-compatible: /v1/completions);"
          " `llamafleet lab down` removes it")
    return 0
