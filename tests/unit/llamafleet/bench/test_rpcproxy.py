"""The RPC latency proxy: frame parsing on recorded frames, each mode's delays through a real relay, controls."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llamafleet.bench import rpcproxy
from llamafleet.bench.rpcproxy import RpcProxy, parse_address
from llamafleet.core import rpc_proto
from llamafleet.core.rpc_proto import Cmd, reply_size, request_frame
from tests.unit.rpc_sessions import MODEL_SESSION, SESSION, model_session_stream, payload, session_bytes
from tests.rpc_client import RpcClient, measure_round_trip

# round trips bounded to tens of milliseconds: make check runs these before its parallel workers, alone
pytestmark = pytest.mark.timing

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "rpc"
REPO = Path(__file__).resolve().parents[4]


ALWAYS_DELAYED = {"compute": {"GRAPH_COMPUTE", "GRAPH_RECOMPUTE"},
                  "transfer": {"GRAPH_COMPUTE", "GRAPH_RECOMPUTE", "GET_TENSOR", "SET_TENSOR"},
                  "all": {c.name for c in Cmd}}


@pytest.mark.parametrize("mode", sorted(ALWAYS_DELAYED))
@pytest.mark.parametrize("command", list(Cmd))
def test_modes_delay_exactly_their_commands(mode: str, command: Cmd) -> None:
    assert (command in rpcproxy.delayed_commands(mode)) == (command.name in ALWAYS_DELAYED[mode])


def test_unknown_mode_names_the_modes() -> None:
    with pytest.raises(ValueError, match="unknown mode 'fast': use one of compute, transfer, all"):
        rpcproxy.delayed_commands("fast")


@pytest.mark.parametrize("mode", ["compute", "transfer", "all"])
def test_replaying_the_recorded_session_delays_the_mode_s_commands(fake_rpc, mode: str) -> None:
    """Weights and logits shrunk to 4 KiB: the session's requests in order, armed, against a fake server."""
    stream = b"".join(model_session_stream(cap=4096))
    answers = sum(8 + n for n in (reply_size(f[0], payload(f, 4096)) for f in MODEL_SESSION["frames"])
                  if n is not None)
    with proxy_for(fake_rpc, mode, delay_ms=30) as proxy:
        with socket.create_connection(proxy.address) as sock:
            received = []
            reader = threading.Thread(target=lambda: received.append(sock.recv(answers, socket.MSG_WAITALL)))
            reader.start()
            sock.sendall(stream)
            reader.join(30)
        deadline = time.monotonic() + 5
        while proxy.stats.snapshot()["active_connections"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = proxy.stats.snapshot()
    assert len(received[0]) == answers and bytes(fake_rpc.received) == stream
    recorded = [Cmd(f[0]).name for f in MODEL_SESSION["frames"]]
    assert [Cmd(c).name for c in fake_rpc.commands] == recorded
    for name, counts in stats["commands"].items():
        assert counts["count"] == recorded.count(name)
        assert counts["delayed"] == (counts["count"] if Cmd[name] in rpcproxy.delayed_commands(mode) else 0)
    assert stats["commands"]["GRAPH_COMPUTE"]["count"] == 7 and stats["commands"]["GRAPH_RECOMPUTE"]["count"] == 5
    assert stats["bytes_to_upstream"] == len(stream)


@pytest.mark.parametrize(("text", "pair"), [("127.0.0.1:50052", ("127.0.0.1", 50052)), ("[::1]:9", ("::1", 9)),
                                            ("host.lan:1", ("host.lan", 1))])
def test_parse_address(text: str, pair: tuple[str, int]) -> None:
    assert parse_address(text, "--listen") == pair


@pytest.mark.parametrize("text", ["50052", "host:", ":50052", "host:port", "host:70000", "host:0"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="--upstream .* is not HOST:PORT"):
        parse_address(text, "--upstream")


DELAY_MS = 80.0


def proxy_for(fake, mode: str, armed: bool = True, delay_ms: float = DELAY_MS) -> RpcProxy:
    return RpcProxy(("127.0.0.1", 0), ("127.0.0.1", fake.port), delay_ms, mode, armed=armed).start()


def median_ms(host: str, port: int, command: Cmd, samples: int = 5) -> float:
    values = sorted(measure_round_trip(host, port, command, samples=samples))
    return 1000 * values[len(values) // 2]


@pytest.mark.parametrize("mode", ["compute", "transfer", "all"])
@pytest.mark.parametrize("command", [Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE, Cmd.GET_TENSOR, Cmd.SET_TENSOR,
                                     Cmd.GET_ALIGNMENT, Cmd.GET_DEVICE_MEMORY])
def test_round_trips_through_the_proxy_show_the_mode_s_delay(fake_rpc, mode: str, command: Cmd) -> None:
    with proxy_for(fake_rpc, mode) as proxy:
        took = median_ms(*proxy.address, command)
    if command.name in ALWAYS_DELAYED[mode]:
        assert DELAY_MS * 0.95 <= took <= DELAY_MS + 60
    else:
        assert took < 25


def test_back_to_back_commands_share_the_delay(fake_rpc) -> None:
    """A delay line: three computes sent together cost one delay, not three."""
    with proxy_for(fake_rpc, "compute") as proxy, RpcClient(*proxy.address) as client:
        start = time.perf_counter()
        for _ in range(3):
            client.send(Cmd.GRAPH_COMPUTE, struct.pack("<III", 0, 0, 0))
        client.call(Cmd.GET_ALIGNMENT, struct.pack("<I", 0))
        took = 1000 * (time.perf_counter() - start)
    assert DELAY_MS * 0.95 <= took < 2 * DELAY_MS


def test_disarmed_until_armed_and_stats_count_everything(fake_rpc) -> None:
    with proxy_for(fake_rpc, "compute", armed=False) as proxy:
        assert median_ms(*proxy.address, Cmd.GRAPH_COMPUTE) < 25
        proxy.arm()
        assert median_ms(*proxy.address, Cmd.GRAPH_COMPUTE) >= DELAY_MS * 0.95
        proxy.arm(False)
        assert median_ms(*proxy.address, Cmd.GRAPH_COMPUTE) < 25
        deadline = time.monotonic() + 5
        while proxy.stats.snapshot()["active_connections"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = proxy.describe()
    computes = fake_rpc.commands.count(Cmd.GRAPH_COMPUTE)
    assert stats["commands"]["GRAPH_COMPUTE"] == {"count": computes, "payload_bytes": 12 * computes, "delayed": 6}
    assert stats["delayed_commands"] == 6 and stats["held_ms_mean"] >= DELAY_MS * 0.95
    assert stats["connections"] == 3 and stats["active_connections"] == 0
    assert stats["bytes_to_upstream"] == len(fake_rpc.received)
    assert stats["commands"]["HELLO"]["count"] == 3 and stats["armed"] is False


def test_upstream_gets_the_bytes_sent_and_the_client_no_rdma(fake_rpc) -> None:
    with proxy_for(fake_rpc, "all", delay_ms=5) as proxy:
        with socket.create_connection(proxy.address) as sock:
            sock.sendall(session_bytes())
            head = sock.recv(8, socket.MSG_WAITALL)
            hello = sock.recv(28, socket.MSG_WAITALL)
            sock.shutdown(socket.SHUT_WR)
            rest = b""
            while chunk := sock.recv(65536):
                rest += chunk
    assert struct.unpack("<Q", head) == (28,) and hello == bytes([7, 0, 0, 0]) + bytes(24)
    assert fake_rpc.received == request_frame(Cmd.HELLO, bytes(24)) + session_bytes()[33:]
    answered = [c for c, p in SESSION[1:] if reply_size(c, p) is not None]
    assert len(rest) == sum(8 + reply_size(c, p) for c, p in SESSION[1:] if reply_size(c, p) is not None)
    assert [c for c in fake_rpc.commands] == [c for c, _ in SESSION] and len(answered) == 6
    assert fake_rpc.ends == ["eof"]


def test_a_client_reset_resets_upstream(fake_rpc) -> None:
    with proxy_for(fake_rpc, "compute") as proxy:
        sock = socket.create_connection(proxy.address)
        sock.sendall(request_frame(Cmd.HELLO, bytes(24)))
        sock.recv(36, socket.MSG_WAITALL)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        deadline = time.monotonic() + 5
        while not fake_rpc.ends and time.monotonic() < deadline:
            time.sleep(0.01)
    assert fake_rpc.ends == ["reset"]


def test_no_upstream_resets_the_client() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with RpcProxy(("127.0.0.1", 0), ("127.0.0.1", port), 1, "compute") as proxy:
        with pytest.raises((ConnectionResetError, rpc_proto.RPCClosed)):
            RpcClient(*proxy.address, timeout=5)


def test_bad_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="--delay-ms must be a number of 0 or more"):
        RpcProxy(("127.0.0.1", 0), ("127.0.0.1", 1), -1, "compute")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llamafleet.bench.rpcproxy", *args], capture_output=True,
                          text=True, timeout=30, cwd=REPO, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    (["--delay-ms", "-5"], "--delay-ms must be a number of 0 or more"),
    (["--delay-ms", "nan"], "--delay-ms must be a number of 0 or more"),
    (["--listen", "8080"], "--listen '8080' is not HOST:PORT"),
    (["--upstream", "worker"], "--upstream 'worker' is not HOST:PORT"),
    (["--stats-interval", "0"], "--stats-interval must be a number of seconds above 0"),
    (["--rate-mbit", "-1"], "--rate-mbit must be a number of 0 (no cap) or more"),
    (["--rate-mbit", "nan"], "--rate-mbit must be a number of 0 (no cap) or more"),
    (["--rate-mbit", "inf"], "--rate-mbit must be a number of 0 (no cap) or more"),
])
def test_cli_refuses_bad_arguments(args: list[str], message: str) -> None:
    base = {"--listen": "127.0.0.1:50999", "--upstream": "127.0.0.1:1", "--delay-ms": "5", "--mode": "compute"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    proc = run_cli(*[x for kv in base.items() for x in kv])
    assert proc.returncode == 2 and message in proc.stderr


def test_cli_says_when_the_port_is_taken() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = run_cli("--listen", "127.0.0.1:%d" % port, "--upstream", "127.0.0.1:1", "--delay-ms", "5",
                       "--mode", "compute")
    assert proc.returncode == 1
    assert "cannot listen on 127.0.0.1:%d: Address already in use" % port in proc.stderr


class Lines:
    """A process's stderr, line by line, read on a thread (so a missing line fails the test, not hangs it)."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._queue.put(line) for line in stream], daemon=True).start()

    def expect(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            self.seen.append(line)
            if text in line:
                return line


def test_cli_signals_arm_disarm_and_write_stats(fake_rpc, tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stats = tmp_path / "stats.json"
    # With a long interval the file is written only on signals and at exit.
    proc = subprocess.Popen([sys.executable, "-m", "llamafleet.bench.rpcproxy", "--listen", "127.0.0.1:%d" % port,
                             "--upstream", "127.0.0.1:%d" % fake_rpc.port, "--delay-ms", str(DELAY_MS),
                             "--mode", "compute", "--stats", str(stats), "--stats-interval", "1000"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    log = Lines(proc.stderr)
    try:
        log.expect("listening on 127.0.0.1:%d, disarmed, delay 80.0 ms, mode compute" % port)
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not stats.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        first = json.loads(stats.read_text())
        assert first["armed"] is False and first["mode"] == "compute" and first["delay_ms"] == DELAY_MS
        assert first["connections"] == 0 and first["pid"] == proc.pid
        assert median_ms("127.0.0.1", port, Cmd.GRAPH_COMPUTE) < 25
        os.kill(proc.pid, signal.SIGUSR1)
        log.expect("armed: delaying compute commands by 80.0 ms")
        assert median_ms("127.0.0.1", port, Cmd.GRAPH_COMPUTE) >= DELAY_MS * 0.95
        os.kill(proc.pid, signal.SIGUSR2)
        log.expect("disarmed")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert proc.returncode == 0
    log.expect("stopped")
    last = json.loads(stats.read_text())
    assert last["armed"] is False and last["connections"] == 2
    assert last["commands"]["GRAPH_COMPUTE"]["delayed"] == 6  # 5 samples and the setup's compute
