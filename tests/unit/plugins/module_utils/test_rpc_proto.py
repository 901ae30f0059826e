"""RPC HELLO client against small fake servers that behave like rpc-server (and like things that are not)."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Callable, Iterator

import pytest

from llamafleet.core import rpc_proto
from llamafleet.core.rpc_proto import Cmd, FrameParser, HelloReplyFilter, reply_size, request_frame
from tests.unit.rpc_sessions import (MODEL_SESSION, SESSION, SESSIONS, model_session_stream, payload, session_bytes,
                                     splits)
from llamafleet.core.rpc_proto import (
    HelloResult,
    RPCClosed,
    RPCConnectError,
    RPCProtocolError,
    RPCTimeout,
    format_endpoint,
    hello_request,
    rpc_hello,
    wait_for_hello,
)


def test_hello_request_bytes() -> None:
    # | cmd 14 | u64 LE size 24 | 24 zero bytes of transport caps |
    assert hello_request() == b"\x0e" + b"\x18" + b"\x00" * 7 + b"\x00" * 24
    assert hello_request(0) == b"\x0e" + b"\x00" * 8


@pytest.mark.parametrize(("host", "port", "text"), [("10.0.0.1", 50052, "10.0.0.1:50052"), ("::1", 1, "[::1]:1")])
def test_format_endpoint(host: str, port: int, text: str) -> None:
    assert format_endpoint(host, port) == text


def _recv(conn: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = conn.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return data


def v7_server(conn: socket.socket) -> None:
    """Protocol 7: check the request exactly as rpc_serve_client does, answer 7.0.0 and zero caps."""
    head = _recv(conn, 9)
    if head[0] != 14 or struct.unpack("<Q", head[1:])[0] != 24:
        return
    _recv(conn, 24)
    conn.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24))


def legacy_server(conn: socket.socket) -> None:
    """Protocol 3: HELLO with an empty payload, three version bytes back; hang up on anything else."""
    head = _recv(conn, 9)
    if head[0] != 14 or struct.unpack("<Q", head[1:])[0] != 0:
        return
    conn.sendall(struct.pack("<Q", 3) + bytes([3, 0, 0]))


def http_server(conn: socket.socket) -> None:
    _recv(conn, 9)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")


def short_answer_server(conn: socket.socket) -> None:
    _recv(conn, 33)
    conn.sendall(struct.pack("<Q", 2) + b"\x07\x00")


def truncated_answer_server(conn: socket.socket) -> None:
    _recv(conn, 33)
    conn.sendall(struct.pack("<Q", 28) + b"\x07\x00")


def closing_server(conn: socket.socket) -> None:
    _recv(conn, 9)


@pytest.fixture
def serve() -> Iterator[Callable[..., int]]:
    """serve(handler, accept=True): a listening socket on 127.0.0.1; returns its port.

    With accept=False nothing is ever accepted (a server busy with another client:
    the kernel completes the TCP handshake from the backlog, then nobody reads).
    """
    sockets: list[socket.socket] = []
    stop = threading.Event()

    def start(handler: Callable[[socket.socket], None] | None, accept: bool = True) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        sockets.append(listener)

        def loop() -> None:
            while not stop.is_set():
                try:
                    conn = listener.accept()[0]
                except (socket.timeout, OSError):
                    continue
                with conn:
                    conn.settimeout(5)
                    try:
                        handler(conn)
                    except OSError:
                        pass

        if accept:
            threading.Thread(target=loop, daemon=True).start()
        return listener.getsockname()[1]

    yield start
    stop.set()
    for listener in sockets:
        listener.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_protocol_7_server(serve) -> None:
    assert rpc_hello("127.0.0.1", serve(v7_server), timeout=5) == (7, 0, 0)


def test_legacy_server_is_asked_again_in_the_old_form(serve) -> None:
    assert rpc_hello("127.0.0.1", serve(legacy_server), timeout=5) == (3, 0, 0)


@pytest.mark.parametrize(
    ("handler", "error", "message"),
    [
        (http_server, RPCProtocolError, r"answered b'HTTP/1\.1', which is not an RPC HELLO answer"),
        (short_answer_server, RPCProtocolError, "HELLO answer of 2 bytes is too short"),
        (truncated_answer_server, RPCProtocolError, "connection closed in the middle of the HELLO answer"),
        (closing_server, RPCClosed, "(closed|reset) the connection without answering HELLO .*tried the protocol 7"),
    ],
)
def test_wrong_peers(serve, handler, error: type, message: str) -> None:
    port = serve(handler)
    with pytest.raises(error, match=message) as info:
        rpc_hello("127.0.0.1", port, timeout=5)
    assert info.value.endpoint == "127.0.0.1:%d" % port
    assert str(info.value).startswith("127.0.0.1:%d: " % port)


def test_refused() -> None:
    port = _free_port()
    with pytest.raises(RPCConnectError, match="127.0.0.1:%d: connection refused" % port):
        rpc_hello("127.0.0.1", port, timeout=2)


def test_busy_server_times_out_with_an_explanation(serve) -> None:
    port = serve(None, accept=False)
    with pytest.raises(RPCTimeout, match="no HELLO answer within 0.3s: rpc-server serves one client at a time"):
        rpc_hello("127.0.0.1", port, timeout=0.3)


def test_unresolvable_host() -> None:
    with pytest.raises(RPCConnectError, match="no-such-host.invalid:50052: cannot resolve host"):
        rpc_hello("no-such-host.invalid", 50052, timeout=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize(
    ("outcomes", "timeout", "expected"),
    [
        (["ok"], 10, (1, None)),
        (["refused", "refused", "ok"], 10, (3, None)),
        (["timeout", "closed", "ok"], 10, (3, None)),
        (["refused"] * 20, 5, (5, RPCConnectError)),
        (["garbage", "ok"], 10, (1, RPCProtocolError)),
    ],
)
def test_wait_for_hello_retries(monkeypatch: pytest.MonkeyPatch, outcomes: list[str], timeout: float,
                                expected: tuple[int, type | None]) -> None:
    clock = FakeClock()
    calls: list[float] = []
    errors = {
        "refused": RPCConnectError("h:1", "connection refused"),
        "timeout": RPCTimeout("h:1", "no answer"),
        "closed": RPCClosed("h:1", "closed"),
        "garbage": RPCProtocolError("h:1", "garbage"),
    }

    def fake_hello(host: str, port: int, timeout: float) -> tuple[int, int, int]:
        calls.append(timeout)
        outcome = outcomes[len(calls) - 1]
        if outcome == "ok":
            return (7, 0, 0)
        raise errors[outcome]

    monkeypatch.setattr(rpc_proto, "rpc_hello", fake_hello)
    attempts, error = expected
    if error is None:
        result = wait_for_hello("h", 1, timeout=timeout, interval=1, clock=clock, sleep=clock.sleep)
        assert result == HelloResult((7, 0, 0), attempts, clock.now)
    else:
        with pytest.raises(error) as info:
            wait_for_hello("h", 1, timeout=timeout, interval=1, clock=clock, sleep=clock.sleep)
        if error is RPCConnectError:
            assert "gave up after %d attempts" % attempts in str(info.value)
    assert len(calls) == attempts
    assert all(0 < t <= 5 for t in calls)


def test_wait_for_hello_real_socket(serve) -> None:
    result = wait_for_hello("127.0.0.1", serve(v7_server), timeout=5)
    assert result.version == (7, 0, 0) and result.attempts == 1


def test_a_probe_that_gives_up_resets_its_connection() -> None:
    """When the server gets to the probe, its answer must fail softly.

    After a normal close, rpc-server's first send to the vanished peer succeeds and
    the second raises SIGPIPE, which kills it. After a reset the queued HELLO is
    still readable, but the first send fails with ECONNRESET (no signal).
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    with listener:
        port = listener.getsockname()[1]
        with pytest.raises(RPCTimeout):
            rpc_hello("127.0.0.1", port, timeout=0.3)  # waits in the backlog, like behind a busy rpc-server
        conn = listener.accept()[0]
        with conn:
            conn.settimeout(5)
            assert _recv(conn, 33) == hello_request()
            with pytest.raises(ConnectionResetError):
                conn.send(struct.pack("<Q", 28))


