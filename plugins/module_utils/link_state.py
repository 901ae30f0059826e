# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Each worker's link from llama-server, as the kernel sees it (from :func:`host_observation.parse_ss`): which
workers the running llama-server really connects to, the name each link goes by, stalled, waiting for an answer,
lost, and the polls in a row a link has looked stalled.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

from typing import Any

from .gate_config import DEFAULT_STALL_SECONDS, Worker
from .host_observation import normalize_address


def running_workers(configured: tuple[Worker, ...], endpoints: list[tuple[str, int]] | None) -> tuple[Worker, ...]:
    """The workers llama-server really connects to: its ``--rpc`` endpoints, named as the config names
    them (an endpoint the config does not know, such as a benchmark's proxy, is named by itself).
    ``endpoints`` None (the command line could not be read): the configured workers."""
    if endpoints is None:
        return configured
    names = {(w.address, w.port): w.host for w in configured}
    return tuple(Worker(names.get((normalize_address(a), p), "%s:%d" % (a, p)), normalize_address(a), p)
                 for a, p in endpoints)


def left_out(configured: tuple[Worker, ...], running: tuple[Worker, ...]) -> str | None:
    """The worker host a degraded llama-server runs without (its --rpc lacks every endpoint of that host),
    None when it runs the full plan (or lacks more than one host, which no plan of the gate does)."""
    missing = sorted({w.host for w in configured} - {w.host for w in running})
    return missing[0] if len(missing) == 1 else None


def link_names(workers: tuple[Worker, ...] | list[Worker]) -> list[str]:
    """The name each worker's link goes by: its host, or ``host:port`` where a host has several
    endpoints (one rpc-server per device), so each is watched on its own."""
    hosts = [worker.host for worker in workers]
    return [w.host if hosts.count(w.host) == 1 else "%s:%d" % (w.host, w.port) for w in workers]


def link_stalled(conn: dict[str, Any], stall_seconds: float) -> bool:
    """Data sent on the link and no ACK from the worker for ``stall_seconds``."""
    return conn["unacked"] > 0 and conn["lastack_ms"] >= stall_seconds * 1000


def awaiting_ms(conn: dict[str, Any]) -> int:
    """How long the link has carried no data either way with nothing unacknowledged (0 while data is
    unacknowledged: link_stalled's case). llama-server waiting for an answer, or for the rest of one,
    a worker computing, an idle link and a worker cut off all look the same here; only a liveness probe
    of the worker's host tells the lost one apart. (Waiting only where the last data went out after the
    last data came in missed a partition that began in the middle of an answer: seen in CI.)"""
    if conn["unacked"] > 0:
        return 0
    return min(conn["lastsnd_ms"], conn["lastrcv_ms"])


def worker_label(worker: Worker) -> str:
    """The ``worker`` label of a link's metrics: ``host:port`` (the host as the inventory names it; an endpoint the
    config does not know is named ``address:port`` already, see running_workers)."""
    return worker.host if ":" in worker.host else "%s:%d" % (worker.host, worker.port)


