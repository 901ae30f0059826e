# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""llama.cpp's RPC protocol: its command table and framing, and a minimal client for the HELLO handshake.

Framing, as ggml/src/ggml-rpc/ggml-rpc.cpp defines it (llama.cpp 0c1e570; all integers little-endian):

- request: ``u8 command | u64 payload size | payload`` (the client's ``send_rpc_cmd``), :data:`HEADER`
- response: ``u64 payload size | payload`` (``send_msg``), :data:`REPLY_HEADER`

Which commands the server answers, and with how many bytes (``rpc_serve_client``), is
:data:`REPLY_SIZES`: GET_TENSOR answers as many bytes as its request asks for; FREE_BUFFER,
BUFFER_CLEAR, MEMSET_TENSOR, SET_TENSOR, INIT_TENSOR, GRAPH_COMPUTE and GRAPH_RECOMPUTE have no
reply at all. The client (one dispatcher thread per endpoint) sends the unanswered ones back to
back and blocks only on the next answered command, so a token's inputs (9 SET_TENSOR for gemma-3),
its GRAPH_COMPUTE (GRAPH_RECOMPUTE when the graph is reused) and the GET_TENSOR of its output
travel as one burst that ends in one round trip per device. The bench's proxy
(``llamafleet.bench.rpcproxy``) reads the stream with these.

The first command on every connection must be HELLO (command 14). In protocol
7 its payload is 24 bytes of transport capabilities (all zero: plain TCP) and
the answer is ``u8 major | u8 minor | u8 patch | u8 padding | 24 bytes of
capabilities``. Older servers (protocol 2 to 6) take an empty HELLO payload and
answer just the three version bytes; a server closes the connection without a
word when the request size is not the one it expects, so a silent close is
retried once in the old form.

rpc-server serves ONE client at a time (listen backlog 1) and aborts a client
that talks nonsense, so a probe connects, says HELLO, reads the answer and
closes at once. While a llama-server holds the connection, a probe waits in the
backlog and times out: that is reported as such, not as a dead server, and the
probe's connection is reset rather than closed (see _close: a closed one would
kill rpc-server later).