def test_an_answered_probe_closes_normally(serve) -> None:
    seen: list[bytes] = []

    def server(conn: socket.socket) -> None:
        v7_server(conn)
        seen.append(conn.recv(64))  # the next read after the answer: end of stream, as rpc-server expects

    port = serve(server)
    rpc_hello("127.0.0.1", port, timeout=5)
    for dummy in range(50):
        if seen:
            break
        threading.Event().wait(0.05)
    assert seen == [b""]


def test_wait_helper_cli_waits_for_every_endpoint(serve, capsys) -> None:
    """The unit's ExecStartPre: exit 0 once every worker answers, 1 (with the endpoint) when one never does."""
    first = serve(v7_server)
    second = serve(v7_server)
    assert rpc_proto.main([f"127.0.0.1:{first}", f"127.0.0.1:{second}"]) == 0
    out = capsys.readouterr().out
    assert f"127.0.0.1:{first} answered HELLO" in out and f"127.0.0.1:{second} answered HELLO" in out
    dead = _free_port()
    assert rpc_proto.main(["--timeout", "1.5", f"127.0.0.1:{first}", f"127.0.0.1:{dead}"]) == 1
    assert f"127.0.0.1:{dead} did not answer HELLO" in capsys.readouterr().err
    assert rpc_proto.main([]) == 2


# The command table and the stream readers (FrameParser, HelloReplyFilter, reply_size), which the bench proxy uses.

