# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gate's decision, pure: the cluster state (serving, loading or down) with its reason, and whether to restart
llama-server, from one poll's :class:`Observation` and the :class:`Memory` of earlier polls (:func:`decide`,
:func:`remember`); what each state means to a client (:func:`admission`, :func:`retry_after`); and which plan
degraded mode asks for (:func:`degrade_choice`).

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .gate_config import Config, Degrade
from .http_wire import RequestHead


SERVING = "serving"
LOADING = "loading"
DOWN = "down"
STATES = (SERVING, LOADING, DOWN)
ACTION_NONE = "none"
ACTION_RESTART = "restart"
# The reason before the first poll (Memory's and the Gate's).
STARTING = "the gate is starting"
# A link must look stalled on this many polls in a row: a snapshot taken right after llama-server sent a
# request on a link that was idle shows unacked data and an old lastack for one round trip.
STALL_CONFIRM_POLLS = 2
# Retry-After seconds of a 503 per state ("busy": the gate's connection cap).
RETRY_AFTER = {"loading": 10, "down": 15, "busy": 1}


def retry_after(state: str) -> int:
    """The Retry-After seconds for a 503 in ``state``."""
    return RETRY_AFTER.get(state, RETRY_AFTER[DOWN])


def admission(state: str, req: RequestHead) -> bool:
    """True when a request goes to llama-server in ``state``: serving or loading, all (while loading,
    llama-server answers 503 "Loading model" itself, and serves the moment it is ready, without waiting
    for the gate's next poll); down, none (``req`` is kept for rules by path)."""
    return state in (SERVING, LOADING)


@dataclass(frozen=True)
class CanaryOutcome:
    """A finished canary: ``missed`` its deadline; ``progress`` from /metrics (None: unknown)."""

    pid: int
    ok: bool
    missed: bool
    progress: bool | None = None
    elapsed: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class Observation:
    """One poll's view. ``active_state`` None: systemctl gave no answer. ``health``: the HTTP status,
    "timeout", "refused" or None (not asked). ``links`` None: ss gave no answer."""

    now: float
    active_state: str | None
    main_pid: int
    health: int | str | None
    links: dict[str, dict[str, Any]] | None
    stall_polls: dict[str, int] = field(default_factory=dict)
    canary: CanaryOutcome | None = None


@dataclass
class Memory:
    """What decide needs from earlier polls (the watchdog updates it with remember)."""

    state: str = DOWN
    reason: str = STARTING
    restart_at: float | None = None  # the last restart action, until llama-server serves again
    restart_pid: int = 0
    seen_pid: int = 0
    seen_links: frozenset[str] = frozenset()  # workers seen connected by seen_pid


@dataclass(frozen=True)
class Decision:
    """decide's answer: the new state and reason, and "none" or "restart"."""

    state: str
    reason: str
    action: str = ACTION_NONE


def _stall_reason(host: str, info: dict[str, Any]) -> str:
    if not info["unacked"]:
        return ("worker %s (%s:%d) has not answered llama-server's request for %.1f s and its host does not "
                "answer ping" % (host, info["address"], info["port"], info["silent_ms"] / 1000.0))
    return ("worker %s (%s:%d) stopped acknowledging: %d bytes unsent or unacked (%d segments in flight, "
            "%d retransmitted), no ACK for %.1f s"
            % (host, info["address"], info["port"], info["send_q"], info["unacked"], info["retrans"][1],
               info["silent_ms"] / 1000.0))


def _restart_allowed(obs: Observation, mem: Memory, cfg: Config) -> bool:
    if mem.restart_at is None:
        return obs.main_pid > 0
    return obs.main_pid > 0 and obs.now - mem.restart_at >= cfg.restart_grace and obs.main_pid != mem.restart_pid


def _fault(obs: Observation, mem: Memory, cfg: Config, reason: str) -> Decision:
    """Down because of a fault that a restart cures: restart unless one is under way."""
    if mem.restart_at is not None and not _restart_allowed(obs, mem, cfg):
        return Decision(DOWN, mem.reason)
    if not _restart_allowed(obs, mem, cfg):
        return Decision(DOWN, reason)
    return Decision(DOWN, "%s; restarting llama-server (pid %d)" % (reason, obs.main_pid), ACTION_RESTART)


