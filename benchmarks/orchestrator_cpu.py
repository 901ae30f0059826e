#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The orchestrator's own memory on a CPU fleet: layers left on llama-server's CPU, or a local rpc-server?

Two deploys of the 3-host lab, one after the other, each measured the same way:

- ``local-rpc`` first: the orchestrator is also in ``llamafleet_workers`` and runs an rpc-server of its own, and
  ``llama_server_cpu_layers: 0``: its share (the planner's) goes through that rpc-server over TCP on the same host;
- ``cpu-layers``: llama-server keeps the same number of layers on its own CPU (``llama_server_cpu_layers: N``, N the
  layers the first plan gave the local rpc-server), beside the two workers. (The roles' default, ``auto``, leaves a
  small model none where the workers hold it all.)

For each: the plan (the units on each device), a restart's load (seconds until ``/health`` answers 200), decode tok/s
(the best of three streamed 64-token completions through the gate) and time to the first token (their median), and
the peak RSS of llama-server and of the orchestrator's rpc-server. The local rpc-server is stopped before the second
deploy (deploy.yml takes llamafleet off hosts that left the fleet, not off one that only left the workers). Then
``lab down``, so the next lab job starts from bare hosts.

    python -m benchmarks.orchestrator_cpu [--json FILE] [--big]

``--big`` uses the synthetic 6.41 GiB model (``llamafleet.lab.artifacts.BIG_MODEL``) on hosts of 4 GiB each instead
of gemma. Needs root and the lab.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.big_model import load
from llamafleet.bench.measure import stream_completion
from llamafleet.cluster import Endpoint, api_key_of, read_plan
from llamafleet.core import constants
from llamafleet.fleet import Fleet
from llamafleet.lab.artifacts import big_model_on_mirror
from tests.helpers import INVENTORY, cli, inventory_variant, playbook

RUNS = 3
N_PREDICT = 64
PROMPT = "Once upon a time"


def inventory_with_local_worker(folder: Path) -> Path:
    """The lab inventory with the orchestrator (its first host) in llamafleet_workers too."""
    lines = INVENTORY.read_text().splitlines()
    orchestrator = lines[lines.index("[" + constants.GROUP_ORCHESTRATOR + "]") + 1]
    at = lines.index("[" + constants.GROUP_WORKERS + "]") + 1
    lines.insert(at, orchestrator)
    return inventory_variant(folder, lines)


def peak_rss_mib(fleet: Fleet, unit: str) -> int | None:
    out = fleet.run(f"grep VmHWM /proc/$(systemctl show -p MainPID --value {unit})/status 2>/dev/null",
                    [fleet.orchestrator])[fleet.orchestrator.name].stdout
    found = re.search(r"VmHWM:\s+(\d+) kB", out)
    return int(found.group(1)) // 1024 if found else None


def measure(fleet: Fleet) -> dict:
    key = api_key_of(fleet)
    endpoint = Endpoint.of(fleet, api_key=key)
    endpoint.wait_healthy(timeout=900)
    load_s, _sent = load(fleet, key)
    stream_completion(endpoint.url, PROMPT, n_predict=8, api_key=key, timeout=600)  # warm the prompt cache alike
    results = [stream_completion(endpoint.url, PROMPT, n_predict=N_PREDICT, api_key=key, timeout=600)
               for _ in range(RUNS)]
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"completions failed: {failed}")
    plan = read_plan(fleet)
    return {
        "devices": [{"name": d["name"], "host": d.get("host"), "units": d["layers"]["count"],
                     "weights_mib": d.get("weights_mib")} for d in plan["devices"]],
        "cpu_layers": plan.get("cpu_layers", 0),
        "load_s": round(load_s, 1),
        "decode_tok_s": round(max(r.tok_s for r in results if r.tok_s), 2),
        "ttft_s": round(statistics.median(r.ttft_s for r in results), 3),
        "llama_server_peak_rss_mib": peak_rss_mib(fleet, constants.LLAMA_SERVER_UNIT),
        "local_rpc_server_peak_rss_mib": peak_rss_mib(fleet, constants.RPC_SERVER_UNIT),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--big", action="store_true", help="the synthetic 6.41 GiB model instead of gemma")
    args = parser.parse_args()
    cli("lab", "up", "--hosts", "3", timeout=1200)
    fleet = Fleet.from_inventory(INVENTORY)
    figures: dict[str, object] = {"model": "big" if args.big else "gemma"}
    try:
        with tempfile.TemporaryDirectory(prefix="llamafleet-orchestrator-cpu-") as tmp:
            extra = ["-e", f"@{big_model_on_mirror(Path(tmp))}"] if args.big else []
            local_layers = 0
            for name in ("local-rpc", "cpu-layers"):
                if name == "local-rpc":
                    inventory = inventory_with_local_worker(Path(tmp))
                    variables = ["-e", "llama_server_cpu_layers=0"]
                else:
                    inventory, variables = INVENTORY, ["-e", f"llama_server_cpu_layers={local_layers}"]
                    # A host that leaves llamafleet_workers but stays the orchestrator keeps its rpc-server
                    # (deploy.yml takes away only hosts that left the fleet), whose memory the planner then finds
                    # taken: stopped here.
                    stopped = fleet.run(f"systemctl disable --now {constants.RPC_SERVER_UNIT}",
                                        [fleet.orchestrator]).failed
                    if stopped:
                        sys.exit(f"cannot stop the local rpc-server: {stopped}")
                print(f"==> {name}: deploy.yml", flush=True)
                started = time.monotonic()
                run = playbook("deploy.yml", *extra, *variables, inventory=inventory, timeout=3600)
                if run.rc != 0:
                    print(run.output[-6000:])
                    return 1
                figures[name] = {"deploy_s": round(time.monotonic() - started, 1), **measure(fleet)}
                local_layers = local_layers or sum(d["units"] for d in figures[name]["devices"]
                                                   if d["host"] == fleet.orchestrator.name)
                print(json.dumps({name: figures[name]}), flush=True)
    finally:
        print("==> lab down (lab1 keeps the local rpc-server's units of the first deploy)", flush=True)
        cli("lab", "down", timeout=300)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