Stdlib only (module_utils shared with the ``llamafleet`` library as ``llamafleet.core.rpc_proto``; a host
script, and copied beside the bench's proxy on the orchestrator).
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable


class Cmd(enum.IntEnum):
    """enum rpc_cmd of ggml-rpc.cpp (llama.cpp 0c1e570), in its order (HELLO is 14 in every version)."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    NONE = 18  # client-side marker, never sent; the server hangs up on it


HELLO_CAPS_SIZE = 24
# Request header and reply header.
HEADER = struct.Struct("<BQ")
REPLY_HEADER = struct.Struct("<Q")
# struct rpc_tensor (packed, 296 bytes): id, type, buffer, ne[4], nb[4], op, op_params[16], flags,
# src[10], view_src, view_offs, data, name[64], use_count.
RPC_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
# GET_TENSOR request: rpc_tensor, offset, size (the size of the reply).
GET_TENSOR_REQ = struct.Struct("<%dsQQ" % RPC_TENSOR.size)

# Reply payload size of each answered command (rpc_serve_client); GET_TENSOR: see reply_size().
REPLY_SIZES: dict[Cmd, int] = {
    Cmd.HELLO: 4 + HELLO_CAPS_SIZE,  # major, minor, patch, padding, conn_caps[24]
    Cmd.DEVICE_COUNT: 4,
    Cmd.ALLOC_BUFFER: 16,  # remote_ptr, remote_size
    Cmd.GET_ALLOC_SIZE: 8,
    Cmd.GET_ALIGNMENT: 8,
    Cmd.GET_MAX_SIZE: 8,
    Cmd.BUFFER_GET_BASE: 8,
    Cmd.SET_TENSOR_HASH: 1,  # 1: the server had the data in its cache
    Cmd.COPY_TENSOR: 1,
    Cmd.GET_DEVICE_MEMORY: 16,  # free, total
}

# No HELLO answer is anywhere near this; a bigger size means the peer is not an rpc-server.
_MAX_HELLO_RESPONSE = 4096


class RPCError(Exception):
    """A HELLO probe failed. ``endpoint`` is ``host:port``."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__("%s: %s" % (endpoint, message))
        self.endpoint = endpoint
        self.reason = message


class RPCConnectError(RPCError):
    """No connection: refused, unreachable, or the name does not resolve."""


class RPCTimeout(RPCError):
    """No connection or no answer in time (the server may be busy with another client)."""


class RPCProtocolError(RPCError):
    """The peer answered, but not as a llama.cpp rpc-server would."""


class RPCClosed(RPCProtocolError):
    """The peer closed the connection without answering HELLO (wrong protocol, or shutting down)."""


@dataclass(frozen=True)
class HelloResult:
    """Outcome of wait_for_hello."""

    version: tuple[int, int, int]
    attempts: int
    elapsed: float


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets."""
    return "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)


def command_name(command: int) -> str:
    """``GRAPH_COMPUTE`` for 10; ``UNKNOWN_200`` for what is not a command."""
    try:
        return Cmd(command).name
    except ValueError:
        return "UNKNOWN_%d" % command


def reply_size(command: int, payload: bytes) -> int | None:
    """Payload size of the server's answer to a request, or None when it sends none."""
    if command == Cmd.GET_TENSOR:
        return GET_TENSOR_REQ.unpack(payload)[2]
    return REPLY_SIZES.get(command)  # type: ignore[call-overload]


def request_frame(command: int, payload: bytes = b"") -> bytes:
    """A request as the client sends it: ``u8 command | u64 size | payload``."""
    return HEADER.pack(command, len(payload)) + payload


@dataclass(frozen=True)
class Frame:
    """A request header: its command and payload size."""

    command: int
    size: int

    @property
    def name(self) -> str:
        return command_name(self.command)


class FrameParser:
    """Cuts the client->server byte stream into requests, whatever the read boundaries.

    ``feed`` returns pieces ``(frame, bytes)`` that concatenate to the input, in
    order: ``frame`` is set on the piece that begins with a complete request
    header, None on payload that continues the current request. A header split
    over reads is held back until it is complete. HELLO payloads (transport
    capabilities) come out as zeros.
    """

    def __init__(self) -> None:
        self._head = bytearray()
        self._left = 0
        self._command = -1

    def feed(self, data: bytes) -> list[tuple[Frame | None, bytes]]:
        pieces: list[tuple[Frame | None, bytes]] = []
        view = memoryview(data)
        while view:
            if self._left:
                take = min(self._left, len(view))
                body = bytes(take) if self._command == Cmd.HELLO else bytes(view[:take])
                pieces.append((None, body))
                self._left -= take
                view = view[take:]
                continue
            need = HEADER.size - len(self._head)
            self._head += view[:need]
            view = view[need:]
            if len(self._head) < HEADER.size:
                break
            command, size = HEADER.unpack(self._head)
            frame = Frame(command, size)
            self._command, self._left = command, size
            pieces.append((frame, bytes(self._head)))
            self._head.clear()
        return _merge(pieces)


def _merge(pieces: list[tuple[Frame | None, bytes]]) -> list[tuple[Frame | None, bytes]]:
    """Join each header piece with the payload pieces that follow it (fewer, larger sends)."""
    merged: list[tuple[Frame | None, bytes]] = []
    for frame, data in pieces:
        if frame is None and merged:
            merged[-1] = (merged[-1][0], merged[-1][1] + data)
        else:
            merged.append((frame, data))
    return merged


class HelloReplyFilter:
    """Passes the server->client stream through, with the HELLO answer's capabilities zeroed.

    The first reply on a connection answers HELLO: ``u64 size | major minor
    patch padding | conn_caps[24]`` (older servers: three version bytes only).
    """

    def __init__(self) -> None:
        self._pending: bytearray | None = bytearray()

    def feed(self, data: bytes) -> bytes:
        if self._pending is None:
            return data
        self._pending += data
        if len(self._pending) < REPLY_HEADER.size:
            return b""
        (size,) = REPLY_HEADER.unpack_from(self._pending)
        end = REPLY_HEADER.size + size
        if len(self._pending) < end:
            return b""
        out = self._pending
        self._pending = None
        caps_at = REPLY_HEADER.size + 4
        if size >= 4 + HELLO_CAPS_SIZE:
            out[caps_at:caps_at + HELLO_CAPS_SIZE] = bytes(HELLO_CAPS_SIZE)
        return bytes(out)


def hello_request(caps_size: int = HELLO_CAPS_SIZE) -> bytes:
    """The HELLO command as sent on the wire; ``caps_size=0`` gives the pre-7 form."""
    return request_frame(Cmd.HELLO, bytes(caps_size))


def parse_hello_payload(endpoint: str, payload: bytes) -> tuple[int, int, int]:
    """(major, minor, patch) from a HELLO answer's payload."""
    if len(payload) < 3:
        raise RPCProtocolError(endpoint, "HELLO answer of %d bytes is too short to hold a version" % len(payload))
    return payload[0], payload[1], payload[2]


def _recv_exactly(sock: socket.socket, count: int, endpoint: str, got_so_far: bytes = b"") -> bytes:
    data = bytearray(got_so_far)
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            if not data:
                raise RPCClosed(endpoint, "closed the connection without answering HELLO")
            raise RPCProtocolError(endpoint, "connection closed in the middle of the HELLO answer (after %r)"
                                   % bytes(data[:16]))
        data += chunk
    return bytes(data)


def _exchange(host: str, port: int, timeout: float, caps_size: int) -> tuple[int, int, int]:
    endpoint = format_endpoint(host, port)
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise RPCTimeout(endpoint, "no TCP connection within %.1fs (host down or traffic dropped?)" % timeout) from None
    except ConnectionRefusedError:
        raise RPCConnectError(endpoint, "connection refused: nothing listens there") from None
    except socket.gaierror as exc:
        raise RPCConnectError(endpoint, "cannot resolve host: %s" % exc.strerror) from None
    except OSError as exc:
        raise RPCConnectError(endpoint, "cannot connect: %s" % (exc.strerror or exc)) from None
    answered = False
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(hello_request(caps_size))
        header = _recv_exactly(sock, 8, endpoint)
        (size,) = REPLY_HEADER.unpack(header)
        if size > _MAX_HELLO_RESPONSE:
            raise RPCProtocolError(endpoint, "answered %r, which is not an RPC HELLO answer: "
                                   "is this port a llama.cpp rpc-server?" % header)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        version = parse_hello_payload(endpoint, _recv_exactly(sock, size, endpoint))
        answered = True
        return version
    except socket.timeout:
        raise RPCTimeout(endpoint, "connected, but no HELLO answer within %.1fs: rpc-server serves one client "
                         "at a time, so a connected llama-server (or a hung server) keeps probes waiting"
                         % timeout) from None
    except ConnectionResetError:
        raise RPCClosed(endpoint, "reset the connection without answering HELLO") from None
    except OSError as exc:
        raise RPCConnectError(endpoint, "connection failed during HELLO: %s" % (exc.strerror or exc)) from None
    finally:
        _close(sock, graceful=answered)


def _close(sock: socket.socket, graceful: bool) -> None:
    """Close a probe connection; abort it with a TCP reset unless the server has answered.

    A probe that gives up waiting (the server is busy with another client) leaves
    its HELLO queued. After a normal close, rpc-server later reads that HELLO and
    answers a peer that is gone: its first send succeeds, the second raises
    SIGPIPE, which kills rpc-server (seen with llama.cpp 0c1e570, which sends
    without MSG_NOSIGNAL). After a reset its first send fails with ECONNRESET
    instead, and it drops the connection and serves the next client.
    """
    try:
        if graceful:
            sock.shutdown(socket.SHUT_RDWR)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def rpc_hello(host: str, port: int, timeout: float = 5.0) -> tuple[int, int, int]:
    """Connect, say HELLO, return the server's RPC protocol version (major, minor, patch), close.

    :raises RPCConnectError: refused, unreachable, unresolvable.
    :raises RPCTimeout: no connection or no answer within ``timeout`` seconds.
    :raises RPCClosed: the peer hung up without answering (wrong protocol, or shutting down).
    :raises RPCProtocolError: the peer answered something that is not a HELLO answer.
    """
    try:
        return _exchange(host, port, timeout, HELLO_CAPS_SIZE)
    except RPCClosed as first:
        # Servers before protocol 7 expect an empty HELLO and hang up on anything else.
        try:
            return _exchange(host, port, timeout, 0)
        except RPCClosed:
            raise RPCClosed(first.endpoint, "%s (tried the protocol 7 and the older HELLO): not a llama.cpp "
                            "rpc-server, or one whose protocol this client does not know" % first.reason) from None


def wait_for_hello(host: str, port: int, timeout: float = 30.0, interval: float = 1.0,
                   attempt_timeout: float = 5.0, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> HelloResult:
    """Probe with rpc_hello until the server answers or ``timeout`` seconds have passed.

    Refused connections, timeouts and silent hang-ups are retried every
    ``interval`` seconds; a peer that answers something else than a HELLO
    answer fails at once. The last
    error is raised, with the number of attempts in its message.
    """
    start = clock()
    attempts = 0
    while True:
        attempts += 1
        remaining = timeout - (clock() - start)
        try:
            version = rpc_hello(host, port, max(0.1, min(attempt_timeout, remaining)))
            return HelloResult(version, attempts, clock() - start)
        except (RPCConnectError, RPCTimeout, RPCClosed) as exc:
            if clock() - start + interval >= timeout:
                raise type(exc)(exc.endpoint, "%s (gave up after %d attempt%s in %.0fs)"
                                % (exc.reason, attempts, "" if attempts == 1 else "s", clock() - start)) from None
        sleep(interval)


def main(argv: list[str] | None = None) -> int:
    """``python3 rpc_proto.py [--timeout S] HOST:PORT ...``: wait until every rpc-server answers HELLO.

    Installed on the orchestrator as the llama-server unit's ``ExecStartPre``,
    so llama-server (which aborts on a missing worker) starts only once every
    worker answers, also when systemd restarts it after a worker failure.
    """
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    timeout = 0.0
    if len(args) >= 2 and args[0] == "--timeout":
        timeout = float(args[1])
        args = args[2:]
    if not args:
        sys.stderr.write("usage: llamafleet-rpc-wait [--timeout SECONDS] HOST:PORT [HOST:PORT ...] (0 waits forever)\n")
        return 2
    for endpoint in args:
        host, _sep, port = endpoint.rpartition(":")
        while True:
            try:
                result = wait_for_hello(host, int(port), timeout=timeout or 3600.0)
                sys.stdout.write("%s answered HELLO: protocol %d.%d.%d\n" % ((endpoint,) + tuple(result.version)))
                sys.stdout.flush()
                break
            except RPCError as exc:
                if timeout:
                    sys.stderr.write("%s did not answer HELLO: %s\n" % (endpoint, exc))
                    return 1
                sys.stdout.write("still waiting for %s: %s\n" % (endpoint, exc))
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