@pytest.mark.parametrize(("name", "number"), [
    # enum rpc_cmd of ggml-rpc.cpp at 0c1e570, by position
    ("ALLOC_BUFFER", 0), ("SET_TENSOR", 6), ("SET_TENSOR_HASH", 7), ("GET_TENSOR", 8), ("COPY_TENSOR", 9),
    ("GRAPH_COMPUTE", 10), ("GET_DEVICE_MEMORY", 11), ("HELLO", 14), ("DEVICE_COUNT", 15),
    ("GRAPH_RECOMPUTE", 16), ("MEMSET_TENSOR", 17), ("NONE", 18),
])
def test_command_numbers_are_llama_cpp_s(name: str, number: int) -> None:
    assert Cmd[name] == number
    assert rpc_proto.command_name(number) == name


def test_unknown_command_name() -> None:
    assert rpc_proto.command_name(200) == "UNKNOWN_200"


@pytest.mark.parametrize("how", ["whole", "bytes", "random"])
def test_parser_finds_every_frame_whatever_the_reads(how: str) -> None:
    parser = FrameParser()
    pieces = [piece for chunk in splits(session_bytes(), how) for piece in parser.feed(chunk)]
    frames = [frame for frame, _data in pieces if frame is not None]
    assert [(f.command, f.size) for f in frames] == [(c, len(p)) for c, p in SESSION]
    assert frames[0].name == "HELLO" and frames[-1].name == "GET_TENSOR"
    # Every piece that starts a frame starts with its header; the bytes are the stream's, HELLO caps zeroed.
    assert all(data[:9] == rpc_proto.HEADER.pack(f.command, f.size) for f, data in pieces if f is not None)
    expected = request_frame(Cmd.HELLO, bytes(24)) + session_bytes()[9 + 24:]
    assert b"".join(data for _frame, data in pieces) == expected


def test_parser_holds_a_split_header_back() -> None:
    parser = FrameParser()
    frame = request_frame(Cmd.GRAPH_COMPUTE, b"abc")
    assert parser.feed(frame[:5]) == []
    assert parser.feed(frame[5:]) == [(rpc_proto.Frame(Cmd.GRAPH_COMPUTE, 3), frame)]


@pytest.mark.parametrize("index", range(len(SESSIONS)))
def test_recorded_answers_have_the_sizes_the_proxy_expects(index: int) -> None:
    session = SESSIONS[index]
    expected = [reply_size(f[0], payload(f)) for f in session["frames"]]
    assert [n for n in expected if n is not None] == session["reply_sizes"]


@pytest.mark.parametrize("index", range(13))
def test_parser_on_recorded_short_sessions(index: int) -> None:
    session = SESSIONS[index]
    client, server = bytes.fromhex(session["client_hex"]), bytes.fromhex(session["server_hex"])
    parser = FrameParser()
    pieces = [p for chunk in splits(client, "random") for p in parser.feed(chunk)]
    assert [[f.command, f.size] for f, _data in pieces if f] == [f[:2] for f in session["frames"]]
    assert b"".join(data for _frame, data in pieces) == client  # a TCP server: its HELLO caps were zero already
    assert HelloReplyFilter().feed(server) == server
    assert rpc_proto.parse_hello_payload("x", server[8:36]) == (7, 0, 0)


def test_parser_follows_the_recorded_model_session_at_full_size() -> None:
    parser, frames, total = FrameParser(), [], 0
    for data in model_session_stream():
        for frame, piece in parser.feed(data):
            total += len(piece)
            if frame is not None:
                frames.append([frame.command, frame.size])
    assert frames == [f[:2] for f in MODEL_SESSION["frames"]]
    assert total == sum(9 + f[1] for f in MODEL_SESSION["frames"]) > 249_000_000


def test_hello_reply_filter_zeroes_capabilities_only() -> None:
    answer = struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(range(1, 25))
    after = struct.pack("<Q", 4) + b"\x01\x00\x00\x00"
    stream = answer + after
    split = HelloReplyFilter()
    out = b"".join(split.feed(stream[i:i + 5]) for i in range(0, len(stream), 5))
    filt = HelloReplyFilter()
    assert out == struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24) + after
    assert filt.feed(answer) + filt.feed(after) == out


def test_hello_reply_filter_leaves_old_answers() -> None:
    legacy = struct.pack("<Q", 3) + bytes([3, 0, 0])  # protocol 3: three version bytes, no caps
    assert HelloReplyFilter().feed(legacy + b"rest") == legacy + b"rest"


@pytest.mark.parametrize(("command", "payload", "size"), [
    (Cmd.HELLO, bytes(24), 28), (Cmd.ALLOC_BUFFER, bytes(12), 16), (Cmd.GET_DEVICE_MEMORY, bytes(4), 16),
    (Cmd.DEVICE_COUNT, b"", 4), (Cmd.SET_TENSOR_HASH, bytes(312), 1),
    (Cmd.GET_TENSOR, rpc_proto.GET_TENSOR_REQ.pack(bytes(296), 8, 777), 777),
    (Cmd.SET_TENSOR, bytes(400), None), (Cmd.GRAPH_COMPUTE, bytes(12), None), (Cmd.FREE_BUFFER, bytes(8), None),
])
def test_reply_sizes_follow_the_server(command: Cmd, payload: bytes, size: int | None) -> None:
    assert reply_size(command, payload) == size
