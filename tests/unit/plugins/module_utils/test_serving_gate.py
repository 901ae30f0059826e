"""The serving gate (serving_gate.py and its modules): pure parts table-driven, and the proxy over real sockets against a small fake llama-server."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from llamafleet.core import (atomic_file, gate_config, gate_decision, gate_metrics, gate_proxy, gate_watchdog, host_observation,
                             http_wire, link_state, plan_switch, serving_gate)
from llamafleet.core.gate_config import Config, Worker, load_config
from llamafleet.core.gate_decision import (
    DOWN,
    LOADING,
    SERVING,
    CanaryOutcome,
    Decision,
    Memory,
    Observation,
    decide,
    remember,
)
from llamafleet.core.gate_proxy import Gate
from llamafleet.core.host_observation import established_on, parse_listeners, parse_ss, rpc_endpoints
from llamafleet.core.http_wire import ChunkDecoder, ChunkError, HeadError
from llamafleet.core.link_state import count_stalls, link_names, running_workers, worker_links
from llamafleet.core.rpc_guard import guard_decide
from tests.unit.gate_harness import LoopbackServer, run_gate
from tests.unit.needs import require

# answers bounded to tenths of a second: make check runs these before its parallel workers, alone
pytestmark = pytest.mark.timing

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "ss"
STALLED_REAL = (FIXTURES / "ss_tinHO_established_stalled_iproute2-6.1.0_real.txt").read_text()
IDLE_REAL = (FIXTURES / "ss_tinHO_nofilter_idle_iproute2-6.1.0_real.txt").read_text()

LAB = (Worker("lab2", "10.77.0.12", 50052), Worker("lab3", "10.77.0.13", 50052))
# restart_after equal to the stall threshold: the table below restarts on any confirmed stall;
# test_a_stall_restarts_only_once_it_lasts_restart_after covers the default.
CFG = Config(listen_port=8080, upstream_port=8081, unit="llamafleet-llama-server.service", workers=LAB,
             restart_after=4.0)


def _ss_line(peer: str, *, sendq: int = 0, unacked: int = 0, lastack: int = 120, local: str = "10.77.0.11:41234",
             state: str = "", lastsnd: int | None = None) -> str:
    """A line of ``ss -tinHO``; by default the last data went out 80 ms after the last data came in."""
    extra = " unacked:%d retrans:1/5 backoff:4" % unacked if unacked else ""
    return ("%s0      %-6d %s %s cubic wscale:7,7 rto:3264 rtt:0.31/0.1 ato:40 mss:1448 cwnd:1 bytes_sent:9876 "
            "bytes_acked:4321 lastsnd:%d lastrcv:%d lastack:%d%s rcv_space:14480 minrtt:0.2"
            % (state, sendq, local, peer, lastack - 80 if lastsnd is None else lastsnd, lastack, lastack, extra))


# ---------------------------------------------------------------------------------------------------------- ss


def test_parse_ss_real_stalled_link() -> None:
    stalled, listener = parse_ss(STALLED_REAL)
    assert stalled == {"state": "ESTAB", "recv_q": 0, "send_q": 4096, "local": ("127.0.0.1", 44360),
                       "peer": ("127.0.0.1", 50052), "unacked": 1, "lastsnd_ms": 2156, "lastrcv_ms": 5508,
                       "lastack_ms": 5508, "retrans": (1, 5), "rto_ms": 3264, "backoff": 4, "rtt_ms": 0.024,
                       "rttvar_ms": 0.013, "bytes_acked": 101, "bytes_received": 40, "bytes_sent": 24676, "notsent": 0}
    assert listener["local"] == ("127.0.0.1", 50052) and listener["unacked"] == 0 and listener["retrans"] == (0, 0)
    assert link_state.link_stalled(stalled, 4.0) and not link_state.link_stalled(stalled, 6.0) and not link_state.link_stalled(listener, 1)


def test_parse_ss_real_line_with_state_column() -> None:
    first, second = parse_ss(IDLE_REAL)
    assert (first["state"], first["recv_q"], first["send_q"]) == ("ESTAB", 4900, 0)
    assert (second["local"], second["peer"], second["lastack_ms"]) == (("127.0.0.1", 38004), ("127.0.0.1", 40437), 1220)


@pytest.mark.parametrize(("line", "peer"), [
    (_ss_line("[::ffff:10.77.0.12]:50052", local="[::ffff:10.77.0.11]:41234"), ("10.77.0.12", 50052)),
    (_ss_line("[fe80::1%eth0]:50052", local="[fe80::2%eth0]:41234"), ("fe80::1", 50052)),
    (_ss_line("[2001:DB8::0:1]:50052", local="[2001:db8::2]:1"), ("2001:db8::1", 50052)),
    (_ss_line("10.77.0.12%lfbr0:50052", local="10.77.0.11:1"), ("10.77.0.12", 50052)),
])
def test_parse_ss_addresses(line: str, peer: tuple[str, int]) -> None:
    assert [conn["peer"] for conn in parse_ss(line)] == [peer]


@pytest.mark.parametrize("text", ["", "Recv-Q Send-Q Local Address:Port Peer Address:Port",
                                  "0 0 nonsense", "garbage 1 2 3 4", "0 0 10.0.0.1:x 10.0.0.2:50052"])
def test_parse_ss_skips_what_is_not_a_socket(text: str) -> None:
    assert parse_ss(text) == []


def _links(*lines: str, stall: float = 4.0) -> dict[str, dict[str, Any]]:
    return worker_links(parse_ss("\n".join(lines)), LAB, stall)


@pytest.mark.parametrize(("lines", "expected"), [
    ((_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.13:50052")), {"lab2": "ok", "lab3": "ok"}),
    ((_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.13:50052", sendq=4096, unacked=3, lastack=4300)),
     {"lab2": "ok", "lab3": "stalled"}),
    # unacked data but a recent ACK: busy, not stalled
    ((_ss_line("10.77.0.12:50052", sendq=65536, unacked=40, lastack=3), _ss_line("10.77.0.13:50052")),
     {"lab2": "ok", "lab3": "ok"}),
    # an old ACK with nothing in flight: idle, not stalled
    ((_ss_line("10.77.0.12:50052", lastack=900000), _ss_line("10.77.0.13:50052")), {"lab2": "ok", "lab3": "ok"}),
    ((_ss_line("10.77.0.12:50052"),), {"lab2": "ok", "lab3": "lost"}),
    # the orchestrator's own rpc-server: lab3's address is the LOCAL end, llama-server is not connected to it
    ((_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.11:41234", local="10.77.0.13:50052")),
     {"lab2": "ok", "lab3": "lost"}),
    # another port on the worker's host is not the worker
    ((_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.13:22", sendq=1, unacked=1, lastack=9000)),
     {"lab2": "ok", "lab3": "lost"}),
    # a second connection to the same worker: the stalled one wins
    ((_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.12:50052", local="10.77.0.11:5", unacked=1, lastack=8000),
      _ss_line("10.77.0.13:50052", state="ESTAB ")), {"lab2": "stalled", "lab3": "ok"}),
])
def test_worker_links(lines: tuple[str, ...], expected: dict[str, str]) -> None:
    assert {host: info["link"] for host, info in _links(*lines).items()} == expected


def test_worker_links_details() -> None:
    links = _links(_ss_line("10.77.0.13:50052", sendq=4096, unacked=3, lastack=4300))
    assert links["lab3"] == {"address": "10.77.0.13", "port": 50052, "link": "stalled", "unacked": 3,
                             "lastack_ms": 4300, "send_q": 4096, "retrans": [1, 5], "silent_ms": 4300,
                             "awaiting_ms": 0, "worker": "lab3:50052", "traffic": {
                                 "connections": 1, "rtt_ms": 0.31, "rttvar_ms": 0.1, "sent_bytes": 4321,
                                 "received_bytes": 0, "retransmits": 5, "unacked_bytes": 4096, "notsent_bytes": 0}}
    assert links["lab2"]["lastack_ms"] is None and links["lab2"]["link"] == "lost" and links["lab2"]["traffic"] is None
    assert _links(_ss_line("10.77.0.13:50052", unacked=3, lastack=4300), stall=5.0)["lab3"]["link"] == "ok"


@pytest.mark.parametrize(("unacked", "lastsnd", "lastrcv", "expected"), [
    (0, 5000, 9000, 5000),  # request sent 5 s ago, acknowledged, the last answer came before it: waiting
    (0, 9000, 5000, 5000),  # part of an answer came 5 s ago, after the request: quiet as long
    (0, 5000, 5000, 5000),
    (2, 5000, 9000, 0),  # data unacknowledged: link_stalled's case, not this one
    (0, 0, 9000, 0),  # data went out just now (ss leaves zero timers out)
])
def test_awaiting_ms(unacked: int, lastsnd: int, lastrcv: int, expected: int) -> None:
    conn = {"unacked": unacked, "lastsnd_ms": lastsnd, "lastrcv_ms": lastrcv}
    assert link_state.awaiting_ms(conn) == expected


def test_a_waiting_link_is_stalled_only_when_its_host_is_unreachable() -> None:
    conns = parse_ss("\n".join((_ss_line("10.77.0.12:50052", lastack=9000, lastsnd=6500),
                                _ss_line("10.77.0.13:50052", lastack=9000, lastsnd=1200))))
    links = worker_links(conns, LAB, 4.0)
    assert {host: (info["link"], info["awaiting_ms"]) for host, info in links.items()} == {
        "lab2": ("ok", 6500), "lab3": ("ok", 1200)}
    assert link_state.awaiting_workers(links, 4.0) == ["lab2"] and link_state.awaiting_workers(links, 1.0) == ["lab2", "lab3"]
    cut = worker_links(conns, LAB, 4.0, unreachable={"lab2", "lab3"})
    # lab3 has waited 1.2 s only: a worker may compute that long without being lost
    assert (cut["lab2"]["link"], cut["lab2"]["silent_ms"], cut["lab3"]["link"]) == ("stalled", 6500, "ok")
    assert gate_decision._stall_reason("lab2", cut["lab2"]) == (
        "worker lab2 (10.77.0.12:50052) has not answered llama-server's request for 6.5 s and its host does not "
        "answer ping")


@pytest.mark.parametrize("ipv6", [False, True])
def test_echo_request_and_reply(ipv6: bool) -> None:
    request = host_observation.echo_request(0x1234, ipv6)
    assert request[0] == (128 if ipv6 else 8) and request[6:8] == b"\x12\x34"
    reply = bytes((129 if ipv6 else 0,)) + request[1:]
    assert host_observation.is_echo_reply(reply, 0x1234, ipv6) and not host_observation.is_echo_reply(reply, 0x1235, ipv6)
    assert not host_observation.is_echo_reply(request, 0x1234, ipv6) and not host_observation.is_echo_reply(reply[:7], 0x1234, ipv6)


@pytest.mark.parametrize("data, expected", [
    # RFC 1071's worked example: 0001 f203 f4f5 f6f7 sums to ddf2, checksum 220d
    (bytes.fromhex("0001f203f4f5f6f7"), 0x220D),
    (b"", 0xFFFF),
    (b"\x01", 0xFEFF),  # odd length: padded with a zero byte
])
def test_icmp_checksum(data: bytes, expected: int) -> None:
    assert host_observation.icmp_checksum(data) == expected


def test_an_ipv4_request_checks_out_and_carries_id_and_sequence() -> None:
    packet = host_observation.echo_request(7, ident=0x1234)
    assert packet[0] == 8 and host_observation.icmp_checksum(packet) == 0  # a correct checksum sums to zero
    assert struct.unpack("!HH", packet[4:8]) == (0x1234, 7)


def test_ipv6_request_leaves_the_checksum_to_the_kernel() -> None:
    packet = host_observation.echo_request(2, ipv6=True, ident=1)
    assert packet[0] == 128 and packet[2:4] == b"\0\0"


def reply(ident: int, seq: int, kind: int = 0) -> bytes:
    return struct.pack("!BBHHH", kind, 0, 0, ident, seq) + b"x"


@pytest.mark.parametrize("packet, ipv6, header, expected", [
    (reply(5, 9), False, False, (5, 9)),
    (bytes([0x45]) + b"\0" * 19 + reply(5, 9), False, True, (5, 9)),        # raw IPv4: 20-byte header first
    (bytes([0x46]) + b"\0" * 23 + reply(5, 9), False, True, (5, 9)),        # with IP options (IHL 6)
    (reply(5, 9, kind=8), False, False, None),                               # our own request, looped back
    (reply(5, 9, kind=129), True, False, (5, 9)),
    (reply(5, 9, kind=0), True, False, None),                                # not ICMPv6's echo reply
    (b"\0\0\0", False, False, None),
    (b"", False, True, None),
])
def test_reply_parsing(packet: bytes, ipv6: bool, header: bool, expected: tuple[int, int] | None) -> None:
    assert host_observation.echo_reply_of(packet, ipv6, header) == expected


ECHO_PROGRAM = """
import asyncio, importlib, sys
gate = importlib.import_module(sys.argv[1])
async def main():
    return [await gate.icmp_echo("127.0.0.1", 1.0, 7), await gate.icmp_echo("192.0.2.1", 0.3, 8)]
