"""Run llama-server variants on a deployed fleet and measure them for real.

A variant is an argv for the orchestrator's llama-server.  It runs as a
transient systemd unit (``systemd-run``) under the service user while the
deployed unit is stopped, so the measurement sees the same binary, user and
workers as production; the deployed unit is started again afterwards.
"""

from __future__ import annotations

import json
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cluster import LLAMA_UNIT, Endpoint
from ..errors import UserError
from ..fleet import Fleet

BENCH_UNIT = "llamafleet-bench.service"
PROMPT = "The capital of France is"


@dataclass
class Measurement:
    name: str
    load_s: float
    tok_s: float
    prompt_tok_s: float
    bytes_to_workers: int = 0
    content: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def deployed_argv(fleet: Fleet) -> list[str]:
    """The ExecStart argv of the deployed llama-server, read back from systemd."""
    orch = fleet.orchestrator
    res = fleet.run(f"systemctl show -p ExecStart --value {LLAMA_UNIT}", [orch])[orch.name]
    if not res.ok or "argv[]=" not in res.stdout:
        raise UserError(f"{orch.name}: cannot read {LLAMA_UNIT}'s command line (deployed?): {res.stderr or res.error}")
    text = res.stdout.split("argv[]=", 1)[1].split(" ;", 1)[0]
    return shlex.split(text)


def replace_flag(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with the value-taking ``flag VALUE`` replaced; ``value`` None removes it."""
    out: list[str] = []
    found = False
    i = 0
    while i < len(argv):
        if argv[i] == flag:
            found = True
            i += 2
            if value is not None:
                out += [flag, value]
            continue
        out.append(argv[i])
        i += 1
    if not found and value is not None:
        out += [flag, value]
    return out


def remove_flags(argv: list[str], *flags: str) -> list[str]:
    for flag in flags:
        argv = replace_flag(argv, flag, None)
    return argv


def worker_tx_bytes(fleet: Fleet) -> int:
    """Bytes the orchestrator side sent towards the workers, from the workers' own interface counters."""
    total = 0
    for name, res in fleet.run("cat /sys/class/net/host0/statistics/rx_bytes", fleet.workers).items():
        if not res.ok:
            raise UserError(f"{name}: cannot read interface counters: {res.error or res.stderr}")
        total += int(res.stdout.strip())
    return total


def stop_service(fleet: Fleet) -> None:
    orch = fleet.orchestrator
    fleet.run(f"systemctl stop {LLAMA_UNIT} {BENCH_UNIT}; systemctl reset-failed {BENCH_UNIT}", [orch])


def restore_service(fleet: Fleet) -> None:
    orch = fleet.orchestrator
    fleet.run(f"systemctl stop {BENCH_UNIT}; systemctl reset-failed {BENCH_UNIT}; systemctl start {LLAMA_UNIT}", [orch])
    Endpoint.of(fleet).wait_healthy(timeout=600)


def run_variant(fleet: Fleet, name: str, argv: list[str], runs: int = 3, n_predict: int = 64,
                load_timeout: float = 900) -> Measurement:
    """Start ``argv`` on the orchestrator, time the load, then ``runs`` greedy completions."""
    orch = fleet.orchestrator
    endpoint = Endpoint.of(fleet)
    stop_service(fleet)
    before = worker_tx_bytes(fleet)
    cmd = ["systemd-run", f"--unit={BENCH_UNIT}", "--uid=llamafleet", "--gid=llamafleet",
           "--property=WorkingDirectory=/var/lib/llamafleet", "--collect", *argv]
    started = time.monotonic()
    res = fleet.run(shlex.join(cmd), [orch])[orch.name]
    if not res.ok:
        raise UserError(f"{orch.name}: systemd-run failed: {res.stderr or res.error}")
    try:
        endpoint.wait_healthy(timeout=load_timeout)
    except UserError as exc:
        log = fleet.run(f"journalctl -u {BENCH_UNIT} -n 30 --no-pager -o cat", [orch])[orch.name].stdout
        raise UserError(f"variant {name}: {exc}\n{log}") from exc
    load_s = time.monotonic() - started
    sent = worker_tx_bytes(fleet) - before
    tok, ptok, content = [], [], ""
    for _ in range(runs):
        answer = endpoint.complete(PROMPT, n_predict=n_predict)
        tok.append(answer["timings"]["predicted_per_second"])
        ptok.append(answer["timings"]["prompt_per_second"])
        content = answer["content"]
    return Measurement(name, load_s, statistics.median(tok), statistics.median(ptok), sent, content)


def write_results(out_dir: Path, name: str, rows: list[Measurement], table: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n", encoding="utf-8")
    (out_dir / f"{name}.md").write_text(table + "\n", encoding="utf-8")
    return path

