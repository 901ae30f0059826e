"""The gate's per-link metrics (gate_metrics.link_samples): the kernel's view of each worker link, from real ``ss -tin``
output (a recording, the lab's, and a live loopback connection read as the watchdog reads it) through the real parsing
path into the exposition text, read back with a strict parser. The gate's other metrics: test_serving_gate.py."""

from __future__ import annotations

import fcntl
import shutil
import socket
import struct
import time

import pytest

from llamafleet.core import gate_metrics, host_observation
from llamafleet.core.gate_config import Worker
from tests.unit.gate_exposition import (SS_FIXTURES, by_worker, gate_exposition, lab_exposition, parse_exposition)
from tests.unit.needs import needs

TRAFFIC_REAL = (SS_FIXTURES / "ss_tinHO_established_traffic_iproute2-6.1.0_real.txt").read_text(encoding="utf-8")
TRAFFIC_WORKERS = (Worker("w1", "127.0.0.1", 47419), Worker("w2", "127.0.0.1", 39175))
# The per-link families and their types, as the gate declares them.
LINK_FAMILIES = {name: kind for name, (kind, _help) in gate_metrics.GATE_METRICS.items()
                 if name.startswith("llamafleet_gate_link_")}
# linux/sockios.h: bytes in the send queue not yet acknowledged, and those not sent yet.
SIOCOUTQ, SIOCOUTQNSD = 0x5411, 0x894B


def test_the_link_families_are_declared_with_their_types() -> None:
    assert LINK_FAMILIES == {
        "llamafleet_gate_link_connected": "gauge", "llamafleet_gate_link_rtt_seconds": "gauge",
        "llamafleet_gate_link_rttvar_seconds": "gauge", "llamafleet_gate_link_sent_bytes_total": "counter",
        "llamafleet_gate_link_received_bytes_total": "counter", "llamafleet_gate_link_retransmits_total": "counter",
        "llamafleet_gate_link_unacked_bytes": "gauge", "llamafleet_gate_link_notsent_bytes": "gauge",
        "llamafleet_gate_link_stalled_polls": "gauge", "llamafleet_gate_link_stalls_total": "counter"}
    assert set(gate_metrics.LINK_TRAFFIC) < set(LINK_FAMILIES)


def test_the_recorded_traffic_in_the_exposition() -> None:
    text = gate_exposition(TRAFFIC_REAL, TRAFFIC_WORKERS)
    families = parse_exposition(text)
    _same_with_prometheus_client(text)
    assert {name: families[name].kind for name in LINK_FAMILIES} == LINK_FAMILIES
    values = {name: by_worker(families, name) for name in LINK_FAMILIES}
    assert values == {
        "llamafleet_gate_link_connected": {"w1:47419": 1, "w2:39175": 1},
        "llamafleet_gate_link_rtt_seconds": {"w1:47419": 0.000028, "w2:39175": 0.004822},
        "llamafleet_gate_link_rttvar_seconds": {"w1:47419": 0.000011, "w2:39175": 0.009617},
        "llamafleet_gate_link_sent_bytes_total": {"w1:47419": 100001, "w2:39175": 127576},
        "llamafleet_gate_link_received_bytes_total": {"w1:47419": 3000, "w2:39175": 0},
        "llamafleet_gate_link_retransmits_total": {"w1:47419": 0, "w2:39175": 1},
        "llamafleet_gate_link_unacked_bytes": {"w1:47419": 0, "w2:39175": 0},
        "llamafleet_gate_link_notsent_bytes": {"w1:47419": 0, "w2:39175": 69033},
        "llamafleet_gate_link_stalled_polls": {"w1:47419": 0, "w2:39175": 0},
        "llamafleet_gate_link_stalls_total": {"w1:47419": 0, "w2:39175": 0}}
    # the text as served: HELP, TYPE, then one line per worker, integers without a fraction
    assert ("# HELP llamafleet_gate_link_sent_bytes_total Bytes llama-server sent the worker and it acknowledged "
            "(tcpi_bytes_acked).\n# TYPE llamafleet_gate_link_sent_bytes_total counter\n"
            'llamafleet_gate_link_sent_bytes_total{worker="w1:47419"} 100001\n'
            'llamafleet_gate_link_sent_bytes_total{worker="w2:39175"} 127576\n') in text
    assert 'llamafleet_gate_link_rtt_seconds{worker="w2:39175"} 0.004822\n' in text