def link_traffic(conns: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the kernel counts on a worker's established connections (from :func:`host_observation.parse_ss`),
    None when there is none. Counters and queues are summed over the connections (llama-server holds one per
    endpoint); ``rtt_ms`` and ``rttvar_ms`` are the slowest connection's (None when ss showed no rtt).
    ``sent_bytes`` is tcpi_bytes_acked (data the worker acknowledged: retransmissions count once; the
    connecting side, llama-server, counts its SYN too); ``received_bytes`` tcpi_bytes_received;
    ``retransmits`` tcpi_total_retrans (segments); ``unacked_bytes`` the data sent and not yet acknowledged
    (Send-Q less ``notsent``); ``notsent_bytes`` the data written and not sent yet (a full window)."""
    if not conns:
        return None
    timed = [conn for conn in conns if conn["rtt_ms"] is not None]
    slowest = max(timed, key=lambda conn: conn["rtt_ms"], default=None)
    return {
        "connections": len(conns),
        "rtt_ms": slowest["rtt_ms"] if slowest else None, "rttvar_ms": slowest["rttvar_ms"] if slowest else None,
        "sent_bytes": sum(conn["bytes_acked"] for conn in conns),
        "received_bytes": sum(conn["bytes_received"] for conn in conns),
        "retransmits": sum(conn["retrans"][1] for conn in conns),
        "unacked_bytes": sum(max(0, conn["send_q"] - conn["notsent"]) for conn in conns),
        "notsent_bytes": sum(conn["notsent"] for conn in conns),
    }


def worker_links(conns: list[dict[str, Any]], workers: tuple[Worker, ...] | list[Worker],
                 stall_seconds: float = DEFAULT_STALL_SECONDS,
                 unreachable: frozenset[str] | set[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """Each worker's link from llama-server, from ``parse_ss`` output.

    Only connections whose peer is the worker's address:port count (the orchestrator's own
    rpc-server, if any, has the worker as its local end). ``link`` is "stalled" when any of them
    has data unacknowledged for ``stall_seconds``, or has waited that long for an answer while the
    worker's host (named in ``unreachable``) does not answer a liveness probe; "ok" when one is
    established, "lost" when none is. ``silent_ms``: how long the stalled link has had nothing from
    the worker (no ACK, or no answer); ``awaiting_ms``: see :func:`awaiting_ms`; ``worker``: the label of its
    metrics (:func:`worker_label`); ``traffic``: see :func:`link_traffic`.
    """
    links = {}
    for worker, name in zip(workers, link_names(workers)):
        key = (normalize_address(worker.address), worker.port)
        mine = [conn for conn in conns if conn["peer"] == key and conn["state"].upper().startswith("ESTAB")]
        stalled = [(conn, conn["lastack_ms"]) for conn in mine if link_stalled(conn, stall_seconds)]
        if name in unreachable:
            stalled += [(conn, awaiting_ms(conn)) for conn in mine if awaiting_ms(conn) >= stall_seconds * 1000]
        worst, silent = max(stalled, key=lambda item: (item[1], item[0]["unacked"]), default=(None, 0))
        if worst is None:
            worst = max(mine, key=lambda conn: (conn["unacked"], conn["lastack_ms"]), default=None)
        links[name] = {
            "address": worker.address, "port": worker.port,
            "link": "stalled" if stalled else ("ok" if mine else "lost"),
            "unacked": worst["unacked"] if worst else 0, "lastack_ms": worst["lastack_ms"] if worst else None,
            "send_q": worst["send_q"] if worst else 0, "retrans": list(worst["retrans"]) if worst else [0, 0],
            "silent_ms": silent, "awaiting_ms": max((awaiting_ms(conn) for conn in mine), default=0),
            "worker": worker_label(worker), "traffic": link_traffic(mine),
        }
    return links


def awaiting_workers(links: dict[str, dict[str, Any]] | None, stall_seconds: float) -> list[str]:
    """The links that have waited ``stall_seconds`` or more for an answer (their hosts get probed)."""
    return sorted(name for name, info in (links or {}).items() if info["awaiting_ms"] >= stall_seconds * 1000)


def count_stalls(previous: dict[str, int], links: dict[str, dict[str, Any]] | None) -> dict[str, int]:
    """Polls in a row each worker's link has looked stalled (all zero when the links are unknown)."""
    if links is None:
        return {}
    return {host: previous.get(host, 0) + 1 if info["link"] == "stalled" else 0 for host, info in links.items()}


def count_stall_events(previous: dict[str, int], links: dict[str, dict[str, Any]] | None, stall_polls: dict[str, int],
                       confirm: int) -> dict[str, int]:
    """Stalls each worker's link has had (by its ``worker`` label): one more each time a link's run of stalled polls
    (:func:`count_stalls`) reaches ``confirm``, the polls the gate needs to call it stalled. A worker once seen keeps
    its count (a degraded plan leaves it out)."""
    counts = dict(previous)
    for name, info in (links or {}).items():
        counts[info["worker"]] = counts.get(info["worker"], 0) + (1 if stall_polls.get(name) == confirm else 0)
    return counts
