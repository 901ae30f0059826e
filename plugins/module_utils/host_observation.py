# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the gate and the rpc-server guard read of their host, and how they run it: ``ss`` (links with their
tcp_info, listeners and their accept queues, established peers), ``systemctl show``, llama-server's command line
(``/proc/PID/cmdline``), Prometheus text from llama-server's ``/metrics``, and the ICMP echo the gate pings the
workers' hosts with (the packets are link_rtt's too). Parsers are pure; ``run_command`` (asyncio) and
``command_output`` (blocking) run the commands.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import socket
import struct
import subprocess
from typing import Any

from .systemd_show import parse_show, show_argv


# Seconds a command (ss, systemctl) may take.
SUBPROCESS_TIMEOUT = 5.0
# Liveness probe of a worker's host (ICMP echo): its timeout (how often the watchdog pings:
# gate_watchdog.PING_BASELINE_INTERVAL).
PING_TIMEOUT = 1.0
# /metrics counters that move whenever llama-server makes progress (n_decode_total: every llama_decode call).
PROGRESS_COUNTERS = ("llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total", "llamacpp:n_decode_total")
# ss commands: the gate reads tcp_info of established links; the guard reads listeners and established peers.
SS_LINKS = ["ss", "-tinHO", "state", "established"]
SS_LISTENERS = ["ss", "-ltnH"]
SS_ESTABLISHED = ["ss", "-tnH", "state", "established"]


