"""The gate's metrics as it serves them, for the tests: its ``/llamafleet/metrics`` text after real watchdog polls
(gate_watchdog.Watchdog.poll, then metrics_text) whose ``ss -tinHO`` shows a given real text, and a strict parser of
the Prometheus text format (version 0.0.4) that fails on anything the format does not allow."""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamafleet.core.gate_config import Config, Degrade, Worker
from llamafleet.core.gate_decision import STALL_CONFIRM_POLLS
from llamafleet.core.gate_proxy import Gate
from llamafleet.core.gate_watchdog import Watchdog
from llamafleet.core.host_observation import parse_ss

SS_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ss"
# The lab's links, lab3 partitioned (fixtures/ss/README.md), and the workers the lab's gate knows.
LAB_PARTITIONED = SS_FIXTURES / "lab1-lab3-partitioned-7s.txt"
LAB_WORKERS = (Worker("lab2", "10.77.0.12", 50052), Worker("lab3", "10.77.0.13", 50052))


def gate_exposition(ss_text: str, workers: tuple[Worker, ...], polls: int = 1) -> str:
    """The gate's metrics after ``polls`` polls of a watchdog whose llama-server (pid 4242, running the configured
    ``workers``) is active and healthy and whose ``ss`` shows ``ss_text``, degraded mode on (it runs the full plan),
    its slots sharing the lab's cache of 2,048 tokens (the KV budget's metrics).
    Nothing is pinged, killed or written: those steps are stubbed; observing the links, counting stalls, deciding
    and rendering are the gate's own."""
    degrade = Degrade(plans={w.host: None for w in workers}, reasons={}, request_file="/nonexistent/plan-request.json",
                      probe=("false",))
    cfg = Config(listen_port=8080, upstream_port=8081, unit="llamafleet-llama-server.service", workers=workers,
                 degrade=degrade, kv_budget=2048)
    dog = Watchdog(Gate(cfg, clock=lambda: 1000.0), cfg)

    async def process() -> tuple[str, int]:
        return "active", 4242

    async def health() -> int:
        return 200

    async def connections() -> list[dict[str, Any]]:
        return parse_ss(ss_text)

    async def unreachable(addresses: dict[str, str]) -> set[str]:
        return set()

    stubs = {"process": process, "health": health, "connections": connections, "workers_of": lambda pid: workers,
             "restart": lambda pid: None, "_maybe_canary": lambda state, pid: None}
    for name, stub in stubs.items():
        setattr(dog, name, stub)
    dog.pinger.unreachable = unreachable  # type: ignore[method-assign]
    dog.pinger.last_baseline = math.inf  # no background ping of the workers' hosts

    async def run() -> None:
        for _poll in range(polls):
            await dog.poll()

    asyncio.run(run())
    return dog.metrics_text()


def lab_exposition() -> str:
    """The gate's metrics on the lab, lab3 partitioned, after two polls (the stall confirmed)."""
    return gate_exposition(LAB_PARTITIONED.read_text(encoding="utf-8"), LAB_WORKERS, polls=STALL_CONFIRM_POLLS)


@dataclass
class Family:
    kind: str
    help: str
    samples: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
_SAMPLE = re.compile(r"(%s)(?:\{((?:%s)(?:,%s)*)?\})? (\S+)" % (_NAME, _LABEL, _LABEL))


def _value(text: str) -> float:
    if text in ("NaN", "+Inf", "-Inf"):
        return float(text.replace("Inf", "inf").replace("NaN", "nan"))
    assert re.fullmatch(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?", text), "not a sample value: %r" % text
    return float(text)


def parse_exposition(text: str) -> dict[str, Family]:
    """Prometheus text -> {name: Family}. Strict: every family has HELP then TYPE (counter or gauge) before its
    samples, and its samples follow at once, each named as the family; a counter's name ends in ``_total`` and its
    values are finite and not negative; no series twice; the text ends in a newline."""
    assert text.endswith("\n") and "\n\n" not in text, "blank line or no final newline"
    families: dict[str, Family] = {}
    current = None
    lines = text[:-1].split("\n")
    for number, line in enumerate(lines):
        where = "line %d: %r" % (number + 1, line)
        if line.startswith("# HELP "):
            name, _sep, help_text = line[len("# HELP "):].partition(" ")
            assert re.fullmatch(_NAME, name) and name not in families, where
            assert number + 1 < len(lines) and lines[number + 1].startswith("# TYPE %s " % name), where
            families[name] = current = Family("", help_text)
            continue
        if line.startswith("# TYPE "):
            name, _sep, kind = line[len("# TYPE "):].partition(" ")
            assert current is families.get(name) and current is not None and not current.kind, where
            assert kind in ("counter", "gauge"), where
            assert kind != "counter" or name.endswith("_total"), where
            current.kind = kind
            continue
        assert not line.startswith("#"), where
        match = _SAMPLE.fullmatch(line)
        assert match, where
        name = match.group(1)
        assert current is not None and current is families.get(name) and current.kind, where
        labels = tuple(sorted(re.findall(_LABEL, match.group(2) or "")))
        assert len({key for key, _val in labels}) == len(labels) and labels not in current.samples, where
        value = _value(match.group(len(match.groups())))
        assert current.kind != "counter" or (math.isfinite(value) and value >= 0), where
        current.samples[labels] = value
    assert all(family.samples for family in families.values()), "a family without samples"
    return families


def by_worker(families: dict[str, Family], name: str) -> dict[str, float]:
    """{worker label: value} of a per-worker family (which has the label ``worker`` alone)."""
    found = {}
    for labels, value in families[name].samples.items():
        assert [key for key, _val in labels] == ["worker"], (name, labels)
        found[labels[0][1]] = value
    return found
