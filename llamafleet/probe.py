"""Link probes: TCP connect time and throughput from the orchestrator to each worker, on real traffic.

A sink (:mod:`llamafleet.linkprobe`) listens on the worker's cluster address
while the orchestrator sends to it; links are measured one at a time so that
no two share the orchestrator's interface.
"""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from . import linkprobe
from .fleet import Fleet, Host, RunResult

SOURCE = Path(linkprobe.__file__).read_text(encoding="utf-8")


@dataclass
class Link:
    """One measured link, or why it could not be measured."""

    source: str
    target: str
    connect_ms: float = 0.0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def name(self) -> str:
        return f"{self.source} -> {self.target}"

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def remote_command(*args: object) -> str:
    """The shell command that runs the probe with ``args`` on a host."""
    return f"python3 -c {shlex.quote(SOURCE)} " + " ".join(shlex.quote(str(a)) for a in args)


def link_result(source: str, target: str, sent: RunResult, sunk: RunResult | None) -> Link:
    """A Link from the sender's output (its last line is JSON), or the error of either end."""
    if not sent.ok:
        sink_note = f" (sink: {sunk.reason})" if sunk is not None and not sunk.ok else ""
        return Link(source, target, error=sent.reason + sink_note)
    try:
        data = json.loads(sent.stdout.strip().splitlines()[-1])
        return Link(source, target, float(data["connect_ms"]), int(data["bytes"]), float(data["seconds"]))
    except (ValueError, KeyError, IndexError) as exc:
        return Link(source, target, error=f"unreadable probe output {sent.stdout.strip()[-200:]!r}: {exc}")


def probe_link(fleet: Fleet, source: Host, target: Host, megabytes: int, port: int) -> Link:
    """Send ``megabytes`` MiB from ``source`` to a sink on ``target``'s cluster address."""
    address = target.cluster_address
    sunk: dict[str, RunResult] = {}

    def sink() -> None:
        sunk.update(fleet.run(remote_command("sink", address, port), [target], timeout=60))

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    sent = fleet.run(remote_command("send", address, port, megabytes), [source], timeout=120)[source.name]
    thread.join(timeout=90)
    return link_result(source.name, target.name, sent, sunk.get(target.name))


def probe_links(fleet: Fleet, megabytes: int = 32, port: int = 50999) -> Iterator[Link]:
    """Every orchestrator -> worker link, one after another (each as soon as it is measured)."""
    orch = fleet.orchestrator
    for worker in fleet.workers:
        if worker.name != orch.name:
            yield probe_link(fleet, orch, worker, megabytes, port)
