# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A TCP proxy in front of an rpc-server that adds latency to chosen llama.cpp RPC commands.

    python -m llamafleet.bench.rpcproxy --listen 127.0.0.1:50100 --upstream 10.0.0.2:50052 \\
        --delay-ms 10 --mode compute [--rate-mbit 1000] [--armed] [--stats /run/llamafleet-bench/proxy-0.json]

llama-server is pointed at ``--listen`` (``--rpc 127.0.0.1:50100``) instead of
the rpc-server. The proxy does not need llamafleet installed on the host: the bench
role copies it and ``rpc_proto.py`` under their library names (``llamafleet/bench/``,
``llamafleet/core/``, namespace packages) and runs ``python3 -m llamafleet.bench.rpcproxy``
with that folder on PYTHONPATH.

The wire format, the command table, which commands are answered with how many bytes, and the
readers of both directions of the stream (FrameParser, HelloReplyFilter) are rpc_proto's
(``llamafleet.core.rpc_proto``).

Delay model
-----------
The client->server stream is parsed frame by frame. Once armed, a frame whose
command the mode delays is forwarded ``--delay-ms`` after its header arrived;
every frame keeps its place in the stream, so what comes behind a delayed frame
waits for it. This is a delay line (like ``tc netem delay`` on one direction),
not a sleep per command: commands sent back to back share the delay as they
would share a real link's latency. The round trip of a delayed answered command
grows by ``--delay-ms``, and so does the round trip of the first answered command
behind a delayed unanswered one (GRAPH_COMPUTE has no reply: its delay shows in
the GET_TENSOR that follows). ``--delay-ms`` is therefore the added round-trip
time: to emulate a one-way link latency L, pass 2 × L. The server->client stream
is piped untouched except for HELLO (below).

Modes: ``compute`` delays GRAPH_COMPUTE and GRAPH_RECOMPUTE; ``transfer`` those
and GET_TENSOR and SET_TENSOR; ``all`` every command.

Bandwidth cap
-------------
``--rate-mbit R`` (0, the default: no cap) limits each direction of every
relayed connection to R megabits per second (1 Mbit = 10^6 bits), as a ``tc
tbf`` on the link would: a token bucket per direction and connection, filled at
R, holding at most ``max(64 KiB, R × 10 ms)`` (the burst), and bytes are
forwarded in slices of at most 64 KiB, each once the bucket holds it. Unlike the
delay, the cap applies from the start, armed or not: a link's bandwidth also
limits the model load (weights travel as SET_TENSOR). It composes with the
delay line: a delayed frame leaves the line at its time and is then paced like
any other byte; the order of the stream never changes.

HELLO carries 24 bytes of transport capabilities each way (RDMA parameters when
both sides were built with GGML_RPC_RDMA). The proxy zeroes them in both
directions (rpc_proto's FrameParser and HelloReplyFilter) so the two ends stay on the TCP
connection it relays: an RDMA link would bypass it.

Control (what a transient systemd unit can take: ``systemctl kill -s SIGUSR1 UNIT``)
------------------------------------------------------------------------------------
- starts disarmed (model loading is not distorted) unless ``--armed``;
- SIGUSR1 arms, SIGUSR2 disarms; SIGHUP writes the stats file now;
- SIGTERM / SIGINT: write the stats file and exit 0.

Stats: ``--stats FILE`` is rewritten atomically (temporary file + rename) on
every arm and disarm, on SIGHUP, at exit and every ``--stats-interval`` seconds
while anything changed: bytes each way, connections, and per command the count,
the payload bytes and how many were delayed (see ``Stats.snapshot``). SET_TENSOR
payload bytes counted up to the end of the load are the weights sent to this
worker (those its cache had, answered by SET_TENSOR_HASH, are not sent).

Connections are relayed independently (rpc-server itself serves one at a time;
a HELLO probe waits in its backlog as it would without the proxy). llama-server
opens one short connection per device query before the connection that loads
and serves the model (13 in all for one endpoint at 0c1e570, see
tests/unit/fixtures/rpc/README.md). A client that resets its connection gets
the upstream connection reset too, a client that closes gets it closed after
everything it sent was forwarded.

tests/rpc_client.py speaks the protocol as llama-server does, to measure through
a proxy the delay it really adds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from llamafleet.core.rpc_proto import Cmd, Frame, FrameParser, HelloReplyFilter, format_endpoint, reply_size


MODES: dict[str, frozenset[int]] = {
    "compute": frozenset({Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE}),
    "transfer": frozenset({Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE, Cmd.GET_TENSOR, Cmd.SET_TENSOR}),
    "all": frozenset(Cmd),
}

CHUNK = 256 * 1024
# At most this many chunks wait in the delay line of one connection (backpressure beyond).
QUEUE_CHUNKS = 64
# Bandwidth cap: bytes forwarded at once at most, and the seconds of rate the bucket holds beyond that.
RATE_SLICE = 64 * 1024
RATE_BURST_S = 0.010


def delayed_commands(mode: str) -> frozenset[int]:
    """The commands a mode delays; ValueError naming the modes for an unknown one."""
    try:
        return MODES[mode]
    except KeyError:
        raise ValueError("unknown mode %r: use one of %s" % (mode, ", ".join(MODES))) from None


def rate_burst(rate_mbit: float) -> int:
    """Bytes a bucket of ``rate_mbit`` holds: one slice, or ``RATE_BURST_S`` of the rate when that is more."""
    return max(RATE_SLICE, int(rate_mbit * 1e6 / 8 * RATE_BURST_S))


class TokenBucket:
    """A token bucket of ``rate_mbit`` megabits per second (1 Mbit = 10^6 bits), full at the start.

    ``take(n)`` charges ``n`` bytes and returns the seconds to wait before
    sending them: 0 while the bucket holds them, else until it has refilled to
    them (the bucket then stands at 0). Idle time refills it up to ``burst``
    bytes only. A caller that sleeps longer than asked gets the excess back as
    tokens (up to the burst), so oversleeping does not lower the long-run rate.
    """

    def __init__(self, rate_mbit: float, burst: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(rate_mbit) and rate_mbit > 0):
            raise ValueError("a token bucket needs a rate above 0, not %r" % rate_mbit)
        self.rate = rate_mbit * 1e6 / 8  # bytes per second
        self.burst = rate_burst(rate_mbit) if burst is None else burst
        self.clock = clock
        self._tokens = float(self.burst)
        self._stamp = clock()

    def take(self, nbytes: int) -> float:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate) - nbytes
        self._stamp = now
        return -self._tokens / self.rate if self._tokens < 0 else 0.0


