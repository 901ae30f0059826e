"""rpc_hello module: argument handling and results, against a fake protocol-7 server."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any, Iterator

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import rpc_hello
from tests.unit.module_runner import run_main


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(rpc_hello.main, args, capsys)


@pytest.fixture
def server() -> Iterator[int]:
    """A fake rpc-server that answers HELLO with protocol 7.1.2."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            with conn:
                data = b""
                while len(data) < 33:
                    chunk = conn.recv(33 - len(data))
                    if not chunk:
                        break
                    data += chunk
                if len(data) == 33:
                    conn.sendall(struct.pack("<Q", 28) + bytes([7, 1, 2, 0]) + bytes(24))

    threading.Thread(target=loop, daemon=True).start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()


@pytest.mark.parametrize("check_mode", [False, True])
def test_answers(server: int, capsys: pytest.CaptureFixture[str], check_mode: bool) -> None:
    args = {"host": "127.0.0.1", "port": server, "timeout": 5, "expect_major": 7, "_ansible_check_mode": check_mode}
    rc, result = run_module(args, capsys)
    assert rc == 0
    assert result["changed"] is False
    assert (result["version"], result["major"], result["minor"], result["patch"]) == ("7.1.2", 7, 1, 2)
    assert result["endpoint"] == "127.0.0.1:%d" % server and result["attempts"] == 1


def test_no_recorded_major_is_not_compared(server: int, capsys: pytest.CaptureFixture[str]) -> None:
    """The roles pass the build's recorded protocol, None when the source declared none."""
    rc, result = run_module({"host": "127.0.0.1", "port": server, "timeout": 5, "expect_major": None}, capsys)
    assert rc == 0 and result["major"] == 7


def test_wrong_major(server: int, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"host": "127.0.0.1", "port": server, "expect_major": 8}, capsys)
    assert rc == 1 and result["failed"]
    assert result["msg"].startswith("rpc-server at 127.0.0.1:%d speaks RPC protocol 7.1.2, expected major version 8"
                                    % server)


def test_nothing_listening(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rc, result = run_module({"host": "127.0.0.1", "port": port, "timeout": 1.5}, capsys)
    assert rc == 1
    assert "rpc-server at 127.0.0.1:%d did not answer HELLO: connection refused" % port in result["msg"]
    assert "gave up after" in result["msg"]


def test_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"host": "127.0.0.1", "port": 70000}, capsys)
    assert rc == 1 and "port 70000 is not a TCP port" in result["msg"]
