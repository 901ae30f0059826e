"""link_rtt: figures; real echoes to this machine's loopback (the packets are the gate's: test_serving_gate)."""

from __future__ import annotations

import os

from llamafleet.core.link_rtt import (
    measure_endpoints,
    ping_ms,
    summarize,
)
from tests.unit.needs import needs

ROOT = os.geteuid() == 0


def test_summary_is_the_median_and_counts_losses() -> None:
    assert summarize([0.3, 0.1, 0.2, 9.0], 5) == {"rtt_ms": 0.25, "min_ms": 0.1, "max_ms": 9.0, "lost": 1}
    assert summarize([], 3) == {"rtt_ms": None, "min_ms": None, "max_ms": None, "lost": 3}


@needs(ROOT, "root (a raw ICMP socket)")
def test_real_echoes_to_the_loopback() -> None:
    samples = ping_ms("127.0.0.1", count=4, timeout=1.0, interval=0)
    assert len(samples) == 4
    assert all(0 < s < 50 for s in samples)


@needs(ROOT, "root (a raw ICMP socket)")
def test_endpoints_get_their_host_figure_and_an_unanswering_host_none() -> None:
    # 198.51.100.7 (TEST-NET-2) is never assigned: its echoes go unanswered (or fail to route)
    endpoints = [{"host": "a", "address": "127.0.0.1", "port": 1}, {"host": "a", "address": "127.0.0.1", "port": 2},
                 {"host": "b", "address": "198.51.100.7", "port": 1}]
    measured, hosts = measure_endpoints(endpoints, count=2, timeout=0.2)
    assert [e["port"] for e in measured] == [1, 2, 1] and measured[0]["host"] == "a"
    assert measured[0]["rtt_ms"] == measured[1]["rtt_ms"] == hosts["127.0.0.1"]["rtt_ms"] > 0
    assert measured[2]["rtt_ms"] is None and hosts["198.51.100.7"]["lost"] == 2
    assert set(hosts) == {"127.0.0.1", "198.51.100.7"}  # one measurement per host
