# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Round trips from this host to the workers' hosts, by ICMP echo, for the split planner.

The planner (split_policies) weighs the round trips a split costs per token
against what spreading gives; ``link_rtt`` (the module) measures them on the
orchestrator before it plans, as ``rtt_ms`` per worker endpoint.

Why ICMP and not the rpc port: rpc-server serves one client at a time with a
backlog of one, so while llama-server is connected a probe's connection waits
unaccepted in that backlog, and a few of them fill it (later connections,
llama-server's own after a restart included, then wait for SYN retransmits, and
the worker's guard counts a full queue as stuck). An echo touches no service.

Raw ICMP sockets need CAP_NET_RAW (the module runs as root); without it a
datagram ICMP socket is tried (``net.ipv4.ping_group_range``). A host that
never answers gets no figure, and the planner then treats its link as
unmeasured (it never switches a split on a guess).

Stdlib only.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import time
from typing import Any, Iterable, Mapping

# the packets are the gate's (its ping tells a lost worker host from a computing one)
from .host_observation import echo_reply_of, echo_request


def _open(family: int, ipv6: bool) -> tuple[socket.socket, bool]:
    """A raw ICMP socket, else a datagram one; and whether the kernel owns the identifier (datagram)."""
    proto = socket.IPPROTO_ICMPV6 if ipv6 else socket.IPPROTO_ICMP
    try:
        return socket.socket(family, socket.SOCK_RAW, proto), False
    except PermissionError:
        return socket.socket(family, socket.SOCK_DGRAM, proto), True


def ping_ms(address: str, count: int = 5, timeout: float = 1.0, interval: float = 0.05) -> list[float]:
    """Round trips of ``count`` echoes to ``address``, ms, one at a time (lost ones left out).

    Raises OSError when no ICMP socket can be opened or the name does not resolve."""
    family, _type, _proto, _name, sockaddr = socket.getaddrinfo(address, None, type=socket.SOCK_DGRAM)[0]
    ipv6 = family == socket.AF_INET6
    sock, kernel_ident = _open(family, ipv6)
    ident = os.getpid() & 0xFFFF
    samples: list[float] = []
    with sock:
        sock.connect(sockaddr)
        if kernel_ident:
            ident = sock.getsockname()[1] & 0xFFFF
        for seq in range(1, count + 1):
            started = time.perf_counter()
            sock.send(echo_request(seq, ipv6, ident))
            deadline = started + timeout
            while True:
                left = deadline - time.perf_counter()
                if left <= 0 or not select.select([sock], [], [], left)[0]:
                    break
                got = echo_reply_of(sock.recv(2048), ipv6, with_ip_header=not ipv6 and not kernel_ident)
                if got == (ident, seq & 0xFFFF):
                    samples.append((time.perf_counter() - started) * 1000.0)
                    break
            time.sleep(interval)
    return samples


def summarize(samples: list[float], sent: int) -> dict[str, Any]:
    """``rtt_ms`` (the median, 2 decimals; None when nothing came back), min, max and how many were lost."""
    if not samples:
        return {"rtt_ms": None, "min_ms": None, "max_ms": None, "lost": sent}
    return {"rtt_ms": round(statistics.median(samples), 2), "min_ms": round(min(samples), 3),
            "max_ms": round(max(samples), 3), "lost": sent - len(samples)}


def measure_endpoints(endpoints: Iterable[Mapping[str, Any]], count: int = 5,
                      timeout: float = 1.0) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The endpoints (rpc_plan's worker entries: ``address``, ...) each with ``rtt_ms`` added, and the figures per
    address (each host is pinged once, whatever its number of endpoints)."""
    endpoints = list(endpoints)
    figures: dict[str, dict[str, Any]] = {}
    for address in dict.fromkeys(str(e["address"]) for e in endpoints):
        try:
            figures[address] = summarize(ping_ms(address, count, timeout), count)
        except OSError as exc:
            figures[address] = dict(summarize([], count), error=str(exc))
    return [dict(e, rtt_ms=figures[str(e["address"])]["rtt_ms"]) for e in endpoints], figures
