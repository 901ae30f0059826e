"""A TCP link probe that runs on the fleet's hosts, in their own python3 (standard library only).

``llamafleet probe`` sends this file's source as ``python3 -c SOURCE MODE ...``:
``sink ADDRESS PORT`` on a worker accepts one connection, counts the bytes it
receives and answers their number; ``send ADDRESS PORT MEGABYTES`` on the
orchestrator connects (retrying while the sink starts), sends, and prints one
JSON line: ``{"connect_ms": ..., "bytes": ..., "seconds": ...}``.
Nothing here may import from llamafleet: the hosts do not have it.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def sink(address: str, port: int, timeout: float = 30.0) -> int:
    """Accept one connection on ``address:port``, count its bytes, send the count back; the count."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((address, port))
        server.listen(1)
        server.settimeout(timeout)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            received = 0
            while True:
                block = conn.recv(CHUNK)
                if not block:
                    break
                received += len(block)
            conn.sendall(str(received).encode())
    return received


def connect(address: str, port: int, wait: float = 5.0) -> tuple[socket.socket, float]:
    """A connection to ``address:port``, retried for ``wait`` seconds; and the seconds it took."""
    started = time.perf_counter()
    while True:
        try:
            return socket.create_connection((address, port), timeout=5), time.perf_counter() - started
        except OSError:
            if time.perf_counter() - started > wait:
                raise
            time.sleep(0.1)


def send(address: str, port: int, megabytes: int, wait: float = 5.0) -> dict:
    """Send ``megabytes`` MiB to a sink; connect time, bytes the sink counted, seconds to send them."""
    conn, connect_s = connect(address, port, wait)
    with conn:
        conn.settimeout(120)
        buf = b"x" * CHUNK
        started = time.perf_counter()
        for _ in range(megabytes):
            conn.sendall(buf)
        conn.shutdown(socket.SHUT_WR)
        counted = int(conn.recv(64) or b"0")
        seconds = time.perf_counter() - started
    return {"connect_ms": connect_s * 1000, "bytes": counted, "seconds": seconds}


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "sink":
        print(json.dumps({"bytes": sink(argv[1], int(argv[2]))}))
        return 0
    if len(argv) == 4 and argv[0] == "send":
        print(json.dumps(send(argv[1], int(argv[2]), int(argv[3]))))
        return 0
    print("usage: sink ADDRESS PORT | send ADDRESS PORT MEGABYTES", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
