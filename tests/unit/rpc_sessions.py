"""Recorded rpc-server sessions (tests/unit/fixtures/rpc) and a synthetic one, for the tests of rpc_proto's stream
readers and of the bench proxy that uses them."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

from llamafleet.core import rpc_proto
from llamafleet.core.rpc_proto import Cmd, request_frame

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "rpc"


def tensor(data: int = 0x1000, n: int = 16) -> bytes:
    return rpc_proto.RPC_TENSOR.pack(1, 0, 0x1000, n, 1, 1, 1, 4, 4 * n, 4 * n, 4 * n, 0, *([0] * 16), 0,
                                     *([0] * 10), 0, 0, data, b"t", 0)


# A session as llama-server frames it: HELLO (with RDMA capabilities), the device queries of a load,
# a weight upload, then one token: input, compute, output.
SESSION = [
    (Cmd.HELLO, bytes(range(100, 124))),
    (Cmd.DEVICE_COUNT, b""),
    (Cmd.GET_DEVICE_MEMORY, struct.pack("<I", 0)),
    (Cmd.GET_ALIGNMENT, struct.pack("<I", 0)),
    (Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096)),
    (Cmd.BUFFER_GET_BASE, struct.pack("<Q", 0x1000)),
    (Cmd.SET_TENSOR, tensor() + struct.pack("<BQ", 0, 0) + bytes(range(256)) * 4),
    (Cmd.GRAPH_COMPUTE, struct.pack("<III", 0, 0, 0)),
    (Cmd.GET_TENSOR, rpc_proto.GET_TENSOR_REQ.pack(tensor(), 0, 64)),
]


def session_bytes() -> bytes:
    return b"".join(request_frame(c, p) for c, p in SESSION)


def splits(data: bytes, how: str) -> list[bytes]:
    if how == "whole":
        return [data]
    if how == "bytes":
        return [data[i:i + 1] for i in range(len(data))]
    rnd, out, i = random.Random(7), [], 0
    while i < len(data):
        step = rnd.randint(1, 40)
        out.append(data[i:i + step])
        i += step
    return out


SESSIONS = json.loads((FIXTURES / "llama-server_0c1e570_gemma270m_sessions_real.json").read_text())["sessions"]
MODEL_SESSION = SESSIONS[13]


def payload(frame: list[int], cap: int | None = None) -> bytes:
    """A recorded request's payload rebuilt: zeros, GET_TENSOR asking for its recorded size (both capped)."""
    command, size = frame[:2]
    if command == Cmd.GET_TENSOR:
        return rpc_proto.GET_TENSOR_REQ.pack(bytes(296), 0, min(frame[2], cap or frame[2]))
    return bytes(min(size, cap or size))


def model_session_stream(cap: int | None = None, chunk: int = 100_003):
    """The recorded model session's client stream, rebuilt lazily and cut into reads of ``chunk`` bytes."""
    pending = bytearray()
    for frame in MODEL_SESSION["frames"]:
        body = payload(frame, cap)
        pending += rpc_proto.HEADER.pack(frame[0], len(body))
        for at in range(0, len(body), 1 << 20):
            pending += body[at:at + (1 << 20)]
            while len(pending) >= chunk:
                yield bytes(pending[:chunk])
                del pending[:chunk]
    if pending:
        yield bytes(pending)