async def run_command(argv: list[str], timeout: float = SUBPROCESS_TIMEOUT) -> str | None:
    """stdout of ``argv`` when it exits 0 within ``timeout``, else None."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                    stderr=subprocess.DEVNULL)
    except OSError:
        return None
    try:
        out, _err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return out.decode("utf-8", "replace") if proc.returncode == 0 else None


def command_output(argv: list[str]) -> str | None:
    """stdout of ``argv`` when it exits 0 within SUBPROCESS_TIMEOUT, else None (run_command, blocking)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def normalize_address(text: str) -> str:
    """An address as ss prints it, made comparable: brackets, IPv4-mapped IPv6 and ``%iface`` removed."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    text = text.split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text.lower()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _endpoint(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return normalize_address(host), int(port)


def _int(value: str) -> int:
    try:
        return int(float(value))
    except (ValueError, OverflowError):
        return 0


def _float(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def parse_ss(text: str) -> list[dict[str, Any]]:
    """Parse ``ss -tinHO [state established]`` output: one dict per TCP socket.

    Each line is ``[State] Recv-Q Send-Q Local:Port Peer:Port`` then tcp_info as ``key:value``
    words (ss leaves out the state column when a state filter is given, and leaves out
    ``unacked``, ``retrans``, ``backoff`` and the ``last*`` timers when they are zero).
    Keys: state, recv_q, send_q (bytes written and not yet acknowledged, sent or not), local, peer
    ((address, port)), unacked (segments), lastsnd_ms, lastrcv_ms, lastack_ms, retrans ((outstanding, total)),
    rto_ms, backoff; and the link's traffic: rtt_ms and rttvar_ms (``rtt:RTT/RTTVAR``, None when ss shows no
    ``rtt``), bytes_acked, bytes_received, bytes_sent and notsent (bytes written but not sent yet; ss leaves
    these out when zero). Lines that do not parse are skipped.
    """
    conns = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 4:
            continue
        state = "ESTAB"
        if not words[0].isdigit():
            state = words.pop(0)
        if len(words) < 4 or not words[0].isdigit() or not words[1].isdigit():
            continue
        local, peer = _endpoint(words[2]), _endpoint(words[3])
        if local is None or peer is None:
            continue
        info: dict[str, str] = {}
        for word in words[4:]:
            key, sep, value = word.partition(":")
            if sep and key.isidentifier() and key not in info:
                info[key] = value
        current, _sep, total = info.get("retrans", "0/0").partition("/")
        rtt, _sep, rttvar = info.get("rtt", "").partition("/")
        conns.append({
            "state": state, "recv_q": int(words[0]), "send_q": int(words[1]), "local": local, "peer": peer,
            "unacked": _int(info.get("unacked", "0")), "lastsnd_ms": _int(info.get("lastsnd", "0")),
            "lastrcv_ms": _int(info.get("lastrcv", "0")), "lastack_ms": _int(info.get("lastack", "0")),
            "retrans": (_int(current), _int(total or "0")), "rto_ms": _int(info.get("rto", "0")),
            "backoff": _int(info.get("backoff", "0")), "rtt_ms": _float(rtt), "rttvar_ms": _float(rttvar),
            "bytes_acked": _int(info.get("bytes_acked", "0")), "bytes_received": _int(info.get("bytes_received", "0")),
            "bytes_sent": _int(info.get("bytes_sent", "0")), "notsent": _int(info.get("notsent", "0")),
        })
    return conns


def parse_listeners(text: str) -> dict[int, tuple[int, int]]:
    """``ss -ltnH`` -> {local port: (connections queued for accept, backlog)} (a listening socket's Recv-Q
    and Send-Q). A connection reset while queued stays counted until rpc-server accepts it; the queue is
    full (new clients cannot even connect) once it holds more than the backlog."""
    queued: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        words = line.split()
        if words and not words[0][0].isdigit():
            words = words[1:]  # the state column, when ss prints it
        if len(words) < 3 or not words[0].isdigit() or not words[1].isdigit():
            continue
        local = _endpoint(words[2])
        if local is not None:
            before = queued.get(local[1], (0, 0))
            queued[local[1]] = (before[0] + int(words[0]), max(before[1], int(words[1])))
    return queued


def established_on(conns: list[dict[str, Any]], port: int) -> int:
    """Established connections whose local port is ``port`` (from :func:`parse_ss`)."""
    return sum(1 for conn in conns if conn["local"] is not None and conn["local"][1] == port
               and conn["state"].upper().startswith("ESTAB"))


def rpc_endpoints(cmdline: bytes) -> list[tuple[str, int]]:
    """The ``--rpc HOST:PORT,...`` endpoints of a llama-server command line (``/proc/PID/cmdline``:
    NUL-separated words), in order; [] when it has none."""
    words = [w.decode("utf-8", "replace") for w in cmdline.split(b"\0")]
    value = None
    for i, word in enumerate(words):
        if word == "--rpc" and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith("--rpc="):
            value = word[len("--rpc="):]
    endpoints = []
    for item in (value or "").split(","):
        found = _endpoint(item.strip())
        if found is not None:
            endpoints.append(found)
    return endpoints


def systemctl_show_argv(unit: str) -> list[str]:
    """The command whose output parse_systemctl_show reads (the gate's watchdog and the guard use it)."""
    return show_argv(unit, ("MainPID", "ActiveState", "ExecMainStartTimestampMonotonic"))


def parse_systemctl_show(text: str) -> tuple[str, int]:
    """``systemctl show`` of MainPID and ActiveState (:func:`systemctl_show_argv`) -> (active state, main pid)."""
    values = parse_show(text)
    pid = values.get("MainPID", "0").strip()
    return values.get("ActiveState", "unknown").strip() or "unknown", int(pid) if pid.isdigit() else 0


def main_start(text: str) -> float | None:
    """When systemd started the unit's main process (``ExecMainStartTimestampMonotonic``, microseconds of
    CLOCK_MONOTONIC, as time.monotonic() counts) in seconds; None when not shown or 0."""
    raw = parse_show(text).get("ExecMainStartTimestampMonotonic", "").strip()
    return int(raw) / 1e6 if raw.isdigit() and int(raw) > 0 else None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name: value} (labels kept in the name, comments skipped)."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _sep, rest = line.rpartition(" ")
        try:
            values[name.strip()] = float(rest)
        except ValueError:
            continue
    return values


def made_progress(before: dict[str, float] | None, after: dict[str, float] | None) -> bool | None:
    """True when a progress counter moved between two /metrics reads, None when either read failed
    or they share no progress counter."""
    if before is None or after is None:
        return None
    common = [name for name in PROGRESS_COUNTERS if name in before and name in after]
    if not common:
        return None
    return any(before[name] != after[name] for name in common)