def test_the_lab_partition_in_the_exposition() -> None:
    """lab3 cut off: data unacknowledged, retransmits, its stall confirmed on the second poll and counted once."""
    families = parse_exposition(lab_exposition())
    values = {name: by_worker(families, name) for name in LINK_FAMILIES}
    assert values["llamafleet_gate_link_unacked_bytes"] == {"lab2:50052": 0, "lab3:50052": 3208}
    assert values["llamafleet_gate_link_retransmits_total"] == {"lab2:50052": 11, "lab3:50052": 15}
    assert values["llamafleet_gate_link_sent_bytes_total"] == {"lab2:50052": 69884808, "lab3:50052": 48270}
    assert values["llamafleet_gate_link_received_bytes_total"] == {"lab2:50052": 315284, "lab3:50052": 10486021}
    assert values["llamafleet_gate_link_rtt_seconds"] == {"lab2:50052": 0.000805, "lab3:50052": 0.003517}
    assert values["llamafleet_gate_link_stalled_polls"] == {"lab2:50052": 0, "lab3:50052": 2}
    assert values["llamafleet_gate_link_stalls_total"] == {"lab2:50052": 0, "lab3:50052": 1}
    # a third poll still stalled: the same stall, not a second one
    again = parse_exposition(gate_exposition(SS_FIXTURES.joinpath("lab1-lab3-partitioned-7s.txt").read_text(),
                                             (Worker("lab2", "10.77.0.12", 50052), Worker("lab3", "10.77.0.13", 50052)),
                                             polls=3))
    assert by_worker(again, "llamafleet_gate_link_stalls_total") == {"lab2:50052": 0, "lab3:50052": 1}
    assert by_worker(again, "llamafleet_gate_link_stalled_polls")["lab3:50052"] == 3


def test_a_lost_link_and_no_answer_from_ss() -> None:
    """A lost worker: connected 0 and its stall figures, no tcp_info made up; ss without an answer (links None):
    only the stall counters the gate keeps."""
    lost = parse_exposition(gate_exposition(TRAFFIC_REAL.splitlines()[0], TRAFFIC_WORKERS))
    assert by_worker(lost, "llamafleet_gate_link_connected") == {"w1:47419": 1, "w2:39175": 0}
    assert set(by_worker(lost, "llamafleet_gate_link_rtt_seconds")) == {"w1:47419"}
    assert set(by_worker(lost, "llamafleet_gate_link_stalls_total")) == {"w1:47419", "w2:39175"}
    assert gate_metrics.link_samples(None, {}, {"w1:47419": 2}) == [
        ("llamafleet_gate_link_stalls_total", {"worker": "w1:47419"}, 2)]


def _same_with_prometheus_client(text: str) -> None:
    """Where prometheus_client is installed (the project's venv has none), its parser must read the families and
    values the strict parser read."""
    try:
        from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=import-outside-toplevel
    except ImportError:
        return
    theirs = {family.name: family for family in text_string_to_metric_families(text)}
    for name, family in parse_exposition(text).items():
        base = name[:-len("_total")] if family.kind == "counter" else name
        assert theirs[base].type == family.kind
        assert {tuple(sorted(s.labels.items())): s.value for s in theirs[base].samples if s.name == name} == family.samples


