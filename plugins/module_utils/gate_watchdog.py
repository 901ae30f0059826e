# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gate's watchdog: every ``poll_interval`` seconds it observes llama-server's unit, ``/health`` and the worker
links (pinging the host of a link that waits long for an answer), runs the canary on an idle cluster, decides
(gate_decision), sets the gate's state, restarts llama-server when stuck or stalled, asks the plan switch for a
degraded plan, and writes the state file and the gate's metrics.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from typing import Any

from .atomic_file import write_json_atomic
from .gate_config import FULL_PLAN, Config, Degrade, Worker
from .gate_decision import (ACTION_RESTART, SERVING, STALL_CONFIRM_POLLS, CanaryOutcome, Decision, Memory, Observation,
                            decide, degrade_choice, remember)
from .gate_metrics import GATE_METRICS, LoadClock, gate_samples, link_samples, render_exposition, track_load
from .gate_proxy import Gate, log
from .host_observation import (PING_TIMEOUT, SS_LINKS, SUBPROCESS_TIMEOUT, icmp_echo, main_start, made_progress,
                               parse_metrics, parse_ss, parse_systemctl_show, rpc_endpoints, run_command,
                               systemctl_show_argv)
from .http_wire import http_request
from .link_state import (awaiting_workers, count_stall_events, count_stalls, left_out, link_names, running_workers,
                         worker_links)


# How often each worker's host is pinged while its link is quiet, to learn whether it answers ping at all (a host
# that never did is not judged by ping; host_observation.PING_TIMEOUT is the probe's timeout).
PING_BASELINE_INTERVAL = 60.0
HEALTH_TIMEOUT = 2.0
METRICS_TIMEOUT = 5.0
CANARY_BODY = {"prompt": "ping", "n_predict": 1, "cache_prompt": False}


class Pinger:
    """Liveness of the workers' hosts by ICMP echo, trusted only for hosts that have answered before
    (a host whose firewall drops ping must not look dead while it computes)."""

    def __init__(self) -> None:
        self.answers: dict[str, str] = {}  # address -> "ok", "no answer" or "unavailable"
        self.answered: set[str] = set()
        self.last_baseline = float("-inf")
        self.warned = False
        self._seq = 0

    async def ping(self, addresses: list[str]) -> dict[str, bool | None]:
        """Ping each address at once; remember what answered."""
        self._seq = (self._seq + 1) % 65536
        results = await asyncio.gather(*(icmp_echo(address, PING_TIMEOUT, self._seq) for address in addresses))
        for address, result in zip(addresses, results):
            self.answers[address] = {True: "ok", False: "no answer", None: "unavailable"}[result]
            if result:
                self.answered.add(address)
        if None in results and not self.warned:
            self.warned = True
            log("cannot ping the workers' hosts (no ICMP datagram socket: net.ipv4.ping_group_range leaves out "
                "this user's group); a worker lost while llama-server waits for its answer is found by the "
                "canary only")
        return dict(zip(addresses, results))

    async def unreachable(self, addresses: dict[str, str]) -> set[str]:
        """The names (name -> address) whose host answered ping before and does not now (all are pinged, so a
        host that answers now is known from then on)."""
        known_before = set(self.answered)
        results = await self.ping(sorted(set(addresses.values())))
        return {name for name, address in addresses.items()
                if address in known_before and results.get(address) is False}