class Stats:
    """Counters of a proxy, safe to update from every connection's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self.bytes_to_upstream = 0
        self.bytes_to_client = 0
        self.connections = 0
        self.active_connections = 0
        self.delayed = 0
        self.held_s = 0.0
        self.rate_wait_s = 0.0
        self.commands: dict[str, list[int]] = {}

    def count(self, frame: Frame, delayed: bool) -> None:
        with self._lock:
            entry = self.commands.setdefault(frame.name, [0, 0, 0])
            entry[0] += 1
            entry[1] += frame.size
            entry[2] += int(delayed)
            self.version += 1

    def add(self, **deltas: float) -> None:
        """Add to counters by name (``bytes_to_upstream=n``, ``held_s=s``, ...)."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)
            self.version += 1

    def snapshot(self) -> dict:
        """Counters as JSON-ready data.

        ``held_ms_mean``: the mean time delayed frames waited in the delay line;
        ``rate_wait_ms``: the total time forwarding (both directions, every
        connection) waited for the bandwidth cap.
        """
        with self._lock:
            return {
                "bytes_to_upstream": self.bytes_to_upstream,
                "bytes_to_client": self.bytes_to_client,
                "connections": self.connections,
                "active_connections": self.active_connections,
                "delayed_commands": self.delayed,
                "held_ms_mean": round(1000 * self.held_s / self.delayed, 3) if self.delayed else None,
                "rate_wait_ms": round(1000 * self.rate_wait_s, 3),
                "commands": {name: {"count": c, "payload_bytes": b, "delayed": d}
                             for name, (c, b, d) in sorted(self.commands.items())},
            }


_EOF = "eof"
_RESET = "reset"