# ICMP echo. The gate pings from an unprivileged datagram socket (Linux: the group must be in
# net.ipv4.ping_group_range; the kernel sets the identifier and the checksum). The link_rtt module pings from a
# raw socket as root and builds and reads the same packets (with its own identifier, the IP header first).
ICMP_ECHO = {False: (8, 0), True: (128, 129)}  # ipv6 -> (request type, reply type)
ECHO_PAYLOAD = b"llamafleet-gate"


def icmp_checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(seq: int, ipv6: bool = False, ident: int = 0) -> bytes:
    """An ICMP(v6) echo request: IPv4 with its checksum (a raw socket sends it as it is); ICMPv6's checksum and a
    datagram socket's identifier are the kernel's."""
    kind, _reply = ICMP_ECHO[ipv6]
    header = struct.pack("!BBHHH", kind, 0, 0, ident & 0xFFFF, seq & 0xFFFF)
    if not ipv6:
        header = header[:2] + struct.pack("!H", icmp_checksum(header + ECHO_PAYLOAD)) + header[4:]
    return header + ECHO_PAYLOAD


def echo_reply_of(packet: bytes, ipv6: bool = False, with_ip_header: bool = False) -> tuple[int, int] | None:
    """(identifier, sequence) of an echo reply as a socket returns it (a raw IPv4 socket: the IP header first),
    None for anything else."""
    if with_ip_header:
        if not packet:
            return None
        packet = packet[(packet[0] & 0x0F) * 4:]
    _kind, reply = ICMP_ECHO[ipv6]
    if len(packet) < 8 or packet[0] != reply or packet[1] != 0:
        return None
    ident, seq = struct.unpack("!HH", packet[4:8])
    return ident, seq


def is_echo_reply(data: bytes, seq: int, ipv6: bool = False) -> bool:
    """True when ``data`` (as a datagram ICMP socket returns it, no IP header) is the reply to ``seq``."""
    got = echo_reply_of(data, ipv6)
    return got is not None and got[1] == seq & 0xFFFF


async def icmp_echo(address: str, timeout: float = PING_TIMEOUT, seq: int = 1) -> bool | None:
    """Ping ``address`` once: True on a reply within ``timeout``, False on none (or an ICMP error),
    None when this process may not open an ICMP datagram socket (see ping_group_range)."""
    loop = asyncio.get_running_loop()
    try:
        family, _type, _proto, _name, sockaddr = (await loop.getaddrinfo(address, None, type=socket.SOCK_DGRAM))[0]
        ipv6 = family == socket.AF_INET6
        sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6 if ipv6 else socket.IPPROTO_ICMP)
    except OSError:
        return None
    try:
        sock.setblocking(False)
        sock.connect(sockaddr)
        await loop.sock_sendall(sock, echo_request(seq, ipv6))
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            data = await asyncio.wait_for(loop.sock_recv(sock, 2048), deadline - loop.time())
            if is_echo_reply(data, seq, ipv6):
                return True
        return False
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        sock.close()


def ping_group_range(current: str, gid: int) -> tuple[str | None, str]:
    """``net.ipv4.ping_group_range`` that lets group ``gid`` open ICMP datagram sockets (the gate's ping), from
    the ``current`` "LOW HIGH": (None, why) when it already does or may not be changed safely, else (the value,
    what it does). Only an empty range (the kernel's "1 0", Debian 12's default) is changed, to the one group:
    widening a range someone set would let other groups in."""
    try:
        low, high = (int(word) for word in current.split())
    except ValueError:
        return None, "cannot read net.ipv4.ping_group_range %r" % current
    if low <= gid <= high:
        return None, "net.ipv4.ping_group_range %d-%d already lets group %d ping" % (low, high, gid)
    if low > high:
        return "%d %d" % (gid, gid), "net.ipv4.ping_group_range set to group %d alone (it was empty)" % gid
    return None, ("net.ipv4.ping_group_range %d-%d leaves out group %d and was set by someone: left as it is, so the "
                  "gate cannot ping the workers' hosts (a worker lost while llama-server waits for its answer is "
                  "found by the canary only)" % (low, high, gid))
