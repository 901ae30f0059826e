"""A blocking llama.cpp RPC client for the tests: it frames requests as llama-server does, to measure round trips
directly and through llamafleet.bench.rpcproxy (the delay the proxy really adds).  Test-only: the library ships none."""

from __future__ import annotations

import socket
import statistics
import struct
import time
from typing import Callable

from llamafleet.core import rpc_proto
from llamafleet.core.rpc_proto import (GET_TENSOR_REQ, REPLY_HEADER, REPLY_SIZES, RPC_TENSOR, Cmd, command_name,
                                       reply_size, request_frame)

# Bytes a GET_TENSOR / SET_TENSOR probe moves.
PROBE_BYTES = 4096


def set_tensor_payload(tensor: bytes, data: bytes, offset: int = 0) -> bytes:
    """SET_TENSOR's request payload: rpc_tensor, cache flag (0: do not write a cache file), offset, data."""
    return tensor + struct.pack("<BQ", 0, offset) + data


# --- measuring through a proxy --------------------------------------------------------------------

class RpcClient:
    """A blocking RPC client that frames requests as llama-server does (to measure round trips)."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.endpoint = rpc_proto.format_endpoint(host, port)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(rpc_proto.hello_request())
            self.version = rpc_proto.parse_hello_payload(self.endpoint, self._reply(REPLY_SIZES[Cmd.HELLO]))
        except BaseException:
            self.sock.close()
            raise

    def _reply(self, size: int) -> bytes:
        (got,) = REPLY_HEADER.unpack(self._read(REPLY_HEADER.size))
        if got != size:
            raise rpc_proto.RPCProtocolError(self.endpoint, "answered %d bytes where %d were due" % (got, size))
        return self._read(size)

    def _read(self, count: int) -> bytes:
        data = bytearray()
        while len(data) < count:
            chunk = self.sock.recv(count - len(data))
            if not chunk:
                raise rpc_proto.RPCClosed(self.endpoint, "closed the connection (it rejected a request)")
            data += chunk
        return bytes(data)

    def send(self, command: int, payload: bytes = b"") -> None:
        """Send a request without waiting (what an unanswered command is)."""
        self.sock.sendall(request_frame(command, payload))

    def call(self, command: int, payload: bytes = b"") -> bytes:
        """Send a request and return its answer's payload (None-answer commands: use send)."""
        size = reply_size(command, payload)
        if size is None:
            raise ValueError("%s has no answer: use send()" % command_name(command))
        self.send(command, payload)
        return self._reply(size)

    def alloc_tensor(self, nbytes: int, device: int = 0) -> bytes:
        """Allocate a buffer of ``nbytes`` on ``device``; an rpc_tensor (F32, 1-D) spanning it."""
        ptr, size = struct.unpack("<QQ", self.call(Cmd.ALLOC_BUFFER, struct.pack("<IQ", device, nbytes)))
        if not ptr or size < nbytes:
            raise rpc_proto.RPCProtocolError(self.endpoint, "could not allocate %d bytes" % nbytes)
        (base,) = struct.unpack("<Q", self.call(Cmd.BUFFER_GET_BASE, struct.pack("<Q", ptr)))
        n = nbytes // 4
        return RPC_TENSOR.pack(1, 0, ptr, n, 1, 1, 1, 4, 4 * n, 4 * n, 4 * n, 0, *([0] * 16), 0,
                               *([0] * 10), 0, 0, base, b"llamafleet-probe", 0)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _probe(client: RpcClient, command: int) -> Callable[[], object]:
    """One exchange that contains ``command`` and ends in an answer, so its round trip shows the delay."""
    alignment = struct.pack("<I", 0)

    def then_answered(send: Callable[[], None]) -> Callable[[], object]:
        return lambda: (send(), client.call(Cmd.GET_ALIGNMENT, alignment))

    if command in (Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE):
        # An empty graph on device 0 (device, n_nodes 0, n_tensors 0); RECOMPUTE re-runs the stored one.
        graph = struct.pack("<III", 0, 0, 0)
        client.send(Cmd.GRAPH_COMPUTE, graph)
        client.call(Cmd.GET_ALIGNMENT, alignment)
        payload = graph if command == Cmd.GRAPH_COMPUTE else alignment
        return then_answered(lambda: client.send(command, payload))
    if command in (Cmd.GET_TENSOR, Cmd.SET_TENSOR):
        tensor = client.alloc_tensor(PROBE_BYTES)
        if command == Cmd.GET_TENSOR:
            request = GET_TENSOR_REQ.pack(tensor, 0, PROBE_BYTES)
            return lambda: client.call(Cmd.GET_TENSOR, request)
        data = set_tensor_payload(tensor, bytes(PROBE_BYTES))
        return then_answered(lambda: client.send(Cmd.SET_TENSOR, data))
    if command in (Cmd.GET_ALIGNMENT, Cmd.GET_MAX_SIZE, Cmd.GET_DEVICE_MEMORY, Cmd.DEVICE_COUNT):
        payload = b"" if command == Cmd.DEVICE_COUNT else alignment  # device 0
        return lambda: client.call(command, payload)
    raise ValueError("no probe for %s" % command_name(command))


def measure_round_trip(host: str, port: int, command: int = Cmd.GRAPH_COMPUTE, samples: int = 20,
                       timeout: float = 10.0, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of ``samples`` round trips of an exchange holding ``command``, on one fresh connection.

    GRAPH_COMPUTE / GRAPH_RECOMPUTE (an empty graph) and SET_TENSOR have no
    answer: each is followed by GET_ALIGNMENT, whose answer comes back once the
    server has taken the command. GET_TENSOR reads 4 KiB of a buffer allocated for
    the purpose. Through a proxy minus straight to the server (or armed minus
    disarmed), the medians differ by the delay the proxy adds.
    """
    with RpcClient(host, port, timeout) as client:
        exchange = _probe(client, command)
        out = []
        for _sample in range(samples):
            start = clock()
            exchange()
            out.append(clock() - start)
        return out


def added_delay_ms(baseline: list[float], delayed: list[float]) -> float:
    """Median round trip with the delay minus without it, in milliseconds."""
    return 1000.0 * (statistics.median(delayed) - statistics.median(baseline))


# --- command line ---------------------------------------------------------------------------------
