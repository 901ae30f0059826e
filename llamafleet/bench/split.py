"""Issue benchmark: the planner's split vs an even split vs llama.cpp's own automatic split (--fit).

Same fleet, model, prompt and binary; only the split flags differ.  The
deployed llama-server is stopped while the variants run (said up front) and
started again at the end, also when a variant fails.
"""

from __future__ import annotations

from typing import Any

from ..cluster import read_plan
from ..errors import UserError
from ..fleet import Fleet
from ..layout import orchestrator_layout
from .runner import Measurement, deployed_argv, remove_flags, replace_flag, run_variant, serving_paused


def device_count(plan: dict[str, Any], where: str) -> int:
    """How many devices the deployed plan splits the model over (llama.cpp's -ts has one value each);
    ``where``: the plan's host and path, for the error."""
    devices = plan.get("devices")
    if not isinstance(devices, list) or not devices:
        raise UserError(f"{where} names no devices: deploy again (playbooks/deploy.yml) to write a plan")
    return len(devices)


def variants(argv: list[str], n_devices: int) -> dict[str, list[str]]:
    """The three argvs: as planned, even (-ts 1,1,..), and llama.cpp's automatic fit (no -ts/-ngl/--fit)."""
    return {
        "plan": list(argv),
        "even": replace_flag(argv, "-ts", ",".join(["1"] * n_devices)),
        "fit": remove_flags(argv, "-ts", "-ngl", "--fit"),
    }


def table(rows: list[Measurement]) -> str:
    base = next(r for r in rows if r.name == "plan")
    lines = [
        "| split | load s | gen tok/s | prompt tok/s | gen vs plan | load vs plan |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.load_s:.2f} | {r.tok_s:.1f} | {r.prompt_tok_s:.1f} | "
            f"{r.tok_s / base.tok_s:.2f} | {r.load_s / base.load_s:.2f} |"
        )
    return "\n".join(lines)


def run(fleet: Fleet, runs: int = 3) -> list[Measurement]:
    """The three variants of the deployed argv, measured with the deployed service paused."""
    layout = orchestrator_layout(fleet)
    devices = device_count(read_plan(fleet, layout), f"{fleet.orchestrator.name}:{layout.plan_path}")
    planned = variants(deployed_argv(fleet, layout), devices)
    rows = []
    with serving_paused(fleet, layout=layout):
        for name, variant in planned.items():
            print(f"==> split '{name}': {' '.join(variant[1:])}", flush=True)
            row = run_variant(fleet, name, variant, runs=runs, layout=layout)
            print(f"    load {row.load_s:.2f} s, {row.tok_s:.1f} tok/s", flush=True)
            rows.append(row)
    return rows