def _abort(sock: socket.socket) -> None:
    """Make the coming close() a TCP reset, and wake any thread blocked reading ``sock``."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


class _Link:
    """One client connection relayed to its own upstream connection (three threads)."""

    def __init__(self, proxy: RpcProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.lines: queue.Queue = queue.Queue(maxsize=QUEUE_CHUNKS)

    def _forward(self, sock: socket.socket, data: bytes, bucket: TokenBucket | None) -> float:
        """sendall ``data`` to ``sock``, in slices paced by ``bucket`` (None: at once); seconds it waited."""
        if bucket is None:
            sock.sendall(data)
            return 0.0
        waited, view = 0.0, memoryview(data)
        for at in range(0, len(view), RATE_SLICE):
            piece = view[at:at + RATE_SLICE]
            wait = bucket.take(len(piece))
            if wait > 0:
                self.proxy.sleep(wait)
                waited += wait
            sock.sendall(piece)
        return waited

    def run(self) -> None:
        proxy, client = self.proxy, self.client
        try:
            upstream = socket.create_connection(proxy.upstream, timeout=proxy.connect_timeout)
        except OSError as exc:
            proxy.log("cannot connect to upstream %s: %s" % (format_endpoint(*proxy.upstream), exc))
            _abort(client)
            client.close()
            return
        upstream.settimeout(None)
        client.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        proxy.stats.add(connections=1, active_connections=1)
        threads = [threading.Thread(target=self._write_up, args=(upstream,), daemon=True),
                   threading.Thread(target=self._pump_down, args=(upstream,), daemon=True)]
        for thread in threads:
            thread.start()
        self._read_up()
        for thread in threads:
            thread.join()
        upstream.close()
        client.close()
        proxy.stats.add(active_connections=-1)

    def _read_up(self) -> None:
        """Client -> delay line: parse frames, stamp what each read brought with the time it may leave.

        A read becomes at most two items: what comes before its first delayed
        frame leaves now, the rest (which must stay behind that frame) after the delay.
        """
        proxy, parser = self.proxy, FrameParser()
        end = _EOF
        try:
            while True:
                data = self.client.recv(CHUNK)
                if not data:
                    break
                now = proxy.clock()
                parts: tuple[list[bytes], list[bytes]] = ([], [])
                delayed = 0
                for frame, piece in parser.feed(data):
                    if frame is not None:
                        held = proxy.delays(frame.command)
                        proxy.stats.count(frame, held)
                        delayed += held
                    parts[delayed > 0].append(piece)
                if parts[0]:
                    self.lines.put((now, b"".join(parts[0]), 0, now))
                if parts[1]:
                    self.lines.put((now + proxy.delay_s, b"".join(parts[1]), delayed, now))
        except OSError:
            end = _RESET
        self.lines.put(end)

    def _write_up(self, upstream: socket.socket) -> None:
        """Delay line -> upstream, each piece at its time, then paced; the client's close or reset passed on."""
        proxy, broken, bucket = self.proxy, False, self.proxy.bucket()
        while True:
            item = self.lines.get()
            if item == _EOF:
                _shutdown(upstream, socket.SHUT_WR)
                return
            if item == _RESET:
                _abort(upstream)
                return
            if broken:
                continue  # upstream is gone: drain so the reader never blocks
            due, piece, delayed, arrived = item
            wait = due - proxy.clock()
            if wait > 0:
                proxy.sleep(wait)
            held_s = delayed * (proxy.clock() - arrived)
            try:
                paced_s = self._forward(upstream, piece, bucket)
            except OSError:
                broken = True
                _abort(self.client)
                continue
            proxy.stats.add(bytes_to_upstream=len(piece), delayed=delayed, held_s=held_s, rate_wait_s=paced_s)

    def _pump_down(self, upstream: socket.socket) -> None:
        """Upstream -> client as bytes (HELLO's capabilities zeroed), paced; the server's close or reset passed on."""
        reply, client_gone, bucket = HelloReplyFilter(), False, self.proxy.bucket()
        try:
            while True:
                data = upstream.recv(CHUNK)
                if not data:
                    break
                out = reply.feed(data)
                if out and not client_gone:
                    try:
                        paced_s = self._forward(self.client, out, bucket)
                        self.proxy.stats.add(bytes_to_client=len(out), rate_wait_s=paced_s)
                    except OSError:
                        client_gone = True
        except OSError:
            _abort(self.client)
            return
        _shutdown(self.client, socket.SHUT_RDWR)


def parse_address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) as a (host, port) pair; ValueError naming ``what`` otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("%s %r is not HOST:PORT" % (what, text))
    return host, int(port)


