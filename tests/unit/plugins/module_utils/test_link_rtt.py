"""link_rtt: ICMP echo packets, reply parsing, figures; real echoes to this machine's loopback."""

from __future__ import annotations

import os
import struct

import pytest

from ansible_collections.llamafleet.cluster.plugins.module_utils.link_rtt import (
    checksum,
    echo_reply_of,
    echo_request,
    measure_endpoints,
    ping_ms,
    summarize,
)

ROOT = os.geteuid() == 0


@pytest.mark.parametrize("data, expected", [
    # RFC 1071's worked example: 0001 f203 f4f5 f6f7 sums to ddf2, checksum 220d
    (bytes.fromhex("0001f203f4f5f6f7"), 0x220D),
    (b"", 0xFFFF),
    (b"\x01", 0xFEFF),  # odd length: padded with a zero byte
])
def test_checksum(data: bytes, expected: int) -> None:
    assert checksum(data) == expected


def test_an_ipv4_request_checks_out_and_carries_id_and_sequence() -> None:
    packet = echo_request(0x1234, 7)
    assert packet[0] == 8 and checksum(packet) == 0  # a correct checksum sums to zero
    assert struct.unpack("!HH", packet[4:8]) == (0x1234, 7)


def test_ipv6_request_leaves_the_checksum_to_the_kernel() -> None:
    packet = echo_request(1, 2, ipv6=True)
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
    assert echo_reply_of(packet, ipv6, header) == expected


def test_summary_is_the_median_and_counts_losses() -> None:
    assert summarize([0.3, 0.1, 0.2, 9.0], 5) == {"rtt_ms": 0.25, "min_ms": 0.1, "max_ms": 9.0, "lost": 1}
    assert summarize([], 3) == {"rtt_ms": None, "min_ms": None, "max_ms": None, "lost": 3}


@pytest.mark.skipif(not ROOT, reason="a raw ICMP socket needs root")
def test_real_echoes_to_the_loopback() -> None:
    samples = ping_ms("127.0.0.1", count=4, timeout=1.0, interval=0)
    assert len(samples) == 4
    assert all(0 < s < 50 for s in samples)


@pytest.mark.skipif(not ROOT, reason="a raw ICMP socket needs root")
def test_endpoints_get_their_host_figure_and_an_unanswering_host_none() -> None:
    # 198.51.100.7 (TEST-NET-2) is never assigned: its echoes go unanswered (or fail to route)
    endpoints = [{"host": "a", "address": "127.0.0.1", "port": 1}, {"host": "a", "address": "127.0.0.1", "port": 2},
                 {"host": "b", "address": "198.51.100.7", "port": 1}]
    measured, hosts = measure_endpoints(endpoints, count=2, timeout=0.2)
    assert [e["port"] for e in measured] == [1, 2, 1] and measured[0]["host"] == "a"
    assert measured[0]["rtt_ms"] == measured[1]["rtt_ms"] == hosts["127.0.0.1"]["rtt_ms"] > 0
    assert measured[2]["rtt_ms"] is None and hosts["198.51.100.7"]["lost"] == 2
    assert set(hosts) == {"127.0.0.1", "198.51.100.7"}  # one measurement per host
