"""Run llama-server variants on a deployed fleet and measure them for real.

A variant is an argv for the orchestrator's llama-server.  It runs as a
transient systemd unit (``systemd-run``) under the service user while the
deployed unit is stopped, so the measurement sees the same binary, user and
workers as production; the deployed unit is started again afterwards, even
when a variant fails (:func:`serving_paused`).

The units, paths and endpoint are the orchestrator's deployment record's (:class:`HostLayout`): a benchmark reads
it once (:func:`orchestrator_layout`) and hands it to each step as ``layout``; a step given none reads it.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..cluster import Endpoint
from ..core import constants
from ..core.systemd_show import show_argv
from ..errors import UserError
from ..facts import Fact, gather, parse_cmdline, parse_counters, parse_route_device
from ..fleet import Fleet
from ..layout import HostLayout, orchestrator_layout, service_user

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


def parse_exec_start(text: str) -> list[str]:
    """The argv in ``systemctl show --property=ExecStart --value``: systemd joins it with spaces, unquoted.

    Exact only when no argument holds a space; :func:`deployed_argv` prefers the running process's argv.
    """
    if "argv[]=" not in text:
        return []
    return text.split("argv[]=", 1)[1].split(" ; ", 1)[0].split()


def deployed_facts(unit: str) -> list[Fact]:
    """The argv of llama-server's ``unit``: its main process's own, and the unit's ExecStart."""
    return [
        Fact("cmdline", f"pid=$({shlex.join(show_argv(unit, ['MainPID'], value=True))}); "
                        f"[ \"${{pid:-0}}\" -gt 0 ] && cat /proc/$pid/cmdline", parse_cmdline),
        Fact("exec_start", shlex.join(show_argv(unit, ["ExecStart"], value=True)), parse_exec_start),
    ]


def deployed_argv(fleet: Fleet, layout: HostLayout | None = None) -> list[str]:
    """The argv of the deployed llama-server: the running process's own, else the unit's ExecStart."""
    orch = fleet.orchestrator
    unit = (layout or orchestrator_layout(fleet)).llama_unit
    found = gather(fleet, [orch], lambda _: deployed_facts(unit))[orch.name]
    if not found.ok:
        raise UserError(f"{orch.name}: cannot read {unit}'s command line: {found.error}")
    argv = found.values["cmdline"] or found.values["exec_start"]
    if not argv:
        raise UserError(f"{orch.name}: {unit} has no command line (is the cluster deployed?)")
    return argv


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


def rx_towards(route_device: str, counters: dict[str, int]) -> int:
    """The received-bytes counter of the interface a worker reaches the orchestrator by."""
    if route_device not in counters:
        raise ValueError(f"no counters for interface {route_device} (have: {', '.join(sorted(counters))})")
    return counters[route_device]


def worker_tx_bytes(fleet: Fleet) -> int:
    """Bytes the orchestrator side sent towards the workers, from the workers' own interface counters."""
    orchestrator = fleet.orchestrator.cluster_address
    facts = [
        Fact("route", f"ip -o route get {shlex.quote(orchestrator)}", parse_route_device),
        Fact("rx", "grep -H . /sys/class/net/*/statistics/rx_bytes", parse_counters),
    ]
    total = 0
    for name, found in gather(fleet, fleet.workers, lambda _: facts).items():
        if not found.ok:
            raise UserError(f"{name}: cannot read interface counters: {found.error}")
        try:
            total += rx_towards(found.values["route"], found.values["rx"])
        except ValueError as exc:
            raise UserError(f"{name}: {exc}") from exc
    return total


def serving_units(layout: HostLayout) -> str:
    """llama-server's unit and the gate's, as systemctl arguments."""
    return shlex.join([layout.llama_unit, layout.gate_unit])


# The edge (roles/edge: Debian's HAProxy on the clients' port, the gate behind it) where the deploy enabled it: its
# configuration folder is there and haproxy.service is enabled (an edge turned off is disabled).
EDGE_UNIT = "haproxy.service"
_IF_EDGE = f"systemctl is-enabled -q {EDGE_UNIT} 2>/dev/null && test -d {shlex.quote(constants.EDGE_CONFIG_DIR)}"


def stop_service(fleet: Fleet, layout: HostLayout | None = None) -> None:
    """Stop llama-server, the gate in front of it and the edge in front of that (a variant answers on the clients'
    port itself)."""
    units = serving_units(layout or orchestrator_layout(fleet))
    fleet.run(f"systemctl stop {units} {BENCH_UNIT}; systemctl reset-failed {BENCH_UNIT}; "
              f"if {_IF_EDGE}; then systemctl stop {EDGE_UNIT}; fi", [fleet.orchestrator])