class RpcProxy:
    """Listens on ``listen`` and relays every connection to ``upstream`` through a delay line.

    ``rate_mbit`` above 0 caps each direction of every connection to that many
    megabits per second, armed or not (see "Bandwidth cap").
    """

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], delay_ms: float, mode: str,
                 armed: bool = False, connect_timeout: float = 10.0,
                 log: Callable[[str], None] | None = None, rate_mbit: float = 0.0) -> None:
        if not (math.isfinite(delay_ms) and delay_ms >= 0):
            raise ValueError("--delay-ms must be a number of 0 or more, not %r" % delay_ms)
        if not (math.isfinite(rate_mbit) and rate_mbit >= 0):
            raise ValueError("--rate-mbit must be a number of 0 (no cap) or more, not %r" % rate_mbit)
        self.rate_mbit = rate_mbit
        self._delayed = delayed_commands(mode)
        self.mode = mode
        self.delay_s = delay_ms / 1000.0
        self.upstream = upstream
        self.connect_timeout = connect_timeout
        self.armed = armed
        self.stats = Stats()
        self.clock: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], None] = time.sleep
        self.log = log or (lambda line: None)
        try:
            self._server = socket.create_server(listen, backlog=16)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError("cannot listen on %s: %s" % (format_endpoint(*listen), reason)) from None
        self._server.settimeout(0.2)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where the proxy listens (the real port when 0 was asked)."""
        host, port = self._server.getsockname()[:2]
        return host, port

    def bucket(self) -> TokenBucket | None:
        """A fresh token bucket for one direction of one connection; None without a cap."""
        return TokenBucket(self.rate_mbit, clock=self.clock) if self.rate_mbit else None

    def delays(self, command: int) -> bool:
        """Whether a request with this command is delayed now."""
        return self.armed and command in self._delayed

    def arm(self, armed: bool = True) -> None:
        """Start (or with False stop) delaying."""
        self.armed = armed
        self.stats.add()  # a change worth writing out
        if armed:
            self.log("armed: delaying %s commands by %.1f ms" % (self.mode, self.delay_s * 1000))
        else:
            self.log("disarmed")

    def describe(self) -> dict:
        """Configuration and counters, as the stats file holds them."""
        return {"listen": format_endpoint(*self.address),
                "upstream": format_endpoint(*self.upstream), "mode": self.mode,
                "delay_ms": self.delay_s * 1000, "rate_mbit": self.rate_mbit, "armed": self.armed,
                "pid": os.getpid(), "written_at": time.time(), **self.stats.snapshot()}

    def serve_forever(self) -> None:
        """Accept and relay connections (each on its own threads) until close()."""
        while not self._closed.is_set():
            try:
                client, peer = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                raise
            self.log("connection from %s" % format_endpoint(*peer[:2]))
            threading.Thread(target=_Link(self, client).run, daemon=True).start()

    def start(self) -> RpcProxy:
        """serve_forever on a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting (relayed connections end with their peers)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        self._server.close()

    def __enter__(self) -> RpcProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (readers never see half)."""
    tmp = path.with_name(".%s.%d.tmp" % (path.name, os.getpid()))
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llamafleet.bench.rpcproxy",
        description="Relay llama.cpp RPC to an rpc-server, adding a delay to chosen commands once armed "
                    "(SIGUSR1 arms, SIGUSR2 disarms, SIGHUP writes the stats file), optionally capping "
                    "the bandwidth.")
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept llama-server's connection on")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the rpc-server")
    parser.add_argument("--delay-ms", type=float, required=True,
                        help="added round-trip time per delayed command (2 x a one-way link latency)")
    parser.add_argument("--mode", choices=sorted(MODES), required=True,
                        help="compute: GRAPH_COMPUTE/RECOMPUTE; transfer: also GET/SET_TENSOR; all: every command")
    parser.add_argument("--rate-mbit", type=float, default=0.0,
                        help="cap each direction of every connection to this many Mbit/s (10^6 bits), "
                             "from the start, armed or not (0, the default: no cap)")
    parser.add_argument("--armed", action="store_true", help="delay from the start (default: wait for SIGUSR1)")
    parser.add_argument("--stats", type=Path, help="JSON file for the counters (rewritten atomically)")
    parser.add_argument("--stats-interval", type=float, default=1.0, help="seconds between stats writes (1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the proxy until SIGTERM or SIGINT; 2 for bad arguments, 1 when it cannot listen."""
    parser = build_parser()
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        sys.stderr.write("rpcproxy %s -> %s: %s\n" % (args.listen, args.upstream, line))
        sys.stderr.flush()

    try:
        if not (math.isfinite(args.stats_interval) and args.stats_interval > 0):
            raise ValueError("--stats-interval must be a number of seconds above 0")
        proxy = RpcProxy(parse_address(args.listen, "--listen"), parse_address(args.upstream, "--upstream"),
                         args.delay_ms, args.mode, armed=args.armed, log=log, rate_mbit=args.rate_mbit)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:
        log(str(exc))
        return 1
    control_loop(proxy, args.stats, args.stats_interval)
    return 0


def control_loop(proxy: RpcProxy, stats_path: Path | None, interval: float) -> None:
    """Serve with the signal controls installed until SIGTERM/SIGINT (main thread only)."""
    wake = threading.Event()
    pending: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        pending.append(signum)
        wake.set()

    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    proxy.start()
    proxy.log("listening on %s, %s, delay %.1f ms, mode %s, %s" % (
        format_endpoint(*proxy.address), "armed" if proxy.armed else "disarmed",
        proxy.delay_s * 1000, proxy.mode,
        "rate %g Mbit/s" % proxy.rate_mbit if proxy.rate_mbit else "no rate cap"))
    written, stop = -1, False
    while not stop:
        wake.wait(interval)
        wake.clear()
        force = bool(pending)
        while pending:
            signum = pending.pop(0)
            if signum in (signal.SIGUSR1, signal.SIGUSR2):
                proxy.arm(signum == signal.SIGUSR1)
            elif signum in (signal.SIGTERM, signal.SIGINT):
                stop = True
        if stats_path is not None and (force or proxy.stats.version != written):
            written = proxy.stats.version
            write_json_atomic(stats_path, proxy.describe())
    proxy.close()
    proxy.log("stopped")


if __name__ == "__main__":
    raise SystemExit(main())
