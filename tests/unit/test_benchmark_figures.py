"""The figures benchmarks compute from what they measured (pure functions, no lab)."""

from __future__ import annotations

import pytest

from benchmarks.edge_cost import hop_figures, relay_figures, stream_shares


def test_a_stream_against_llama_servers_own_timings() -> None:
    # [client seconds since the request, prompt_ms, predicted_ms, predicted_n]: llama-server decoded tokens 2..21 in
    # 1,000 ms; the client saw them over 1.25 s; its first token came 500 ms after the request, 420 ms of which
    # were llama-server's own (400 prompt + 20 first token)
    seen, overhead = stream_shares([[0.5, 400.0, 20.0, 1], [1.0, 400.0, 520.0, 11], [1.75, 400.0, 1020.0, 21]])
    assert seen == pytest.approx(0.8)
    assert overhead == pytest.approx(80.0)


def test_the_relays_compared_in_pairs() -> None:
    gate = [[200, [[0.5, 400.0, 20.0, 1], [1.5, 400.0, 1020.0, 21]]]] * 5
    # through the edge: the same model speed, each answer 2 ms later to start and 10 ms longer to stream
    edge = [[200, [[0.502, 400.0, 20.0, 1], [1.512, 400.0, 1020.0, 21]]]] * 5
    figures = relay_figures(gate, edge)
    assert figures["pairs"] == 5
    assert figures["gate_seen"] == pytest.approx(1.0)
    assert figures["tok_s_ratio"] == pytest.approx(1000 / 1010)
    assert figures["overhead_extra_ms"] == pytest.approx(2.0)
    assert figures["overhead_extra_ms_95"] == pytest.approx((2.0, 2.0))


def test_a_stream_of_fewer_than_two_tokens_is_left_out() -> None:
    gate = [[200, [[0.5, 400.0, 20.0, 1], [1.5, 400.0, 1020.0, 21]]], [200, [[0.5, 400.0, 20.0, 1]]]]
    edge = [[200, [[0.5, 400.0, 20.0, 1], [1.5, 400.0, 1020.0, 21]]], [200, [[0.5, 400.0, 20.0, 1], [1.5, 1, 2, 3]]]]
    assert relay_figures(gate, edge)["pairs"] == 1


def test_the_hop_alone() -> None:
    figures = hop_figures([[200, 0.0006]] * 3, [[200, 0.0008]] * 3)
    assert figures["extra_ms"] == pytest.approx(0.2)
    assert (figures["gate_ms"], figures["edge_ms"]) == pytest.approx((0.6, 0.8))
