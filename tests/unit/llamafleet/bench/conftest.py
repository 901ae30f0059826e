"""Fixtures of the bench tests: a fake rpc-server and a fake streaming llama-server.

``FakeRpcServer`` is written from ggml-rpc.cpp's rpc_serve_client (llama.cpp
0c1e570): it answers the commands a real server answers, with payloads of the
sizes the source sends, and records every byte it receives. It is independent of
the proxy's own tables on purpose: a wrong entry there must not be copied here.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

# command number -> answer payload size (None: no answer; -1: GET_TENSOR, as many bytes as asked).
ANSWERS = {
    0: 16,    # ALLOC_BUFFER: remote_ptr, remote_size
    1: 8,     # GET_ALIGNMENT
    2: 8,     # GET_MAX_SIZE
    3: 8,     # BUFFER_GET_BASE
    4: None,  # FREE_BUFFER
    5: None,  # BUFFER_CLEAR
    6: None,  # SET_TENSOR
    7: 1,     # SET_TENSOR_HASH
    8: -1,    # GET_TENSOR
    9: 1,     # COPY_TENSOR
    10: None,  # GRAPH_COMPUTE
    11: 16,   # GET_DEVICE_MEMORY
    12: None,  # INIT_TENSOR
    13: 8,    # GET_ALLOC_SIZE
    14: 28,   # HELLO: version, padding, conn_caps[24]
    15: 4,    # DEVICE_COUNT
    16: None,  # GRAPH_RECOMPUTE
    17: None,  # MEMSET_TENSOR
}
SERVER_CAPS = bytes(range(1, 25))  # what an RDMA-capable server would put in its HELLO answer


def _recv(conn: socket.socket, count: int) -> bytes | None:
    data = bytearray()
    while len(data) < count:
        chunk = conn.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


class FakeRpcServer:
    """Listens on 127.0.0.1; serves connections one after the other, like rpc-server."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.commands: list[int] = []
        self.ends: list[str] = []  # how each connection ended: "eof", "reset"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.ends.append(self._session(conn))

    def _session(self, conn: socket.socket) -> str:
        try:
            while True:
                head = _recv(conn, 9)
                if head is None:
                    return "eof"
                command, size = struct.unpack("<BQ", head)
                payload = _recv(conn, size) if size else b""
                if payload is None:
                    return "eof"
                self.received += head + payload
                self.commands.append(command)
                answer = ANSWERS.get(command)
                if command == 14:
                    conn.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + SERVER_CAPS)
                elif answer == -1:
                    want = struct.unpack_from("<Q", payload, len(payload) - 8)[0]
                    conn.sendall(struct.pack("<Q", want) + bytes(want))
                elif command in (0, 3):  # a buffer at 0x1000 of the asked size; its base
                    conn.sendall(struct.pack("<QQQ", 16, 0x1000, struct.unpack_from("<Q", payload, 4)[0])
                                 if command == 0 else struct.pack("<QQ", 8, 0x1000))
                elif answer is not None:
                    conn.sendall(struct.pack("<Q", answer) + bytes(answer))
        except ConnectionResetError:
            return "reset"

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self.sock.close()
        self._thread.join(5)


@pytest.fixture
def fake_rpc() -> Iterator[FakeRpcServer]:
    server = FakeRpcServer()
    yield server
    server.close()


UNAUTHORIZED = b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'


class SseServer:
    """Streams recorded server-sent events as llama-server does (chunked, one write per event).

    ``body``: the recorded stream; it is cut into events at blank lines and sent
    ``first_delay`` seconds after the request, then one event every ``gap``
    seconds. ``status``/``error_body`` answer every request with an error instead;
    ``api_key`` makes requests without ``Authorization: Bearer <key>`` fail with 401.
    """

    def __init__(self, body: str = "", first_delay: float = 0.0, gap: float = 0.0, status: int = 200,
                 error_body: bytes = b"", api_key: str = "") -> None:
        self.events = [e + "\n\n" for e in body.split("\n\n") if e]
        self.first_delay, self.gap, self.api_key = first_delay, gap, api_key
        self.status, self.error_body = status, error_body
        self.requests: list[tuple[str, dict, dict]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, dict(self.headers), body))
                status, payload = server.status, server.error_body
                if server.api_key and self.headers.get("Authorization") != "Bearer " + server.api_key:
                    status, payload = 401, UNAUTHORIZED
                if status != 200:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                time.sleep(server.first_delay)
                for i, event in enumerate(server.events):
                    if i:
                        time.sleep(server.gap)
                    data = event.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def sse_server() -> Iterator[Callable[..., SseServer]]:
    made: list[SseServer] = []

    def make(**kw: Any) -> SseServer:
        made.append(SseServer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