def _tcp_info(sock: socket.socket) -> dict[str, float]:
    """What the kernel says of ``sock`` itself (struct tcp_info, linux/tcp.h): the truth ss's line is read against."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    rtt, rttvar = struct.unpack_from("II", info, 68)
    (total_retrans,) = struct.unpack_from("I", info, 100)
    acked, received = struct.unpack_from("QQ", info, 120)
    return {"rtt": rtt / 1e6, "rttvar": rttvar / 1e6, "retransmits": total_retrans, "sent": acked, "received": received}


def _queue(sock: socket.socket, request: int) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0]


def _pair(rcvbuf: int | None = None) -> tuple[socket.socket, socket.socket, socket.socket]:
    """(listener, client, server's side) over 127.0.0.1."""
    listener = socket.socket()
    if rcvbuf:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _peer = listener.accept()
    return listener, client, server


def _receive(sock: socket.socket, size: int) -> None:
    got = 0
    while got < size:
        chunk = sock.recv(65536)
        assert chunk
        got += len(chunk)


@needs(shutil.which("ss"), "ss (iproute2)")
def test_a_live_link_through_the_watchdogs_path() -> None:
    """Two real loopback links read with the gate's own ss command (host_observation.SS_LINKS): one that carried
    100,000 bytes out and 3,000 back, one whose receiver does not read (its sender's data waits, not sent). The
    exposition says what the kernel says of each client socket (TCP_INFO, SIOCOUTQ, SIOCOUTQNSD)."""
    sockets = []
    try:
        busy = _pair()
        full = _pair(rcvbuf=65536)
        sockets = [*busy, *full]
        listener, client, server = busy
        client.sendall(b"x" * 100000)
        _receive(server, 100000)
        server.sendall(b"y" * 3000)
        _receive(client, 3000)
        writer = full[1]
        writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        writer.setblocking(False)
        try:
            while True:
                writer.send(b"z" * 65536)
        except BlockingIOError:
            pass
        workers = (Worker("busy", "127.0.0.1", listener.getsockname()[1]),
                   Worker("full", "127.0.0.1", full[0].getsockname()[1]))
        for _attempt in range(20):  # read ss while the kernel's figures hold still (an ACK may move them)
            before = (_tcp_info(client), _tcp_info(writer), _queue(writer, SIOCOUTQ), _queue(writer, SIOCOUTQNSD))
            out = host_observation.command_output(host_observation.SS_LINKS)
            after = (_tcp_info(client), _tcp_info(writer), _queue(writer, SIOCOUTQ), _queue(writer, SIOCOUTQNSD))
            if before == after:
                break
            time.sleep(0.05)
        assert out is not None and before == after, "the kernel's figures kept moving"
        families = parse_exposition(gate_exposition(out, workers))
    finally:
        for sock in sockets:
            sock.close()
    busy_info, full_info, queued, notsent = before
    values = {name: by_worker(families, name) for name in LINK_FAMILIES}
    busy_label, full_label = ("%s:%d" % (w.host, w.port) for w in workers)
    for label, info in ((busy_label, busy_info), (full_label, full_info)):
        assert values["llamafleet_gate_link_connected"][label] == 1
        assert values["llamafleet_gate_link_rtt_seconds"][label] == pytest.approx(info["rtt"], abs=1e-9)
        assert values["llamafleet_gate_link_rttvar_seconds"][label] == pytest.approx(info["rttvar"], abs=1e-9)
        assert values["llamafleet_gate_link_sent_bytes_total"][label] == info["sent"]
        assert values["llamafleet_gate_link_received_bytes_total"][label] == info["received"]
        assert values["llamafleet_gate_link_retransmits_total"][label] == info["retransmits"]
    # the kernel's own counts of what the test sent (the connecting side counts its SYN as one byte acknowledged)
    assert (busy_info["sent"], busy_info["received"]) == (100001, 3000)
    assert values["llamafleet_gate_link_unacked_bytes"][busy_label] == 0
    assert values["llamafleet_gate_link_notsent_bytes"][busy_label] == 0
    assert notsent > 0 and values["llamafleet_gate_link_notsent_bytes"][full_label] == notsent
    assert values["llamafleet_gate_link_unacked_bytes"][full_label] == queued - notsent