print(asyncio.run(main()))
"""


@pytest.mark.parametrize(("groups", "expected"), [
    ("0 2147483647", "[True, False]"),  # systemd's default: every group may ping
    ("1 0", "[None, None]"),  # the kernel's default: nobody (not even root) gets an ICMP datagram socket
])
def test_icmp_echo_on_real_sockets(groups: str, expected: str) -> None:
    """In a private network namespace with ``ping_group_range`` set: loopback answers, an address of
    TEST-NET-1 (RFC 5737) never does, and without the permission the probe says it cannot tell."""
    require(shutil.which("unshare") is not None and os.geteuid() == 0, "root and unshare (a private network namespace)")
    shell = "ip link set lo up && echo '%s' > /proc/sys/net/ipv4/ping_group_range && exec \"$0\" -c \"$1\" \"$2\""
    out = subprocess.run(["unshare", "-n", "sh", "-c", shell % groups, sys.executable, ECHO_PROGRAM, host_observation.__name__],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.strip() == expected


@pytest.mark.parametrize(("current", "value", "note"), [
    ("1\t0\n", "999 999", "set to group 999 alone (it was empty)"),  # the kernel's default, Debian 12's
    ("0 2147483647", None, "0-2147483647 already lets group 999 ping"),  # systemd's upstream default
    ("999 999", None, "already lets group 999 ping"),  # our own setting, on the second deploy
    ("100 200", None, "leaves out group 999 and was set by someone"),  # never widened
    ("garbage", None, "cannot read"),
])
def test_ping_group_range(current: str, value: str | None, note: str) -> None:
    got_value, got_note = host_observation.ping_group_range(current, 999)
    assert got_value == value and note in got_note


def test_pinger_judges_only_hosts_that_answered_before(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"10.77.0.12": True, "10.77.0.13": False}

    async def echo(address: str, timeout: float, seq: int) -> bool | None:
        return answers[address]

    monkeypatch.setattr(gate_watchdog, "icmp_echo", echo)
    pinger = gate_watchdog.Pinger()
    names = {"lab2": "10.77.0.12", "lab3": "10.77.0.13"}
    # nothing answered yet: nobody is judged (lab3 may drop ping by policy), but lab2 is known from now on
    assert asyncio.run(pinger.unreachable(names)) == set()
    assert pinger.answers == {"10.77.0.12": "ok", "10.77.0.13": "no answer"} and pinger.answered == {"10.77.0.12"}
    answers["10.77.0.12"] = False
    assert asyncio.run(pinger.unreachable(names)) == {"lab2"}
    answers["10.77.0.12"] = None  # may not ping any more: unknown, not unreachable
    assert asyncio.run(pinger.unreachable(names)) == set() and pinger.answers["10.77.0.12"] == "unavailable"


def test_count_stalls() -> None:
    stalled = _links(_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.13:50052", unacked=1, lastack=5000))
    assert count_stalls({}, stalled) == {"lab2": 0, "lab3": 1}
    assert count_stalls({"lab2": 3, "lab3": 1}, stalled) == {"lab2": 0, "lab3": 2}
    assert count_stalls({"lab3": 4}, None) == {}


# ---------------------------------------------------------------------------------------------------------- decide

OK_LINKS = _links(_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.13:50052"))
STALL_LINKS = _links(_ss_line("10.77.0.12:50052"), _ss_line("10.77.0.13:50052", sendq=4096, unacked=3, lastack=4300))
LOST_LINKS = _links(_ss_line("10.77.0.12:50052"))
SERVING_MEM = Memory(SERVING, "llama-server is serving", None, 0, 1234, frozenset({"lab2", "lab3"}))
RESTARTED = dataclasses.replace(SERVING_MEM, state=DOWN, reason="worker lab3 ...; restarting llama-server (pid 1234)",
                                restart_at=1000.0, restart_pid=1234)


def _obs(active: str | None = "active", pid: int = 1234, health: int | str | None = 200,
         links: dict[str, Any] | None | str = "ok", stalls: dict[str, int] | None = None,
         canary: CanaryOutcome | None = None, now: float = 1005.0) -> Observation:
    return Observation(now, active, pid, health, OK_LINKS if links == "ok" else links,  # type: ignore[arg-type]
                       stalls or {}, canary)


STUCK_CANARY = CanaryOutcome(1234, False, True, False, 60.0)


@pytest.mark.parametrize(("obs", "mem", "state", "reason", "action"), [
    (_obs(), Memory(), SERVING, "llama-server is serving", "none"),
    (_obs(health=503), Memory(), LOADING, "llama-server is loading the model", "none"),
    (_obs(health="refused"), Memory(), LOADING, "llama-server is starting", "none"),
    (_obs(health=500), SERVING_MEM, DOWN, "llama-server /health answered 500", "none"),
    (_obs(active="activating", pid=0, health=None), SERVING_MEM, DOWN,
     "llama-server is activating (waiting for workers or restarting)", "none"),
    (_obs(active="failed", pid=0, health=None), Memory(), DOWN,
     "llama-server is failed (waiting for workers or restarting)", "none"),
    # no answer from systemctl or /health: nothing changes
    (_obs(active=None, pid=0, health=None), SERVING_MEM, SERVING, "llama-server is serving", "none"),
    (_obs(active=None, pid=0, health=None), Memory(), DOWN,
     "cannot read the state of llamafleet-llama-server.service (systemctl show gave no answer)", "none"),
    (_obs(health="timeout"), SERVING_MEM, SERVING, "llama-server is serving", "none"),
    (_obs(health="timeout"), Memory(LOADING, "x"), LOADING, "x", "none"),
    # a stall seen once is not yet a stall; twice it is
    (_obs(links=STALL_LINKS, stalls={"lab3": 1}), SERVING_MEM, SERVING, "llama-server is serving", "none"),
    (_obs(links=STALL_LINKS, stalls={"lab2": 0, "lab3": 2}), SERVING_MEM, DOWN,
     "worker lab3 (10.77.0.13:50052) stopped acknowledging: 4096 bytes unsent or unacked (3 segments in flight, "
     "5 retransmitted), no ACK for 4.3 s; restarting llama-server (pid 1234)", "restart"),
    # a stall while loading (weights going out) also restarts
    (_obs(health=503, links=STALL_LINKS, stalls={"lab3": 2}), Memory(LOADING, "loading"), DOWN,
     "worker lab3 (10.77.0.13:50052) stopped acknowledging: 4096 bytes unsent or unacked (3 segments in flight, "
     "5 retransmitted), no ACK for 4.3 s; restarting llama-server (pid 1234)", "restart"),
    (_obs(links=LOST_LINKS), SERVING_MEM, DOWN,
     "worker lab3 (10.77.0.13:50052) lost its connection from llama-server; restarting llama-server (pid 1234)",
     "restart"),
    # never seen connected by this llama-server: say so, do not restart in a loop
    (_obs(links=LOST_LINKS), Memory(LOADING, "loading", seen_pid=1234, seen_links=frozenset({"lab2"})), DOWN,
     "llama-server has no connection to worker lab3 (10.77.0.13:50052) (check the gate's worker addresses)", "none"),
    (_obs(links=LOST_LINKS, pid=999), SERVING_MEM, DOWN,
     "llama-server has no connection to worker lab3 (10.77.0.13:50052) (check the gate's worker addresses)", "none"),
    # ss gave no answer: links unknown, health decides
    (_obs(links=None), Memory(), SERVING, "llama-server is serving", "none"),
    (_obs(canary=STUCK_CANARY), SERVING_MEM, DOWN,
     "canary completion got no answer in 60 s and no token was produced; restarting llama-server (pid 1234)",
     "restart"),
    (_obs(canary=dataclasses.replace(STUCK_CANARY, progress=None)), SERVING_MEM, DOWN,
     "canary completion got no answer in 60 s and no token was produced; restarting llama-server (pid 1234)",
     "restart"),
    (_obs(canary=dataclasses.replace(STUCK_CANARY, progress=True)), SERVING_MEM, SERVING, "llama-server is serving",
     "none"),
    (_obs(canary=dataclasses.replace(STUCK_CANARY, pid=77)), SERVING_MEM, SERVING, "llama-server is serving", "none"),
    (_obs(canary=CanaryOutcome(1234, True, False, None, 0.2)), SERVING_MEM, SERVING, "llama-server is serving",
     "none"),
    # after a restart: the reason stays until serving again, and no second action within the grace or same pid
    (_obs(active="activating", pid=0, health=None), RESTARTED, DOWN, RESTARTED.reason, "none"),
    (_obs(pid=2000, health=503, links=_links()), RESTARTED, DOWN, RESTARTED.reason, "none"),
    (_obs(links=STALL_LINKS, stalls={"lab3": 5}, now=1010.0, pid=2000), RESTARTED, DOWN, RESTARTED.reason, "none"),
    (_obs(links=STALL_LINKS, stalls={"lab3": 5}, now=1030.0), RESTARTED, DOWN, RESTARTED.reason, "none"),
    (_obs(links=STALL_LINKS, stalls={"lab3": 5}, now=1030.0, pid=2000), RESTARTED, DOWN,
     "worker lab3 (10.77.0.13:50052) stopped acknowledging: 4096 bytes unsent or unacked (3 segments in flight, "
     "5 retransmitted), no ACK for 4.3 s; restarting llama-server (pid 2000)", "restart"),
    (_obs(pid=2000), RESTARTED, SERVING, "llama-server is serving", "none"),
])
def test_decide(obs: Observation, mem: Memory, state: str, reason: str, action: str) -> None:
    assert decide(obs, mem, CFG) == Decision(state, reason, action)


def test_a_stall_restarts_only_once_it_lasts_restart_after() -> None:
    cfg = dataclasses.replace(CFG, restart_after=30.0)
    short = decide(_obs(links=STALL_LINKS, stalls={"lab3": 2}), SERVING_MEM, cfg)
    assert (short.state, short.action) == (DOWN, "none")
    assert short.reason.endswith("no ACK for 4.3 s; llama-server is restarted if it lasts 30 s")
    # the link heals before then: serving again, no reload
    mem = remember(SERVING_MEM, _obs(links=STALL_LINKS, stalls={"lab3": 2}), short)
    assert decide(_obs(), mem, cfg) == Decision(SERVING, "llama-server is serving")
    # it does not: restart once no ACK came for restart_after
    lab3 = _ss_line("10.77.0.13:50052", sendq=4096, unacked=3, lastack=30500)
    long_links = _links(_ss_line("10.77.0.12:50052"), lab3)
    long = decide(_obs(links=long_links, stalls={"lab3": 27}), mem, cfg)
    assert (long.state, long.action) == (DOWN, "restart")
    assert long.reason.endswith("no ACK for 30.5 s; restarting llama-server (pid 1234)")


@pytest.mark.parametrize(("words", "endpoints"), [
    (["/opt/b/llama-server", "-m", "/m.gguf", "--rpc", "10.77.0.12:50052,10.77.0.13:50052", "-ngl", "19"],
     [("10.77.0.12", 50052), ("10.77.0.13", 50052)]),
    (["/opt/b/llama-server", "--rpc=127.0.0.1:50300"], [("127.0.0.1", 50300)]),
    (["/opt/b/llama-server", "-m", "/m.gguf"], []),
    (["/opt/b/llama-server", "--rpc"], []),
])
def test_rpc_endpoints_of_a_command_line(words: list, endpoints: list) -> None:
    # /proc/PID/cmdline: each word NUL-terminated
    assert rpc_endpoints(b"".join(w.encode() + b"\0" for w in words)) == endpoints


def test_running_workers_follow_llama_servers_command_line() -> None:
    # a benchmark's proxy in front of lab2: named by itself; lab3 keeps its name; lab2 (not in --rpc) is not watched
    running = running_workers(LAB, [("127.0.0.1", 50300), ("10.77.0.13", 50052)])
    assert [(w.host, w.address, w.port) for w in running] == [("127.0.0.1:50300", "127.0.0.1", 50300),
                                                              ("lab3", "10.77.0.13", 50052)]
    assert running_workers(LAB, None) == LAB


def test_remember_tracks_restarts_and_seen_links() -> None:
    restart = Decision(DOWN, "stalled; restarting llama-server (pid 1234)", "restart")
    mem = remember(SERVING_MEM, _obs(links=STALL_LINKS, now=1000.0), restart)
    assert (mem.state, mem.restart_at, mem.restart_pid) == (DOWN, 1000.0, 1234)
    mem = remember(mem, _obs(active="activating", pid=0, links=_links(), now=1001.0), Decision(DOWN, mem.reason))
    assert (mem.restart_at, mem.seen_links) == (1000.0, frozenset())
    mem = remember(mem, _obs(pid=2000, health=503, links=LOST_LINKS, now=1020.0), Decision(DOWN, mem.reason))
    assert (mem.seen_pid, mem.seen_links) == (2000, frozenset({"lab2"}))
    mem = remember(mem, _obs(pid=2000, now=1030.0), Decision(SERVING, "llama-server is serving"))
    assert (mem.restart_at, mem.seen_links, mem.state) == (None, frozenset({"lab2", "lab3"}), SERVING)


# ---------------------------------------------------------------------------------------------------------- config

RAW = {"listen_port": 8080, "upstream_port": 18080, "unit": "llamafleet-llama-server.service",
       "workers": [{"host": "lab2", "address": "10.77.0.12", "port": 50052}]}


def test_plan_workers_lists_each_remote_endpoint_once() -> None:
    devices = [{"host": "lab2", "endpoint": "10.77.0.12:50052", "local": False},
               {"host": "lab2", "endpoint": "10.77.0.12:50052", "local": False},  # a second device, same server
               {"host": "gpu1", "endpoint": "[fd00::7]:50053", "local": False},
               {"host": "lab1", "endpoint": None, "local": True}]
    workers = gate_config.plan_workers(devices)
    assert workers == [{"host": "lab2", "endpoint": "10.77.0.12:50052", "address": "10.77.0.12", "port": 50052},
                       {"host": "gpu1", "endpoint": "[fd00::7]:50053", "address": "fd00::7", "port": 50053}]
    loaded = load_config({"listen_port": 8080, "upstream_port": 18080, "unit": "x.service", "workers": workers})
    assert loaded.workers == (Worker("lab2", "10.77.0.12", 50052), Worker("gpu1", "fd00::7", 50053))


def test_load_config_defaults() -> None:
    cfg = load_config(dict(RAW))
    assert cfg.workers == (Worker("lab2", "10.77.0.12", 50052),)
    assert (cfg.listen_host, cfg.upstream_host) == ("0.0.0.0", "127.0.0.1")
    assert cfg.state_file is None  # no state file unless the config names one (the role: GATE_STATE_PATH)
    assert (cfg.deadline, cfg.request_timeout, cfg.stall_seconds, cfg.poll_interval, cfg.canary_interval,
            cfg.canary_deadline, cfg.restart_grace, cfg.max_connections) == (10, 600, 4, 1, 30, 60, 15, 256)
    assert (cfg.api_key_file, cfg.tls_cert, cfg.tls_key) == (None, None, None)
    assert load_config(dict(RAW, deadline=2, tls_cert="/c", tls_key="/k")).deadline == 2.0


@pytest.mark.parametrize(("change", "key"), [
    ({"listen_port": None}, "listen_port"), ({"upstream_port": 70000}, "upstream_port"),
    ({"listen_port": True}, "listen_port"), ({"unit": ""}, "unit"), ({"workers": "lab2"}, "workers"),
    ({"workers": [{"host": "lab2", "port": 50052}]}, "workers[0].address"),
    ({"workers": [{"host": "lab2", "address": "10.0.0.2", "port": "x"}]}, "workers[0].port"),
    ({"workers": [7]}, "workers[0]"), ({"deadline": 0}, "deadline"), ({"stall_seconds": "4"}, "stall_seconds"),
    ({"canary_deadline": -1}, "canary_deadline"), ({"tls_cert": "/c"}, "tls_key"), ({"tls_key": "/k"}, "tls_cert"),
    ({"max_connections": 0}, "max_connections"), ({"state_file": 3}, "state_file"), ({"listen": 1}, "listen"),
    ({"api_key_file": 7}, "api_key_file"),
])
def test_load_config_errors_name_the_key(change: dict[str, Any], key: str) -> None:
    raw = {name: value for name, value in dict(RAW, **change).items() if value is not None}
    with pytest.raises(ValueError, match=r"(?<![\w.])%s(?![\w.\[])" % re.escape(key)):
        load_config(raw)


# ---------------------------------------------------------------------------------------------------------- HTTP


def test_error_response_and_sse_event() -> None:
    raw = http_wire.error_response(503, "worker lab3 stalled", 15)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.split(b"\r\n") == [b"HTTP/1.1 503 Service Unavailable", b"Content-Type: application/json; charset=utf-8",
                                   b"Content-Length: %d" % len(body), b"Retry-After: 15", b"Connection: close"]
    assert json.loads(body) == {"error": {"code": 503, "type": "unavailable_error",
                                          "message": "llamafleet: worker lab3 stalled"}}
    assert http_wire.error_response(504, "x", body=False).endswith(b"Connection: close\r\n\r\n")
    assert json.loads(http_wire.error_response(504, "slow").split(b"\r\n\r\n")[1])["error"]["type"] == "timeout_error"
    event = http_wire.sse_error_event(503, "down")
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[6:]) == http_wire.error_object(503, "down")
    assert http_wire.sse_error_event(503, "down", b"}\n").startswith(b"\ndata: ")
    assert http_wire.sse_error_event(503, "down", b'"}').startswith(b"\n\ndata: ")


def test_request_head_rewriting() -> None:
    req = http_wire.parse_request_head(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: gate:8080\r\n"
                                       b"Authorization: Bearer s3cret\r\nConnection: keep-alive, X-Hop\r\nKeep-Alive: 5\r\n"
                                       b"X-Hop: 1\r\nExpect: 100-continue\r\nContent-Length: 2\r\nX-Other:  v \r\n\r\n")
    assert (req.method, req.path, req.version) == ("POST", "/v1/chat/completions", "1.1")
    assert http_wire.request_body(req) == ("length", 2) and http_wire.wants_continue(req)
    assert http_wire.upstream_request_head(req) == (
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: gate:8080\r\nAuthorization: Bearer s3cret\r\n"
        b"Content-Length: 2\r\nX-Other: v\r\nConnection: close\r\n\r\n")


def test_response_head_rewriting() -> None:
    resp = http_wire.parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nKeep-Alive: timeout=5\r\n"
                                         b"Connection: keep-alive\r\nTransfer-Encoding: chunked\r\nServer: llama.cpp\r\n\r\n")
    assert http_wire.client_response_head(resp) == (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                                    b"Transfer-Encoding: chunked\r\nServer: llama.cpp\r\n"
                                                    b"Connection: close\r\n\r\n")
    assert http_wire.is_event_stream(resp) and http_wire.response_body("GET", resp) == ("chunked", 0)
    assert http_wire.response_body("HEAD", resp) == ("none", 0)


@pytest.mark.parametrize(("head", "status"), [
    (b"GET / HTTP/1.1\r\nHost x\r\n\r\n", 400), (b"HELLO\r\n\r\n", 400), (b"GET / HTTP/2.0\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n", 400), (b"GET / HTTP/1.1\r\nA: b\nC: d\r\n\r\n", 400),
    (b"GET  / HTTP/1.1\r\nHost: gate\r\n\r\n", 400),
    # RFC 9112 3.2: HTTP/1.1 needs one Host; a second one is refused in any version
    (b"GET / HTTP/1.1\r\n\r\n", 400), (b"GET / HTTP/1.1\r\nX-Host: gate\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: gate\r\nHost: gate\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: gate\r\nhost: evil.example\r\n\r\n", 400),
    (b"GET / HTTP/1.0\r\nHOST: a\r\nHost: b\r\n\r\n", 400), (b"GET / HTTP/1.1\r\nHost :gate\r\n\r\n", 400),
])
def test_parse_request_head_refuses_garbage(head: bytes, status: int) -> None:
    with pytest.raises(HeadError) as info:
        http_wire.parse_request_head(head)
    assert info.value.status == status


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n", b"GET /health HTTP/1.1\r\nhost: gate\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost:\r\n\r\n",  # empty: allowed when the target has no authority (RFC 9112 3.2)
    b"GET /health HTTP/1.0\r\n\r\n", b"GET /health HTTP/1.0\r\nUser-Agent: probe\r\n\r\n",
    b"GET /health HTTP/1.0\r\nHost: gate\r\n\r\n",
])
def test_parse_request_head_host_rules_accept(head: bytes) -> None:
    assert http_wire.parse_request_head(head).path == "/health"


@pytest.mark.parametrize(("headers", "framing"), [
    (b"", ("none", 0)), (b"Content-Length: 0\r\n", ("none", 0)), (b"Content-Length: 12\r\n", ("length", 12)),
    (b"Content-Length: 12\r\nContent-Length: 12\r\n", ("length", 12)),
    (b"Transfer-Encoding: chunked\r\n", ("chunked", 0)), (b"Transfer-Encoding: gzip, chunked\r\n", 411),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n", 400), (b"Content-Length: 1\r\nContent-Length: 2\r\n", 400),
    (b"Content-Length: -1\r\n", 400), (b"Content-Length:  5 \r\n", ("length", 5)), (b"Content-Length: 007\r\n", ("length", 7)),
    # only ASCII digits: "\xb2" is latin-1 "²" (isdigit() but not int()), no sign, separator, other blank or a
    # number past 18 digits (int() refuses 4300 digits and more)
    (b"Content-Length: \xb2\r\n", 400), (b"Content-Length: 1\xb2\r\n", 400), (b"Content-Length: +5\r\n", 400),
    (b"Content-Length: 5_0\r\n", 400), (b"Content-Length: 5\x0b\r\n", 400), (b"Content-Length: \xa05\r\n", 400),
    (b"Content-Length: 5 5\r\n", 400), (b"Content-Length: 5, 5\r\n", 400), (b"Content-Length: 0x5\r\n", 400),
    (b"Content-Length:\r\n", 400), (b"Content-Length: " + b"9" * 19 + b"\r\n", 400),
    (b"Content-Length: " + b"1" * 5000 + b"\r\n", 400), (b"Content-Length: 5\r\nContent-Length: \xb2\r\n", 400),
])
def test_request_body_framing(headers: bytes, framing: Any) -> None:
    req = http_wire.parse_request_head(b"POST /completion HTTP/1.1\r\nHost: gate\r\n" + headers + b"\r\n")
    if isinstance(framing, int):
        with pytest.raises(HeadError) as info:
            http_wire.request_body(req)
        assert info.value.status == framing
    else:
        assert http_wire.request_body(req) == framing


# values as they reach the framing (after the header's own spaces and tabs are gone), Unicode digits included
BAD_LENGTHS = ["\u00b2", "\u0663", "\uff15", "+5", "-5", " 5 ", "5 ", "5_0", "5.0", "1e3", "0x5", "", "\xa05", "5\x0b",
               "9" * 19, "1" * 5000]


@pytest.mark.parametrize("value", BAD_LENGTHS)
def test_content_length_other_than_ascii_digits_is_a_framing_error(value: str) -> None:
    req = http_wire.RequestHead("POST", "/completion", "1.1", [("Host", "gate"), ("Content-Length", value)])
    with pytest.raises(HeadError) as info:
        http_wire.request_body(req)
    assert info.value.status == 400
    resp = http_wire.ResponseHead("1.1", 200, "OK", [("Content-Length", value)])
    with pytest.raises(HeadError) as info:
        http_wire.response_body("GET", resp)
    assert info.value.status == 502


@pytest.mark.parametrize(("lengths", "framing"), [
    ([], ("close", 0)), (["0"], ("length", 0)), (["42"], ("length", 42)), (["42", "42"], ("length", 42)),
    (["9" * 18], ("length", 10 ** 18 - 1)), (["42", "43"], 502), (["42", "\u00b2"], 502),
])
def test_response_body_framing(lengths: list[str], framing: Any) -> None:
    resp = http_wire.ResponseHead("1.1", 200, "OK", [("Content-Length", value) for value in lengths])
    if isinstance(framing, int):
        with pytest.raises(HeadError) as info:
            http_wire.response_body("GET", resp)
        assert info.value.status == framing
    else:
        assert http_wire.response_body("GET", resp) == framing
    # no body whatever the length says: HEAD, 204, 304
    assert http_wire.response_body("HEAD", resp) == ("none", 0)
    assert http_wire.response_body("GET", dataclasses.replace(resp, status=304)) == ("none", 0)


def test_chunk_decoder_byte_by_byte_with_extensions_and_trailers() -> None:
    body = b"5;name=x\r\nhello\r\n1A\r\n" + b"z" * 26 + b"\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT"
    decoder = ChunkDecoder()
    pieces = [piece for index in range(len(body)) for piece in decoder.feed(body[index:index + 1])]
    assert b"".join(pieces) == b"hello" + b"z" * 26 and decoder.done
    whole = ChunkDecoder()
    assert whole.feed(http_wire.encode_chunk(b"abc") + http_wire.LAST_CHUNK) == [b"abc"] and whole.done


@pytest.mark.parametrize("body", [b"zz\r\n", b"3\r\nabcX\r\n", b"1" * 5000])
def test_chunk_decoder_errors(body: bytes) -> None:
    with pytest.raises(ChunkError):
        ChunkDecoder().feed(body)


def test_systemctl_metrics_and_progress() -> None:
    assert host_observation.parse_systemctl_show("MainPID=4321\nActiveState=active\n") == ("active", 4321)
    assert host_observation.parse_systemctl_show("ActiveState=activating\nMainPID=0\n") == ("activating", 0)
    text = ("# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.\n"
            "# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 350\n"
            "llamacpp:prompt_tokens_total 1200\nllamacpp:n_decode_total 332\nllamacpp:requests_processing 1\n")
    before = host_observation.parse_metrics(text)
    assert before["llamacpp:n_decode_total"] == 332.0
    assert host_observation.made_progress(before, dict(before)) is False
    assert host_observation.made_progress(before, dict(before, **{"llamacpp:n_decode_total": 333.0})) is True
    assert host_observation.made_progress(before, None) is None and host_observation.made_progress({}, {}) is None


@pytest.mark.parametrize(("value", "text"), [
    (0, "0"), (1, "1"), (178257920, "178257920"), (1795498676.93033, "1795498676.93033"), (0.5, "0.5"),
    (float("nan"), "NaN"), (float("inf"), "+Inf"), (float("-inf"), "-Inf"), (2.0 ** 60, repr(2.0 ** 60)),
])
def test_format_value(value: float, text: str) -> None:
    assert gate_metrics.format_value(value) == text


def test_the_gates_metrics_path_is_the_one_prometheus_scrapes() -> None:
    from llamafleet.core import constants
    assert gate_metrics.GATE_METRICS_PATH == constants.GATE_METRICS_PATH


def test_main_start_reads_systemds_monotonic_start() -> None:
    text = "MainPID=4321\nActiveState=active\nExecMainStartTimestampMonotonic=5123456789\n"
    assert host_observation.parse_systemctl_show(text) == ("active", 4321)
    assert host_observation.main_start(text) == pytest.approx(5123.456789)
    assert host_observation.main_start("MainPID=0\nExecMainStartTimestampMonotonic=0\n") is None
    assert host_observation.main_start("MainPID=0\n") is None
    assert host_observation.systemctl_show_argv("llama-server.service") == [
        "systemctl", "show", "--property=MainPID,ActiveState,ExecMainStartTimestampMonotonic", "--", "llama-server.service"]


def test_track_load_times_each_process_from_its_start_to_its_first_health_200() -> None:
    clock = gate_metrics.LoadClock()
    # systemd started pid 100 at monotonic 50; the gate sees it starting, loading, then ready at 62.5
    clock = gate_metrics.track_load(clock, 100, 50.0, "refused", 51.0, 1000.0)
    clock = gate_metrics.track_load(clock, 100, 50.0, 503, 55.0, 1004.0)
    assert (clock.pid, clock.ready, clock.last_seconds, clock.loads) == (100, False, None, 0)
    clock = gate_metrics.track_load(clock, 100, 50.0, 200, 62.5, 1011.5)
    assert (clock.ready, clock.last_seconds, clock.ready_at, clock.loads) == (True, 12.5, 1011.5, 1)
    # later polls of the same process change nothing (a /health blip is no new load)
    assert gate_metrics.track_load(clock, 100, 50.0, 503, 70.0, 1019.0) == clock
    assert gate_metrics.track_load(clock, 100, 50.0, 200, 80.0, 1029.0) == clock
    # stopped: the last load is kept; a restart, even with the same pid number, is a new load
    stopped = gate_metrics.track_load(clock, 0, None, None, 90.0, 1039.0)
    assert (stopped.pid, stopped.last_seconds, stopped.loads) == (0, 12.5, 1)
    again = gate_metrics.track_load(gate_metrics.track_load(stopped, 100, 95.0, 503, 96.0, 1045.0), 100, 95.0, 200, 99.0, 1048.0)
    assert (again.last_seconds, again.ready_at, again.loads) == (4.0, 1048.0, 2)
    # systemd's start unknown: the load is timed from the first poll that saw the process
    unknown = gate_metrics.track_load(gate_metrics.track_load(gate_metrics.LoadClock(), 7, None, 503, 10.0, 0.0), 7, None, 200, 13.0, 3.0)
    assert unknown.last_seconds == 3.0


def test_gate_metrics_exposition() -> None:
    load = gate_metrics.LoadClock(pid=9, started=1.0, ready=True, last_seconds=8.12345, ready_at=1795500000.5, loads=2)
    text = gate_metrics.render_exposition(gate_metrics.GATE_METRICS, gate_metrics.gate_samples(
        LOADING, 1795500100.0, {"requests": 7, "rejected_503": 2, "aborted": 1}, 3, 1, False, load))
    values = host_observation.parse_metrics(text)
    assert values == {
        'llamafleet_gate_state{state="down"}': 0, 'llamafleet_gate_state{state="loading"}': 1,
        'llamafleet_gate_state{state="serving"}': 0, "llamafleet_gate_state_since_seconds": 1795500100.0,
        "llamafleet_gate_requests_total": 7, "llamafleet_gate_rejected_total": 2, "llamafleet_gate_aborted_total": 1,
        "llamafleet_gate_in_flight": 3, "llamafleet_gate_restarts_total": 1, "llamafleet_gate_degraded": 0,
        "llamafleet_llama_server_load_seconds": 8.123, "llamafleet_llama_server_ready_since_seconds": 1795500000.5,
        "llamafleet_llama_server_loads_total": 2}
    assert "# TYPE llamafleet_gate_restarts_total counter\n" in text
    assert "# TYPE llamafleet_llama_server_load_seconds gauge\n" in text
    # no load seen yet, degraded mode off: those series are absent rather than made up
    bare = host_observation.parse_metrics(gate_metrics.render_exposition(gate_metrics.GATE_METRICS, gate_metrics.gate_samples(
        DOWN, 0.0, {}, 0, 0, None, gate_metrics.LoadClock())))
    assert "llamafleet_llama_server_load_seconds" not in bare and "llamafleet_gate_degraded" not in bare
    assert bare["llamafleet_llama_server_loads_total"] == 0
    with pytest.raises(ValueError, match="unknown metric.*nope"):
        gate_metrics.render_exposition(gate_metrics.GATE_METRICS, [("nope", {}, 1)])


def test_render_exposition_escapes_labels_and_help() -> None:
    text = gate_metrics.render_exposition({"m": ("gauge", "a \\ b\nc")}, [("m", {"k": 'x"y\\z\nw'}, 1.5)])
    assert text == '# HELP m a \\\\ b\\nc\n# TYPE m gauge\nm{k="x\\"y\\\\z\\nw"} 1.5\n'


@pytest.mark.parametrize(("headers", "key", "ok"), [
    (b"", None, True), (b"", "", True), (b"Authorization: Bearer s3cret\r\n", "s3cret", True),
    (b"authorization: Bearer  s3cret \r\n", "s3cret", False), (b"", "s3cret", False),
    (b"Authorization: Bearer s3cre\r\n", "s3cret", False), (b"Authorization: Basic s3cret\r\n", "s3cret", False),
    (b"Authorization: Bearer wrong\r\nAuthorization: Bearer s3cret\r\n", "s3cret", True),
])
def test_bearer_ok(headers: bytes, key: str | None, ok: bool) -> None:
    assert gate_metrics.bearer_ok(http_wire.parse_request_head(b"GET /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\n" + headers + b"\r\n"), key) is ok


def test_admission_and_retry_after() -> None:
    health = http_wire.parse_request_head(b"GET /health HTTP/1.1\r\nHost: gate\r\n\r\n")
    chat = http_wire.parse_request_head(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gate\r\n\r\n")
    assert [gate_decision.admission(state, health) for state in (SERVING, LOADING, DOWN)] == [True, True, False]
    assert [gate_decision.admission(state, chat) for state in (SERVING, LOADING, DOWN)] == [True, True, False]
    assert gate_decision.retry_after(LOADING) < gate_decision.retry_after(DOWN)


def test_write_json_atomic(tmp_path: Path) -> None:
    target = tmp_path / "run" / "gate-state.json"
    atomic_file.write_json_atomic(str(target), {"state": "down"})
    atomic_file.write_json_atomic(str(target), {"state": "serving"})
    assert json.loads(target.read_text()) == {"state": "serving"}
    assert [path.name for path in target.parent.iterdir()] == ["gate-state.json"]


# ---------------------------------------------------------------------------------------------------------- sockets


class FakeLlamaServer(LoopbackServer):
    """A tiny llama-server stand-in on 127.0.0.1 that records what it receives."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.finished: dict[str, float] = {}
        self.closed_by_peer = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return
        self.heads.append(head)
        req = http_wire.parse_request_head(head)
        framing, length = http_wire.request_body(req)
        body = b""
        if framing == "length":
            body = await reader.readexactly(length)
        elif framing == "chunked":
            decoder = ChunkDecoder()
            while not decoder.done:
                body += b"".join(decoder.feed(await reader.read(100)))
        self.bodies.append(body)
        try:
            await getattr(self, "route_" + req.path.strip("/").replace("/", "_"))(reader, writer, body)
        finally:
            writer.transport.abort()

    async def route_json(self, reader: Any, writer: asyncio.StreamWriter, body: bytes) -> None:
        payload = json.dumps({"content": "Paris", "echo": body.decode()}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nKeep-Alive: timeout=5\r\n"
                     b"Connection: keep-alive\r\nContent-Length: %d\r\nX-Custom: yes\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()

    route_health = route_json

    async def route_bad_length(self, reader: Any, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \xb2\r\n\r\n{}")
        await writer.drain()

    async def route_stream(self, reader: Any, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for index in range(3):
            writer.write(http_wire.encode_chunk(b'data: {"content":"t%d"}\n\n' % index))
            await writer.drain()
            await asyncio.sleep(0.4)
        writer.write(http_wire.LAST_CHUNK)
        await writer.drain()
        self.finished["stream"] = time.monotonic()

    async def route_hang(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(http_wire.encode_chunk(b'data: {"content":" the"}\n\n'))
        await writer.drain()
        await self._until_closed(reader)

    async def route_hang_head(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        await self._until_closed(reader)

    async def _until_closed(self, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(100):
                pass
        except OSError:
            pass
        self.closed_by_peer.set()


def _run(scenario: Callable[..., Awaitable[None]], **cfg: Any) -> None:
    run_gate(scenario, FakeLlamaServer(), CFG, 8, **cfg)


async def _request(gate: Gate, raw: bytes, ssl_context: ssl.SSLContext | None = None) -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port, ssl=ssl_context,
                                                   server_hostname="localhost" if ssl_context else None)
    writer.write(raw)
    await writer.drain()
    return reader, writer


async def _exchange(gate: Gate, raw: bytes, ssl_context: ssl.SSLContext | None = None) -> bytes:
    reader, writer = await _request(gate, raw, ssl_context)
    data = await reader.read()
    writer.close()
    return data


def _json_answer(data: bytes) -> tuple[int, dict[str, str], Any]:
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _dechunk(body: bytes) -> bytes:
    decoder = ChunkDecoder()
    data = b"".join(decoder.feed(body))
    assert decoder.done
    return data


CHAT = (b'POST /json HTTP/1.1\r\nHost: gate\r\nAuthorization: Bearer s3cret\r\nConnection: keep-alive\r\n'
        b'Content-Type: application/json\r\nContent-Length: 16\r\n\r\n{"prompt":"hi!"}')


def test_proxy_relays_a_request_byte_exact() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        data = await _exchange(gate, CHAT)
        payload = json.dumps({"content": "Paris", "echo": '{"prompt":"hi!"}'}).encode()
        assert data == (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
                        b"X-Custom: yes\r\nConnection: close\r\n\r\n%s" % (len(payload), payload))
        assert upstream.heads == [b"POST /json HTTP/1.1\r\nHost: gate\r\nAuthorization: Bearer s3cret\r\n"
                                  b"Content-Type: application/json\r\nContent-Length: 16\r\nConnection: close\r\n\r\n"]
        assert upstream.bodies == [b'{"prompt":"hi!"}'] and gate.counters["requests"] == 1

    _run(scenario)


def test_proxy_relays_chunked_request_bodies_and_expect_continue() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        reader, writer = await _request(gate, b"POST /json HTTP/1.1\r\nHost: gate\r\nTransfer-Encoding: chunked\r\n"
                                              b"Expect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"4\r\nabcd\r\n3;x=1\r\nefg\r\n0\r\n\r\n")
        status, _headers, body = _json_answer(await reader.read())
        assert (status, body["echo"], upstream.bodies) == (200, "abcdefg", [b"abcdefg"])
        assert b"Expect" not in upstream.heads[0] and b"Transfer-Encoding: chunked" in upstream.heads[0]

    _run(scenario)


def test_proxy_streams_chunks_as_they_arrive() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        start = time.monotonic()
        reader, writer = await _request(gate, b"POST /stream HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in head and b"Connection: close" in head
        first = await reader.readuntil(b"\n\n\r\n")
        first_at = time.monotonic()
        second = await reader.readuntil(b"\n\n\r\n")
        # the answer still streams on, and the gate counts it as an answer (the watchdog's canary needs none then)
        assert "stream" not in upstream.finished and gate.last_answer > first_at
        rest = await reader.read()
        assert first_at - start < 0.3 and "stream" in upstream.finished and first_at < upstream.finished["stream"] - 0.5
        assert _dechunk(first + second + rest) == b"".join(b'data: {"content":"t%d"}\n\n' % index for index in range(3))
        writer.close()

    _run(scenario)


def test_down_answers_503_at_once_and_health_says_why() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        gate.set_state(DOWN, "worker lab3 (10.77.0.13:50052) stopped acknowledging")
        for raw in (CHAT, b"GET /health HTTP/1.1\r\nHost: gate\r\n\r\n", b"GET /v1/health HTTP/1.1\r\nHost: gate\r\n\r\n"):
            start = time.monotonic()
            status, headers, body = _json_answer(await _exchange(gate, raw))
            assert time.monotonic() - start < 0.5
            assert (status, headers["Retry-After"], headers["Content-Type"]) == (
                503, str(gate_decision.RETRY_AFTER[DOWN]), "application/json; charset=utf-8")
            assert body == {"error": {"code": 503, "type": "unavailable_error", "message":
                                      "llamafleet: worker lab3 (10.77.0.13:50052) stopped acknowledging"}}
        assert upstream.heads == [] and gate.counters["rejected_503"] == 3

    _run(scenario)


def test_the_gate_answers_its_own_metrics_in_every_state_with_the_key() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        gate.metrics_key = lambda: "s3cret"
        gate.metrics_text = lambda: gate_metrics.render_exposition(gate_metrics.GATE_METRICS, gate_metrics.gate_samples(
            gate.state, gate.since, gate.counters, gate.in_flight, 0, None, gate_metrics.LoadClock()))
        gate.set_state(DOWN, "worker lab3 is gone")
        ask = b"GET /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\n%s\r\n"
        data = await _exchange(gate, ask % b"Authorization: Bearer s3cret\r\n")
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Type: text/plain; version=0.0.4" in head
        values = host_observation.parse_metrics(body.decode())
        assert values['llamafleet_gate_state{state="down"}'] == 1 and values["llamafleet_gate_requests_total"] == 0
        status, _headers, error = _json_answer(await _exchange(gate, ask % b""))
        assert (status, error["error"]["type"]) == (401, "authentication_error")
        status, _headers, _error = _json_answer(await _exchange(gate, ask % b"Authorization: Bearer nope\r\n"))
        assert status == 401
        head = await _exchange(gate, b"HEAD /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\nAuthorization: Bearer s3cret\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        # never relayed to llama-server, never counted as a client request
        assert upstream.heads == [] and gate.counters == {"requests": 0, "rejected_503": 0, "aborted": 0}

    _run(scenario)


def _gate_metrics_text(gate: Gate) -> str:
    return gate_metrics.render_exposition(gate_metrics.GATE_METRICS, gate_metrics.gate_samples(
        gate.state, gate.since, gate.counters, gate.in_flight, 0, None, gate_metrics.LoadClock()))


@pytest.mark.parametrize("key_file", ["missing", "empty", "blank", "a directory", "not UTF-8"])
def test_the_gates_metrics_fail_closed_without_a_readable_key(tmp_path: Path, key_file: str) -> None:
    """The config names a key file (llama_server_api_auth on) that cannot give a key: 503 with the reason, and
    never the metrics, whatever Authorization says; the watchdog's own api_key() reads the file."""
    path = tmp_path / "api-key"
    if key_file == "a directory":
        path.mkdir()
    elif key_file != "missing":
        path.write_bytes({"empty": b"", "blank": b" \n\n", "not UTF-8": b"\xff\xfe"}[key_file])

    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        gate.metrics_key = gate_watchdog.Watchdog(gate, gate.cfg).api_key
        gate.metrics_text = lambda: _gate_metrics_text(gate)
        for auth in (b"", b"Authorization: Bearer\r\n", b"Authorization: Bearer \r\n", b"Authorization: Bearer x\r\n"):
            data = await _exchange(gate, b"GET /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\n%s\r\n" % auth)
            status, _headers, error = _json_answer(data)
            assert (status, error["error"]["type"]) == (503, "unavailable_error")
            assert "API key file" in error["error"]["message"] and b"llamafleet_gate" not in data
        head = await _exchange(gate, b"HEAD /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and head.endswith(b"\r\n\r\n")
        assert upstream.heads == []
        # the key written: served with it, 401 without
        if key_file != "a directory":
            path.write_text("s3cret\n")
            ok = await _exchange(gate, b"GET /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\nAuthorization: Bearer s3cret\r\n\r\n")
            assert ok.startswith(b"HTTP/1.1 200 OK\r\n") and b"llamafleet_gate_state" in ok
            denied = await _exchange(gate, b"GET /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\n\r\n")
            assert _json_answer(denied)[0] == 401

    _run(scenario, api_key_file=str(path))


def test_the_gates_metrics_stay_open_when_the_api_key_is_off() -> None:
    """llama_server_api_auth false: the role writes api_key_file "" (none), and the metrics need no key."""
    cfg = load_config(dict(RAW, api_key_file=""))
    assert cfg.api_key_file is None

    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        gate.metrics_key = gate_watchdog.Watchdog(gate, gate.cfg).api_key
        gate.metrics_text = lambda: _gate_metrics_text(gate)
        data = await _exchange(gate, b"GET /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"llamafleet_gate_state" in data

    _run(scenario, api_key_file=cfg.api_key_file)


def test_metrics_response_fails_closed() -> None:
    req = http_wire.parse_request_head(b"GET /llamafleet/metrics HTTP/1.1\r\nHost: gate\r\nAuthorization: Bearer x\r\n\r\n")
    for key in (None, ""):
        assert gate_metrics.metrics_response(req, key, "m 1\n", key_required=True).startswith(b"HTTP/1.1 503 ")
        assert gate_metrics.metrics_response(req, key, "m 1\n", key_required=False).endswith(b"\r\n\r\nm 1\n")
    assert gate_metrics.metrics_response(req, "x", "m 1\n", key_required=True).endswith(b"\r\n\r\nm 1\n")
    assert gate_metrics.metrics_response(req, "y", "m 1\n", key_required=True).startswith(b"HTTP/1.1 401 ")


def test_loading_relays_everything_to_llama_server() -> None:
    """While loading, llama-server answers for itself (503 "Loading model", then its answers the moment it is
    ready): a client that saw /health 200 is never refused by a gate whose next poll has not come yet."""
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        gate.set_state(LOADING, "llama-server is loading the model")
        status, headers, _body = _json_answer(await _exchange(gate, b"GET /health HTTP/1.1\r\nHost: gate\r\n\r\n"))
        assert (status, headers["X-Custom"]) == (200, "yes")
        status, _headers, body = _json_answer(await _exchange(gate, CHAT))
        assert (status, body["echo"]) == (200, '{"prompt":"hi!"}')
        assert len(upstream.heads) == 2

    _run(scenario)


def test_going_down_from_loading_ends_requests_in_flight() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        gate.set_state(LOADING, "llama-server is loading the model")
        reader, writer = await _request(gate, b"POST /hang HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        started = time.monotonic()
        gate.set_state(DOWN, "worker lab3 stopped acknowledging")
        rest = await asyncio.wait_for(reader.read(), timeout=CFG.deadline)
        assert time.monotonic() - started < 2.0
        assert b"worker lab3 stopped acknowledging" in rest
        writer.close()

    _run(scenario)


def test_in_flight_stream_gets_an_error_event_when_the_cluster_goes_down() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        reader, writer = await _request(gate, b"POST /hang HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        first = await reader.readuntil(b"\n\n\r\n")
        start = time.monotonic()
        gate.set_state(DOWN, "worker lab3 stopped acknowledging")
        rest = await reader.read()
        assert time.monotonic() - start < gate.cfg.deadline
        events = _dechunk(first + rest).split(b"\n\n")
        assert events[0] == b'data: {"content":" the"}' and events[2] == b""
        assert json.loads(events[1][len(b"data: "):]) == http_wire.error_object(503, "worker lab3 stopped acknowledging")
        await asyncio.wait_for(upstream.closed_by_peer.wait(), 1)
        assert gate.counters["aborted"] == 1 and gate.in_flight == 0
        writer.close()

    _run(scenario)


def test_in_flight_request_without_answer_gets_503_when_the_cluster_goes_down() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        reader, writer = await _request(gate, b"POST /hang_head HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\n\r\n")
        while not upstream.heads:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        gate.set_state(DOWN, "canary completion got no answer")
        status, _headers, body = _json_answer(await reader.read())
        assert time.monotonic() - start < 0.5
        assert (status, body["error"]["message"]) == (503, "llamafleet: canary completion got no answer")
        writer.close()

    _run(scenario)


def test_silent_upstream_gets_504_after_request_timeout() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        start = time.monotonic()
        status, _headers, body = _json_answer(await _exchange(gate, b"GET /hang_head HTTP/1.1\r\nHost: gate\r\n\r\n"))
        assert 0.5 <= time.monotonic() - start < 1.5
        assert (status, body["error"]["type"]) == (504, "timeout_error")
        assert body["error"]["message"] == "llamafleet: llama-server sent nothing for 0.5 s"

    _run(scenario, request_timeout=0.5)


def test_client_hang_up_closes_the_upstream_connection() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        reader, writer = await _request(gate, b"POST /hang HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\n\r\n")
        await reader.readuntil(b"\n\n\r\n")
        writer.transport.abort()
        await asyncio.wait_for(upstream.closed_by_peer.wait(), 1)
        while gate.in_flight:
            await asyncio.sleep(0.01)

    _run(scenario)


def test_closed_upstream_port_answers_not_running() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        assert upstream.server is not None
        upstream.server.close()
        await upstream.server.wait_closed()
        status, headers, body = _json_answer(await _exchange(gate, CHAT))
        assert (status, body["error"]["message"]) == (503, "llamafleet: " + gate_proxy.NOT_RUNNING)
        assert "Retry-After" in headers

    _run(scenario)


@pytest.mark.parametrize(("raw", "message"), [
    (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n", "request head larger than"),
    (b"\x16\x03\x01 not http\r\n\r\n", "malformed request line"),
    (b"POST /json HTTP/1.1\r\nHost: gate\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported Transfer-Encoding"),
    (b"POST /json HTTP/1.1\r\nHost: gate\r\nContent-Length: \xb2\r\n\r\nx", "invalid Content-Length"),
    (b"POST /json HTTP/1.1\r\nHost: gate\r\nContent-Length: +5\r\n\r\nhello", "invalid Content-Length"),
    (b"POST /json HTTP/1.1\r\nHost: gate\r\nContent-Length: " + b"1" * 5000 + b"\r\n\r\n", "invalid Content-Length"),
    (b"GET /health HTTP/1.1\r\n\r\n", "needs a Host header"),
    (b"GET /health HTTP/1.1\r\nHost: gate\r\nHost: evil.example\r\n\r\n", "more than one Host header"),
])
def test_bad_requests_are_refused(raw: bytes, message: str) -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        status, _headers, body = _json_answer(await _exchange(gate, raw))
        assert status in (400, 411) and message in body["error"]["message"] and upstream.heads == []
        assert gate.counters == {"requests": 0, "rejected_503": 0, "aborted": 0}

    _run(scenario)


def test_http_1_0_without_host_is_relayed() -> None:
    """Probes that speak HTTP/1.0 may leave Host out (RFC 9112 3.2 requires it of HTTP/1.1 only)."""
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        status, _headers, body = _json_answer(await _exchange(gate, b"GET /health HTTP/1.0\r\n\r\n"))
        assert (status, body["content"]) == (200, "Paris")
        assert upstream.heads == [b"GET /health HTTP/1.0\r\nConnection: close\r\n\r\n"]

    _run(scenario)


def test_a_bad_content_length_from_llama_server_is_a_502() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        status, headers, body = _json_answer(await _exchange(gate, b"GET /bad_length HTTP/1.1\r\nHost: gate\r\n\r\n"))
        assert (status, body["error"]["type"], "Retry-After" in headers) == (502, "server_error", False)
        assert "invalid Content-Length" in body["error"]["message"] and gate.counters["aborted"] == 1

    _run(scenario)


def test_connection_limit() -> None:
    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        reader, writer = await _request(gate, b"POST /hang HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\n\r\n")
        await reader.readuntil(b"\n\n\r\n")
        status, _headers, body = _json_answer(await _exchange(gate, CHAT))
        assert (status, body["error"]["message"]) == (503, "llamafleet: too many connections to the gate")
        writer.close()

    _run(scenario, max_connections=1)


def test_tls(tmp_path: Path) -> None:
    require(importlib.util.find_spec("cryptography"), "the Python package cryptography")
    from tests.helpers import self_signed_pair

    cert, key = self_signed_pair("localhost")
    cert_path, key_path = tmp_path / "gate.crt", tmp_path / "gate.key"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    client = ssl.create_default_context(cafile=str(cert_path))

    async def scenario(gate: Gate, upstream: FakeLlamaServer) -> None:
        status, _headers, body = _json_answer(await _exchange(gate, CHAT, client))
        assert (status, body["echo"]) == (200, '{"prompt":"hi!"}')
        assert b"Authorization: Bearer s3cret" in upstream.heads[0]
        try:
            plain = await _exchange(gate, CHAT)
        except ConnectionError:
            plain = b""
        assert not plain.startswith(b"HTTP/") and len(upstream.heads) == 1  # plain HTTP on the TLS port: no answer
        gate.set_state(DOWN, "worker lab2 lost")
        status, _headers, body = _json_answer(await _exchange(gate, CHAT, client))
        assert (status, body["error"]["message"]) == (503, "llamafleet: worker lab2 lost")

    _run(scenario, tls_cert=str(cert_path), tls_key=str(key_path))


def test_set_state_logs_and_refuses_unknown_states(capsys: pytest.CaptureFixture[str]) -> None:
    gate = Gate(CFG, clock=lambda: 42.0)
    assert gate.set_state(SERVING, "llama-server is serving")
    assert not gate.set_state(SERVING, "llama-server is serving")
    assert capsys.readouterr().out == "llamafleet-gate: down -> serving: llama-server is serving\n"
    assert gate.since == 42.0
    with pytest.raises(ValueError):
        gate.set_state("broken", "x")


def _watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ss_text: str) -> tuple[gate_watchdog.Watchdog, list[int]]:
    """A watchdog whose llama-server is active and healthy and whose ``ss`` shows ``ss_text``; restarts
    are recorded, not done."""
    cfg = dataclasses.replace(CFG, state_file=str(tmp_path / "gate-state.json"))
    dog = gate_watchdog.Watchdog(Gate(cfg, clock=lambda: 1000.0), cfg)
    killed: list[int] = []

    async def process() -> tuple[str, int]:
        return "active", 1234

    async def health() -> int:
        return 200

    async def connections() -> list[dict[str, Any]]:
        return parse_ss(ss_text)

    monkeypatch.setattr(dog, "process", process)
    monkeypatch.setattr(dog, "health", health)
    monkeypatch.setattr(dog, "connections", connections)
    monkeypatch.setattr(dog, "restart", killed.append)
    monkeypatch.setattr(dog, "_maybe_canary", lambda state, pid: None)
    return dog, killed


def _two_polls(dog: gate_watchdog.Watchdog) -> list[Decision]:
    async def polls() -> list[Decision]:
        return [await dog.poll(), await dog.poll()]

    return asyncio.run(polls())


def test_watchdog_restarts_on_a_confirmed_stall_and_writes_the_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    stalled = "\n".join((_ss_line("10.77.0.12:50052"),
                         _ss_line("10.77.0.13:50052", sendq=4096, unacked=3, lastack=4300)))
    dog, killed = _watchdog(tmp_path, monkeypatch, stalled)
    first, second = _two_polls(dog)
    assert (first.state, second.state, second.action, killed) == (SERVING, DOWN, "restart", [1234])
    state = json.loads((tmp_path / "gate-state.json").read_text())
    assert (state["state"], state["restarts"], state["since"]) == (DOWN, 1, 1000.0)
    assert state["reason"].startswith("worker lab3 (10.77.0.13:50052) stopped acknowledging: 4096 bytes")
    assert state["workers"]["lab3"] == {"address": "10.77.0.13", "port": 50052, "link": "stalled", "unacked": 3,
                                        "lastack_ms": 4300, "awaiting_ms": 0, "ping": "unknown"}
    assert state["last_action"]["pid"] == 1234
    assert state["counters"] == {"requests": 0, "rejected_503": 0, "aborted": 0}
    assert capsys.readouterr().out.splitlines()[-1] == "llamafleet-gate: serving -> down: " + second.reason


@pytest.mark.parametrize(("answered", "state"), [(True, DOWN), (False, SERVING)])
def test_watchdog_pings_the_host_of_a_link_waiting_for_an_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 answered: bool, state: str) -> None:
    """The partition that began while llama-server waited for lab3's answer: nothing unacknowledged, so only
    a ping of lab3 (which answered ping before, or never did) tells a lost worker from a slow one."""
    waiting = "\n".join((_ss_line("10.77.0.12:50052", lastack=300, lastsnd=900),
                         _ss_line("10.77.0.13:50052", lastack=40000, lastsnd=35000)))
    dog, killed = _watchdog(tmp_path, monkeypatch, waiting)
    pinged: list[str] = []

    async def echo(address: str, timeout: float, seq: int) -> bool:
        pinged.append(address)
        return False

    monkeypatch.setattr(gate_watchdog, "icmp_echo", echo)
    if answered:
        dog.pinger.answered.add("10.77.0.13")
    first, second = _two_polls(dog)
    assert pinged == ["10.77.0.13", "10.77.0.13"]  # pinged either way; judged only if it answered before
    assert (second.state, killed) == ((DOWN, [1234]) if answered else (SERVING, []))
    if answered:
        assert second.reason.startswith("worker lab3 (10.77.0.13:50052) has not answered llama-server's request "
                                        "for 35.0 s and its host does not answer ping; restarting")
        assert json.loads((tmp_path / "gate-state.json").read_text())["workers"]["lab3"]["ping"] == "no answer"


class StuckLlamaServer(FakeLlamaServer):
    """/completion never answers; /metrics shows the same counters every time (or moving ones)."""

    def __init__(self, moving: bool) -> None:
        super().__init__()
        self.moving = moving
        self.decodes = 332

    async def route_completion(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        await self._until_closed(reader)

    async def route_metrics(self, reader: Any, writer: asyncio.StreamWriter, body: bytes) -> None:
        self.decodes += self.moving
        text = b"llamacpp:tokens_predicted_total 350\nllamacpp:n_decode_total %d\n" % self.decodes
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text))
        await writer.drain()


@pytest.mark.parametrize(("moving", "streaming"), [(False, False), (True, False), (False, True)])
def test_canary_miss_compares_metrics(tmp_path: Path, moving: bool, streaming: bool) -> None:
    """A canary that misses its deadline is progress when /metrics moved, or when the gate relayed a client's
    answer meanwhile (streaming: a busy llama-server queues the canary, and its counters move only as answers end);
    neither: no progress, the watchdog restarts llama-server."""
    key = tmp_path / "llama-server.key"
    key.write_text("s3cret\n")

    async def main() -> CanaryOutcome:
        upstream = StuckLlamaServer(moving)
        cfg = dataclasses.replace(CFG, upstream_host="127.0.0.1", upstream_port=await upstream.start(),
                                  canary_deadline=0.3, api_key_file=str(key))
        gate = Gate(cfg)
        gate.last_answer = time.monotonic() - 0.05  # an answer that ended just before the canary: not progress

        async def stream_on() -> None:
            await asyncio.sleep(0.1)
            gate.last_answer = time.monotonic()

        streamed = asyncio.ensure_future(stream_on()) if streaming else None
        outcome = await gate_watchdog.Watchdog(gate, cfg).canary(1234)
        if streamed is not None:
            await streamed
        assert upstream.server is not None
        upstream.server.close()
        assert [head.split(b"\r\n")[0] for head in upstream.heads] == [
            b"GET /metrics HTTP/1.1", b"POST /completion HTTP/1.1"] + ([] if streaming else [b"GET /metrics HTTP/1.1"])
        assert all(b"Authorization: Bearer s3cret\r\n" in head for head in upstream.heads)
        assert json.loads(upstream.bodies[1]) == {"prompt": "ping", "n_predict": 1, "cache_prompt": False}
        return outcome

    outcome = asyncio.run(main())
    assert (outcome.pid, outcome.ok, outcome.missed, outcome.progress) == (1234, False, True, moving or streaming)
    assert 0.3 <= outcome.elapsed < 1.0


def test_empty_tls_and_key_paths_mean_none() -> None:
    cfg = load_config({"listen_port": 8080, "upstream_port": 18080, "unit": "u.service", "workers": [],
                       "tls_cert": "", "tls_key": "", "api_key_file": ""})
    assert (cfg.tls_cert, cfg.tls_key, cfg.api_key_file) == (None, None, None)


# --- the worker side: rpc-server's guard -----------------------------------------------------------------------

# recorded on lab3 after a 60 s partition: rpc-server still serves the dead connection of the killed
# llama-server, and the new one's HELLO attempts wait in the accept queue
LAB3_LISTEN = "LISTEN 2      1      10.77.0.13:50052 0.0.0.0:*\nLISTEN 0      128    0.0.0.0:22 0.0.0.0:*\n"
LAB3_ESTAB = ("0      0      10.77.0.13:50052 10.77.0.11:37800\n0      0      10.77.0.13:50052 10.77.0.11:37920\n"
              "0      0      10.77.0.13:22 10.77.0.1:50146\n")


def test_parse_listeners_reads_the_accept_queue() -> None:
    assert parse_listeners(LAB3_LISTEN) == {50052: (2, 1), 22: (0, 128)}
    assert parse_listeners("0 1 127.0.0.1:9 0.0.0.0:*\n") == {9: (0, 1)}
    assert established_on(parse_ss(LAB3_ESTAB), 50052) == 2


@pytest.mark.parametrize(("queued", "established", "since", "now", "expected"), [
    (0, 1, None, 100.0, (None, False)),          # nobody waiting
    (0, 2, 50.0, 100.0, (None, False)),          # the queue emptied: the clock stops
    (1, 1, None, 100.0, (None, False)),          # a reset probe left in the queue: no live client waits
    (1, 2, None, 100.0, (100.0, False)),         # a live client starts waiting
    (2, 2, 100.0, 110.0, (100.0, False)),        # still waiting, not long enough
    (1, 1, 100.0, 125.0, (100.0, False)),        # between two HELLO attempts: the clock runs, no restart yet
    (2, 2, 100.0, 120.0, (100.0, True)),         # waited the stale time with a live client: restart
    (2, 1, None, 100.0, (100.0, False)),         # a full queue of reset attempts: nobody new can even connect
    (2, 1, 100.0, 121.0, (100.0, True)),         # ... for the stale time: restart
])
def test_guard_decide(queued: int, established: int, since: float | None, now: float, expected: tuple) -> None:
    assert guard_decide(queued, established, since, now, stale=20.0, backlog=1) == expected


def test_guard_sees_a_client_waiting_behind_a_silent_one_on_real_sockets() -> None:
    """A listener with backlog 1 that accepts one client and then serves nobody else (as rpc-server does
    while its client is alive or silently gone): the kernel's own view, read with ss, starts the clock."""
    ss = shutil.which("ss")
    require(ss, "ss (iproute2)")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    first = socket.create_connection(("127.0.0.1", port))
    served, _addr = server.accept()
    waiting = socket.create_connection(("127.0.0.1", port))
    try:
        listeners = subprocess.run([ss, "-ltnH"], capture_output=True, text=True, check=True).stdout
        conns = subprocess.run([ss, "-tnH", "state", "established"], capture_output=True, text=True, check=True).stdout
        (queued, backlog), established = parse_listeners(listeners)[port], established_on(parse_ss(conns), port)
        assert (queued, backlog, established) == (1, 1, 2)
        since, restart = guard_decide(queued, established, None, 0.0)
        assert (since, restart) == (0.0, False)
        assert guard_decide(queued, established, since, 25.0) == (0.0, True)
    finally:
        for sock in (first, served, waiting, server):
            sock.close()


def test_a_reason_whose_figures_change_is_logged_once(capsys: pytest.CaptureFixture[str]) -> None:
    gate = Gate(CFG)
    gate.set_state(DOWN, "worker lab3 stopped acknowledging: no ACK for 4.3 s")
    gate.set_state(DOWN, "worker lab3 stopped acknowledging: no ACK for 5.3 s")
    gate.set_state(DOWN, "worker lab3 stopped acknowledging: no ACK for 30.4 s; restarting llama-server (pid 12)")
    logged = capsys.readouterr().out.splitlines()
    assert [line.split(": ", 2)[-1] for line in logged] == [
        "worker lab3 stopped acknowledging: no ACK for 4.3 s",
        "worker lab3 stopped acknowledging: no ACK for 30.4 s; restarting llama-server (pid 12)"]
    assert gate.reason.endswith("(pid 12)")


def test_a_host_with_one_rpc_server_per_device_has_a_link_per_endpoint() -> None:
    workers = (Worker("lab3", "10.77.0.13", 50052), Worker("lab3", "10.77.0.13", 50053), LAB[0])
    assert link_names(workers) == ["lab3:50052", "lab3:50053", "lab2"]
    stalled = _ss_line("10.77.0.13:50053", sendq=10, unacked=2, lastack=9000)
    conns = parse_ss(_ss_line("10.77.0.13:50052") + "\n" + stalled)
    links = worker_links(conns, workers)
    assert {name: info["link"] for name, info in links.items()} == {"lab3:50052": "ok", "lab3:50053": "stalled",
                                                                    "lab2": "lost"}


# ------------------------------------------------------------------------------------------------ degraded mode

DEGRADE = {"plans": {"lab2": None, "lab3": "without-lab3"}, "reasons": {"lab2": "the model does not fit without lab2"},
           "request_file": "/run/llamafleet-gate/plan-request.json",
           "probe": ["/usr/bin/python3", "/usr/local/libexec/llamafleet/rpc_proto.py"]}
TWO = {"listen_port": 8080, "upstream_port": 18080, "unit": "llamafleet-llama-server.service",
       "workers": [{"host": "lab2", "address": "10.77.0.12", "port": 50052},
                   {"host": "lab3", "address": "10.77.0.13", "port": 50052}]}


def test_degrade_config() -> None:
    cfg = load_config(dict(TWO, degrade=DEGRADE))
    assert cfg.degrade == gate_config.Degrade({"lab2": None, "lab3": "without-lab3"},
                                              {"lab2": "the model does not fit without lab2"},
                                              "/run/llamafleet-gate/plan-request.json",
                                              ("/usr/bin/python3", "/usr/local/libexec/llamafleet/rpc_proto.py"))
    assert (cfg.degrade.after, cfg.degrade.return_probes) == (45.0, 3)
    assert load_config(dict(TWO, degrade=None)).degrade is None and load_config(TWO).degrade is None


@pytest.mark.parametrize(("change", "message"), [
    ({"plans": {"lab3": "without-lab3"}}, "degrade.plans must name a plan (or null) for each worker host (lab2, lab3)"),
    ({"plans": {"lab2": None, "lab3": "../etc/passwd"}}, "degrade.plans.lab3 must be a plan file name"),
    ({"plans": {"lab2": None, "lab3": "full"}}, "degrade.plans.lab3 must be a plan file name"),
    ({"probe": []}, "degrade.probe must be a command"),
    ({"after": 0}, "degrade.after must be a number of seconds > 0"),
    ({"return_probes": 0}, "degrade.return_probes must be an integer >= 1"),
    ({"request_file": None}, "degrade.request_file"),
    ({"surprise": 1}, "unknown key degrade.surprise"),
])
def test_degrade_config_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(dict(TWO, degrade=dict(DEGRADE, **change)))


def test_left_out_and_degrade_choice() -> None:
    deg = load_config(dict(TWO, degrade=DEGRADE)).degrade
    assert link_state.left_out(LAB, LAB) is None and link_state.left_out(LAB, LAB[:1]) == "lab3" and link_state.left_out(LAB, ()) is None
    assert gate_decision.degrade_choice(deg, {"lab2": True, "lab3": True}) == (None, "")
    assert gate_decision.degrade_choice(deg, {"lab2": True, "lab3": False}) == (
        "without-lab3", "worker lab3 does not answer HELLO: serving degraded without it (plan without-lab3)")
    assert gate_decision.degrade_choice(deg, {"lab2": False, "lab3": True}) == (
        None, "not serving degraded without lab2: the model does not fit without lab2")
    assert gate_decision.degrade_choice(deg, {"lab2": False, "lab3": False})[1].startswith(
        "not serving degraded: 2 worker hosts do not answer HELLO (lab2, lab3)")


def test_switch_plan_takes_only_plans_the_deploy_wrote(tmp_path: Path) -> None:
    (tmp_path / "without-lab3.conf").write_text("[Service]\nExecStart=\n")
    assert plan_switch.switch_plan({"plan": "without-lab3"}, str(tmp_path), None) == (
        "[Service]\nExecStart=\n", "plan without-lab3 (%s/without-lab3.conf)" % tmp_path)
    assert plan_switch.switch_plan({"plan": "full"}, str(tmp_path), "x") == (None, "the full plan")
    for request, message in [({"plan": "without-lab9"}, "no plan without-lab9"), ({"plan": "../x"}, "not a plan name"),
                             ({}, "must be")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            plan_switch.switch_plan(request, str(tmp_path), None)


def test_switch_main_puts_the_drop_in_in_place_and_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans, request, dropin = tmp_path / "plans", tmp_path / "request.json", tmp_path / "unit.d" / "50-plan.conf"
    plans.mkdir()
    (plans / "without-lab3.conf").write_text("[Service]\nExecStart=\nExecStart=/bin/true\n")
    commands: list[list[str]] = []
    monkeypatch.setattr(plan_switch, "command_output", lambda argv: commands.append(argv) or "")
    argv = ["switch", "--request", str(request), "--plans", str(plans), "--dropin", str(dropin), "--unit", "x.service"]
    assert serving_gate.main(argv) == 0 and not dropin.exists() and commands == []  # no request: nothing
    request.write_text(json.dumps({"plan": "without-lab3", "reason": "lab3 is gone"}))
    assert serving_gate.main(argv) == 0 and dropin.read_text() == "[Service]\nExecStart=\nExecStart=/bin/true\n"
    assert commands == [["systemctl", "daemon-reload"], ["systemctl", "restart", "--no-block", "x.service"]]
    assert serving_gate.main(argv) == 0 and len(commands) == 2  # already in place: no restart
    request.write_text(json.dumps({"plan": "full"}))
    assert serving_gate.main(argv) == 0 and not dropin.exists() and len(commands) == 4
    request.write_text(json.dumps({"plan": "without-nobody"}))
    assert serving_gate.main(argv) == 1 and not dropin.exists() and len(commands) == 4


def test_watchdog_serves_degraded_and_restores_the_full_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lab3 is lost: llama-server waits for it (activating); after `after` seconds down the gate probes the
    hosts, asks for the plan without lab3; llama-server runs without it; once lab3 answers 2 probes in a row,
    the full plan is asked for."""
    request = tmp_path / "plan-request.json"
    deg = dict(DEGRADE, request_file=str(request), after=0.01, probe_interval=0.01, return_probes=2)
    cfg = dataclasses.replace(load_config(dict(TWO, degrade=deg)), state_file=str(tmp_path / "state.json"))
    dog = gate_watchdog.Watchdog(Gate(cfg, clock=lambda: 1000.0), cfg)
    world = {"active": "activating", "pid": 0, "rpc": LAB, "lab3": False}
    probed: list[str] = []

    async def process() -> tuple[str, int]:
        return world["active"], world["pid"]

    async def health() -> int:
        return 200

    async def connections() -> list[dict[str, Any]]:
        return parse_ss("\n".join(_ss_line("%s:%d" % (w.address, w.port)) for w in world["rpc"]))

    async def probe_host(deg: gate_config.Degrade, host: str) -> bool:
        probed.append(host)
        return host != "lab3" or bool(world["lab3"])

    for name, fake in (("process", process), ("health", health), ("connections", connections),
                       ("probe_host", probe_host)):
        monkeypatch.setattr(dog, name, fake)
    monkeypatch.setattr(dog, "workers_of", lambda pid: world["rpc"])
    monkeypatch.setattr(dog, "_maybe_canary", lambda state, pid: None)

    async def polls(count: int) -> None:
        for _round in range(count):
            await dog.poll()
            await asyncio.sleep(0.02)

    asyncio.run(polls(2))
    assert json.loads(request.read_text())["plan"] == "without-lab3" and sorted(set(probed)) == ["lab2", "lab3"]
    # the switch restarted llama-server without lab3: it serves, the gate probes lab3 alone
    world.update(active="active", pid=4321, rpc=LAB[:1])
    probed.clear()
    asyncio.run(polls(2))
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["state"] == SERVING and state["plan"]["mode"] == "degraded" and state["plan"]["without"] == "lab3"
    assert set(probed) == {"lab3"} and json.loads(request.read_text())["plan"] == "without-lab3"
    world["lab3"] = True
    asyncio.run(polls(2))
    assert json.loads(request.read_text())["plan"] == "full"
    assert dog.snapshot()["plan"]["requested"] == "full"