def decide(obs: Observation, mem: Memory, cfg: Config) -> Decision:
    """The cluster state after one poll, and whether to restart llama-server.

    - systemctl gave no answer: nothing changes;
    - the unit is not active or has no MainPID: down;
    - a worker link stalled on STALL_CONFIRM_POLLS polls in a row: down; restart once nothing came
      for ``restart_after`` seconds (a link that heals before then serves again without a reload);
    - /health 503: loading; timeout: nothing changes; refused: loading (starting); other: down;
    - /health 200: serving when every worker has an established link; a worker llama-server was
      connected to and is no more: down, restart; one never seen connected: down (check the address);
    - a canary of this llama-server missed its deadline with no progress in /metrics: down, restart.
    After a restart action none follows for ``restart_grace`` seconds and until MainPID changes, and
    the state stays down with the restart's reason until llama-server serves again.
    """
    sticky = mem.restart_at is not None
    if obs.active_state is None:
        if mem.reason == STARTING:
            return Decision(DOWN, "cannot read the state of %s (systemctl show gave no answer)" % cfg.unit)
        return Decision(mem.state, mem.reason)
    if obs.active_state != "active" or obs.main_pid <= 0:
        if sticky:
            return Decision(DOWN, mem.reason)
        return Decision(DOWN, "llama-server is %s (waiting for workers or restarting)" % obs.active_state)
    for host, count in sorted(obs.stall_polls.items()):
        if count >= STALL_CONFIRM_POLLS and obs.links and obs.links.get(host, {}).get("link") == "stalled":
            info = obs.links[host]
            if info["silent_ms"] >= cfg.restart_after * 1000:
                return _fault(obs, mem, cfg, _stall_reason(host, info))
            if sticky:
                return Decision(DOWN, mem.reason)
            return Decision(DOWN, "%s; llama-server is restarted if it lasts %g s"
                            % (_stall_reason(host, info), cfg.restart_after))
    canary = obs.canary
    if canary is not None and canary.missed and not canary.progress and canary.pid == obs.main_pid:
        return _fault(obs, mem, cfg, "canary completion got no answer in %.0f s and no token was produced"
                      % cfg.canary_deadline)
    health = obs.health
    if health == "timeout":
        return Decision(mem.state, mem.reason)
    if health == 503 or health == "refused":
        if sticky:
            return Decision(DOWN, mem.reason)
        return Decision(LOADING, "llama-server is loading the model" if health == 503 else "llama-server is starting")
    if health != 200:
        return Decision(DOWN, mem.reason if sticky else "llama-server /health answered %s" % health)
    lost = sorted(host for host, info in (obs.links or {}).items() if info["link"] == "lost")
    if lost:
        seen = [host for host in lost if host in mem.seen_links and mem.seen_pid == obs.main_pid]
        if seen:
            info = obs.links[seen[0]]  # type: ignore[index]
            return _fault(obs, mem, cfg, "worker %s (%s:%d) lost its connection from llama-server"
                          % (seen[0], info["address"], info["port"]))
        if sticky:
            return Decision(DOWN, mem.reason)
        workers = ", ".join("%s (%s:%d)" % (host, obs.links[host]["address"], obs.links[host]["port"])  # type: ignore
                            for host in lost)
        return Decision(DOWN, "llama-server has no connection to worker %s (check the gate's worker addresses)"
                        % workers)
    return Decision(SERVING, "llama-server is serving")


def remember(mem: Memory, obs: Observation, decision: Decision) -> Memory:
    """The memory after a poll: the state, the restart under way (cleared once serving), the workers seen
    connected by the current llama-server."""
    links = obs.links or {}
    connected = frozenset(host for host, info in links.items() if info["link"] in ("ok", "stalled"))
    if obs.main_pid != mem.seen_pid:
        seen = connected
    else:
        seen = mem.seen_links | connected
    restart_at, restart_pid = mem.restart_at, mem.restart_pid
    if decision.action == ACTION_RESTART:
        restart_at, restart_pid = obs.now, obs.main_pid
    elif decision.state == SERVING:
        restart_at, restart_pid = None, 0
    return Memory(decision.state, decision.reason, restart_at, restart_pid, obs.main_pid or mem.seen_pid, seen)


def degrade_choice(deg: Degrade, answered: dict[str, bool]) -> tuple[str | None, str]:
    """The plan to ask for when the workers' hosts answered HELLO as in ``answered`` (host -> bool), with the
    reason to log: one host silent and a plan without it -> that plan; otherwise None and why not ("" when
    every host answers)."""
    silent = sorted(host for host, ok in answered.items() if not ok)
    if not silent:
        return None, ""
    if len(silent) > 1:
        return None, "not serving degraded: %d worker hosts do not answer HELLO (%s), and a degraded plan leaves " \
                     "out one" % (len(silent), ", ".join(silent))
    host = silent[0]
    name = deg.plans.get(host)
    if name is None:
        return None, "not serving degraded without %s: %s" % (host, deg.reasons.get(host, "no plan without it"))
    return name, "worker %s does not answer HELLO: serving degraded without it (plan %s)" % (host, name)