class Watchdog:
    """Polls llama-server's unit, /health and its worker links; runs the canary; restarts when stuck."""

    def __init__(self, gate: Gate, cfg: Config) -> None:
        self.gate = gate
        self.cfg = cfg
        self.memory = Memory()
        self.workers = cfg.workers
        self.stall_polls: dict[str, int] = {}
        self.stalls: dict[str, int] = {}  # stalls per worker label, since the gate started
        self.links: dict[str, dict[str, Any]] | None = None
        self.restarts = 0
        self.last_action: dict[str, Any] | None = None
        self.health_timeouts = 0
        self.main_started: float | None = None  # systemd's start of llama-server's main process (monotonic s)
        self.load = LoadClock()
        self.canary_state: dict[str, Any] = {"last_ok": None, "last_ms": None}
        self._canary_task: asyncio.Task | None = None  # type: ignore[type-arg]
        self._canary_started = 0.0
        self._canary_done: CanaryOutcome | None = None
        self._errors: set[str] = set()
        self.pinger = Pinger()
        self._baseline_task: asyncio.Task | None = None  # type: ignore[type-arg]
        # degraded mode (cfg.degrade)
        self.without: str | None = None  # the host the running llama-server leaves out
        self.not_serving_since: float | None = None
        self.last_probe = float("-inf")
        self.returns = 0
        self.requested: tuple[str, float] | None = None
        self.plan_reason = ""

    def _error(self, key: str, message: str | None) -> None:
        """Log an error once until it clears."""
        if message is None:
            self._errors.discard(key)
        elif key not in self._errors:
            self._errors.add(key)
            log(message)

    def api_key(self) -> str | None:
        """The API key from api_key_file (read on each use: the file may be rotated)."""
        if not self.cfg.api_key_file:
            return None
        try:
            with open(self.cfg.api_key_file, encoding="utf-8") as handle:
                key = handle.read().strip()
            self._error("key", None if key else "api_key_file %s is empty" % self.cfg.api_key_file)
            return key or None
        except (OSError, UnicodeDecodeError) as exc:
            self._error("key", "cannot read api_key_file %s: %s" % (self.cfg.api_key_file, exc))
            return None

    def _auth(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": "Bearer %s" % key} if key else {}

    async def process(self) -> tuple[str | None, int]:
        out = await run_command(systemctl_show_argv(self.cfg.unit))
        self._error("systemctl", None if out is not None else "systemctl show %s gave no answer" % self.cfg.unit)
        self.main_started = main_start(out) if out is not None else None
        return parse_systemctl_show(out) if out is not None else (None, 0)

    async def health(self) -> int | str:
        try:
            status, _body = await http_request(self.cfg.upstream_host, self.cfg.upstream_port, "GET", "/health",
                                               HEALTH_TIMEOUT)
            return status
        except asyncio.TimeoutError:
            self.health_timeouts += 1
            return "timeout"
        except OSError:
            return "refused"

    async def connections(self) -> list[dict[str, Any]] | None:
        out = await run_command(SS_LINKS)
        self._error("ss", None if out is not None else "ss -tinHO gave no answer: worker links are not checked")
        return parse_ss(out) if out is not None else None

    async def metrics(self) -> dict[str, float] | None:
        try:
            status, body = await http_request(self.cfg.upstream_host, self.cfg.upstream_port, "GET", "/metrics",
                                              METRICS_TIMEOUT, self._auth())
        except (OSError, asyncio.TimeoutError):
            return None
        return parse_metrics(body.decode("utf-8", "replace")) if status == 200 else None

    async def canary(self, pid: int) -> CanaryOutcome:
        """POST a one-token completion; on a missed deadline compare /metrics before and after."""
        before = await self.metrics()
        start = time.monotonic()
        body = json.dumps(CANARY_BODY).encode("utf-8")
        headers = dict(self._auth(), **{"Content-Type": "application/json"})
        try:
            status, _answer = await http_request(self.cfg.upstream_host, self.cfg.upstream_port, "POST",
                                                 "/completion", self.cfg.canary_deadline, headers, body)
        except asyncio.TimeoutError:
            # Clients' answers that streamed on meanwhile are progress too: a busy llama-server (every slot
            # decoding a long answer of a big model) queues the canary and may answer /metrics late.
            relayed = self.gate.last_answer >= start
            progress = True if relayed else made_progress(before, await self.metrics())
            return CanaryOutcome(pid, False, True, progress, time.monotonic() - start)
        except OSError as exc:
            return CanaryOutcome(pid, False, False, None, time.monotonic() - start, str(exc))
        detail = "" if status == 200 else "answered HTTP %d" % status
        return CanaryOutcome(pid, status == 200, False, None, time.monotonic() - start, detail)

    async def _run_canary(self, pid: int) -> None:
        outcome = await self.canary(pid)
        self._canary_done = outcome
        self.canary_state = {"last_ok": outcome.ok, "last_ms": round(outcome.elapsed * 1000),
                             "at": self.gate.clock()}
        self._error("canary", "canary completion %s" % outcome.detail if outcome.detail else None)

    def restart(self, pid: int) -> None:
        """SIGKILL llama-server's main process; without the permission, ``systemctl kill``."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            log("no permission to kill pid %d, asking systemd: systemctl kill -s KILL %s" % (pid, self.cfg.unit))
            subprocess.run(["systemctl", "kill", "-s", "KILL", self.cfg.unit], timeout=SUBPROCESS_TIMEOUT,
                           check=False, stdout=subprocess.DEVNULL)

    def workers_of(self, pid: int) -> tuple[Worker, ...]:
        """The workers of llama-server ``pid``, from its command line (see running_workers)."""
        if pid <= 0:
            return self.workers
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as handle:
                return running_workers(self.cfg.workers, rpc_endpoints(handle.read()))
        except OSError:
            return running_workers(self.cfg.workers, None)

    async def poll(self) -> Decision:
        """One round: observe, decide, act, publish."""
        active, pid = await self.process()
        running = active == "active" and pid > 0
        health = await self.health() if running else None
        loaded = self.load.loads
        self.load = track_load(self.load, pid if running else 0, self.main_started, health, time.monotonic(),
                               self.gate.clock())
        if self.load.loads != loaded:
            log("llama-server (pid %d) loaded the model in %.1f s" % (pid, self.load.last_seconds or 0.0))
        conns = await self.connections()
        self.workers = self.workers_of(pid) if running else self.workers
        self.links = await self.observe_links(conns)
        self.stall_polls = count_stalls(self.stall_polls, self.links)
        self.stalls = count_stall_events(self.stalls, self.links, self.stall_polls, STALL_CONFIRM_POLLS)
        canary, self._canary_done = self._canary_done, None
        obs = Observation(self.gate.clock(), active, pid, health, self.links, self.stall_polls, canary)
        decision = decide(obs, self.memory, self.cfg)
        self.memory = remember(self.memory, obs, decision)
        if decision.action == ACTION_RESTART:
            self.restarts += 1
            self.last_action = {"action": "restart", "pid": pid, "at": obs.now, "reason": decision.reason}
            self.gate.set_state(decision.state, decision.reason)
            self.restart(pid)
        else:
            self.gate.set_state(decision.state, decision.reason)
        self._maybe_canary(decision.state, pid)
        if self.cfg.degrade is not None:
            await self.degrade(self.cfg.degrade, decision.state, running)
        self.write_state()
        return decision

    async def probe_host(self, deg: Degrade, host: str) -> bool:
        """True when every rpc-server of ``host`` answers HELLO within 3 s (only asked while llama-server is
        not connected to it: rpc-server serves one client at a time)."""
        endpoints = ["%s:%d" % ("[%s]" % w.address if ":" in w.address else w.address, w.port)
                     for w in self.cfg.workers if w.host == host]
        return await run_command(list(deg.probe) + ["--timeout", "3"] + endpoints, timeout=3.0 * len(endpoints) + 2) \
            is not None

    def request_plan(self, deg: Degrade, name: str, reason: str) -> None:
        """Ask the root switch service for plan ``name`` (or "full")."""
        now = time.monotonic()
        if self.requested is not None and self.requested[0] == name and now - self.requested[1] < 120:
            return
        self.requested = (name, now)
        self.plan_reason = reason
        log(reason)
        try:
            write_json_atomic(deg.request_file, {"plan": name, "reason": reason, "at": self.gate.clock()})
        except OSError as exc:
            log("cannot write the plan request %s: %s" % (deg.request_file, exc))

    async def degrade(self, deg: Degrade, state: str, running: bool) -> None:
        """Degraded mode: serve without a worker host that stays silent, and back with it once it answers.

        The hosts are probed only while llama-server is not running (it waits in ExecStartPre, or restarts), so
        no probe queues behind its connections; the left-out host is probed while degraded (nobody uses it)."""
        now = time.monotonic()
        if running:
            without = left_out(self.cfg.workers, self.workers)
            if without != self.without:
                self.returns = 0
                log("llama-server runs %s" % ("the full plan" if without is None else
                                              "degraded, without worker %s" % without))
            self.without = without
        self.not_serving_since = None if state == SERVING else (self.not_serving_since or now)
        if now - self.last_probe < deg.probe_interval:
            return
        if self.without is None:
            if running or self.not_serving_since is None or now - self.not_serving_since < deg.after:
                return
            self.last_probe = now
            hosts = sorted({w.host for w in self.cfg.workers})
            answers = await asyncio.gather(*(self.probe_host(deg, host) for host in hosts))
            name, reason = degrade_choice(deg, dict(zip(hosts, answers)))
            if name is not None:
                self.request_plan(deg, name, reason)
            else:
                self._error("degrade", reason or None)
            return
        self.last_probe = now
        if await self.probe_host(deg, self.without):
            self.returns += 1
            if self.returns >= deg.return_probes:
                self.request_plan(deg, FULL_PLAN, "worker %s answers HELLO again (%d probes in a row): restoring the "
                                  "full plan" % (self.without, self.returns))
        else:
            self.returns = 0

    async def observe_links(self, conns: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
        """The workers' links; a link that has waited stall_seconds for an answer is stalled when its host,
        which answered ping before, answers no more. Every PING_BASELINE_INTERVAL the hosts are pinged
        in the background to learn which answer."""
        if conns is None:
            return None
        links = worker_links(conns, self.workers, self.cfg.stall_seconds)
        waiting = awaiting_workers(links, self.cfg.stall_seconds)
        if waiting:
            addresses = {name: links[name]["address"] for name in waiting}
            unreachable = await self.pinger.unreachable(addresses)
            if unreachable:
                links = worker_links(conns, self.workers, self.cfg.stall_seconds, unreachable)
        elif time.monotonic() - self.pinger.last_baseline >= PING_BASELINE_INTERVAL:
            self.pinger.last_baseline = time.monotonic()
            addresses = sorted({worker.address for worker in self.workers})
            self._baseline_task = asyncio.ensure_future(self.pinger.ping(addresses))
        return links

    def _maybe_canary(self, state: str, pid: int) -> None:
        """A canary every canary_interval while serving, unless clients' answers already showed the
        cluster working within that interval (their traffic is the proof, and a canary would disturb
        a benchmark's measurements)."""
        now = time.monotonic()
        if state != SERVING or (self._canary_task is not None and not self._canary_task.done()):
            return
        if now - self.gate.last_answer < self.cfg.canary_interval:
            return
        if now - self._canary_started >= self.cfg.canary_interval:
            self._canary_started = now
            self._canary_task = asyncio.ensure_future(self._run_canary(pid))

    def snapshot(self) -> dict[str, Any]:
        """The state file's content."""
        workers = {}
        for worker, name in zip(self.workers, link_names(self.workers)):
            info = (self.links or {}).get(name)
            workers[name] = {"address": worker.address, "port": worker.port,
                             "link": info["link"] if info else "unknown",
                             "unacked": info["unacked"] if info else None,
                             "lastack_ms": info["lastack_ms"] if info else None,
                             "awaiting_ms": info["awaiting_ms"] if info else None,
                             "ping": self.pinger.answers.get(worker.address, "unknown")}
        plan = None
        if self.cfg.degrade is not None:
            plan = {"mode": FULL_PLAN if self.without is None else "degraded", "without": self.without,
                    "reason": self.plan_reason, "requested": self.requested[0] if self.requested else None,
                    "return_probes": self.returns}
        return {"state": self.gate.state, "reason": self.gate.reason, "since": self.gate.since, "plan": plan,
                "updated": self.gate.clock(), "restarts": self.restarts, "last_action": self.last_action,
                "workers": workers, "canary": self.canary_state, "counters": dict(self.gate.counters),
                "in_flight": self.gate.in_flight, "health_timeouts": self.health_timeouts,
                "load": {"last_seconds": self.load.last_seconds, "ready_at": self.load.ready_at,
                         "loads": self.load.loads}}

    def metrics_text(self) -> str:
        """The gate's metrics (GATE_METRICS_PATH) as Prometheus text: its own, and each worker link's from the last
        poll."""
        degraded = None if self.cfg.degrade is None else self.without is not None
        kv = self.gate.budget
        budget = None if kv is None else (kv.capacity, kv.reserved, kv.waiting)
        return render_exposition(GATE_METRICS, gate_samples(self.gate.state, self.gate.since, self.gate.counters,
                                                            self.gate.in_flight, self.restarts, degraded, self.load,
                                                            budget)
                                 + link_samples(self.links, self.stall_polls, self.stalls))

    def write_state(self) -> None:
        """Write the snapshot atomically (temp file + rename) to state_file, when there is one."""
        if self.cfg.state_file is None:
            return
        try:
            write_json_atomic(self.cfg.state_file, self.snapshot())
            self._error("state_file", None)
        except OSError as exc:
            self._error("state_file", "cannot write %s: %s" % (self.cfg.state_file, exc))

    async def run(self) -> None:
        """Poll forever, every poll_interval seconds."""
        while True:
            started = time.monotonic()
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - the watchdog must keep running
                self._error("poll", "watchdog poll failed: %s: %s" % (type(exc).__name__, exc))
            await asyncio.sleep(max(0.0, self.cfg.poll_interval - (time.monotonic() - started)))