def restore_service(fleet: Fleet, layout: HostLayout | None = None) -> None:
    """Start the deployed llama-server, its gate and its edge again (the variant's unit gone) and wait until it
    serves."""
    layout = layout or orchestrator_layout(fleet)
    fleet.run_one(f"systemctl stop {BENCH_UNIT}; systemctl reset-failed {BENCH_UNIT}; "
                  f"systemctl start {serving_units(layout)} && if {_IF_EDGE}; then systemctl start {EDGE_UNIT}; fi",
                  fleet.orchestrator, what=f"starting {layout.llama_unit} again")
    Endpoint.of(fleet, api_key="", layout=layout).wait_healthy(timeout=600)


def pause_warning(fleet: Fleet, layout: HostLayout) -> str:
    """What the user must know before a benchmark takes the cluster out of service."""
    url = Endpoint.of(fleet, api_key="", layout=layout).url
    return (f"warning: this benchmark stops {layout.llama_unit} on {fleet.orchestrator.name} ({url}): clients get "
            "no answers until it ends; the deployed unit is started again at the end, also when it fails")


@contextmanager
def serving_paused(fleet: Fleet, out: TextIO | None = None, layout: HostLayout | None = None) -> Iterator[None]:
    """Say up front that llama-server stops; start the deployed unit again afterwards, whatever happens."""
    out = out or sys.stderr
    layout = layout or orchestrator_layout(fleet)
    print(pause_warning(fleet, layout), file=out, flush=True)
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            restore_service(fleet, layout)
            print(f"==> {layout.llama_unit} is serving again", file=out, flush=True)
        except UserError as exc:
            if not failed:
                raise
            # the benchmark's own error is the one raised; this one must not hide it
            print(f"llamafleet: error: could not start {layout.llama_unit} again: {exc}", file=out, flush=True)


def measurement(name: str, load_s: float, sent: int, answers: Sequence[dict[str, Any]]) -> Measurement:
    """A Measurement from /completion answers: median generation and prompt speeds, the last text."""
    if not answers:
        raise ValueError(f"variant {name}: no completion to measure")
    return Measurement(
        name,
        load_s,
        statistics.median(a["timings"]["predicted_per_second"] for a in answers),
        statistics.median(a["timings"]["prompt_per_second"] for a in answers),
        sent,
        answers[-1]["content"],
    )


def systemd_run_argv(fleet: Fleet, argv: list[str]) -> list[str]:
    """``systemd-run`` of ``argv`` as the orchestrator's llama-server user, in its home."""
    user, home = service_user(fleet.orchestrator, "llama_server")
    return ["systemd-run", f"--unit={BENCH_UNIT}", f"--uid={user}", f"--gid={user}",
            f"--property=WorkingDirectory={home}", "--collect", *argv]


def run_variant(fleet: Fleet, name: str, argv: list[str], runs: int = 3, n_predict: int = 64,
                load_timeout: float = 900, layout: HostLayout | None = None) -> Measurement:
    """Start ``argv`` on the orchestrator, time the load, then ``runs`` greedy completions."""
    orch = fleet.orchestrator
    layout = layout or orchestrator_layout(fleet)
    endpoint = Endpoint.of(fleet, layout=layout)
    stop_service(fleet, layout)
    # the deployed argv listens on loopback behind the gate: the variant takes the gate's address and port
    argv = replace_flag(replace_flag(argv, "--host", endpoint.address), "--port", str(endpoint.port))
    before = worker_tx_bytes(fleet)
    started = time.monotonic()
    fleet.run_one(shlex.join(systemd_run_argv(fleet, argv)), orch, what="systemd-run")
    try:
        endpoint.wait_healthy(timeout=load_timeout)
    except UserError as exc:
        log = fleet.run(f"journalctl -u {BENCH_UNIT} -n 30 --no-pager -o cat", [orch])[orch.name].stdout
        raise UserError(f"variant {name}: {exc}\n{log}") from exc
    load_s = time.monotonic() - started
    sent = worker_tx_bytes(fleet) - before
    answers = [endpoint.complete(PROMPT, n_predict=n_predict) for _ in range(runs)]
    return measurement(name, load_s, sent, answers)


def write_results(out_dir: Path, name: str, rows: list[Measurement], table: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n", encoding="utf-8")
    (out_dir / f"{name}.md").write_text(table + "\n", encoding="utf-8")
    return path

