"""Streamed completions timed client-side, and the concurrency sweep, on recorded llama-server streams."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from llamafleet.bench import measure
from llamafleet.bench.measure import (
    StreamResult,
    aggregate,
    parse_chunk,
    percentile,
    result_from_events,
    sse_data,
    stream_completion,
    sweep,
)

SSE = Path(__file__).resolve().parents[2] / "fixtures" / "sse"


def fixture(name: str) -> str:
    return (SSE / name).read_text(encoding="utf-8")


def test_sse_data_splits_events_and_skips_comments() -> None:
    lines = [b"data: {\"a\":1}\n", b"\n", b": ping\n", b"\n", b"event: x\n", b"data: one\r\n", b"data:two\n",
             b"\n", b"data: last"]
    assert list(sse_data(lines)) == ['{"a":1}', "one\ntwo", "last"]


@pytest.mark.parametrize(("data", "chunk"), [
    ('{"index":0,"content":" Paris","tokens":[9079],"stop":false}', measure.Chunk(1, " Paris")),
    ('{"index":0,"content":"","tokens":[5],"stop":false}', measure.Chunk(1, "")),  # half a UTF-8 char
    ('{"index":0,"content":"ab","tokens":[1,2],"stop":false}', measure.Chunk(2, "ab")),  # draft tokens
    ('{"content":"","tokens":[-1],"stop":false,"prompt_progress":{"total":6}}', measure.Chunk()),
    ('{"content":"","tokens":[],"stop":true,"timings":{"predicted_n":4}}',
     measure.Chunk(final=True, timings={"predicted_n": 4})),
    ('{"choices":[{"text":" It","index":0,"finish_reason":null}]}', measure.Chunk(1, " It")),
    ('{"choices":[{"text":"","index":0,"finish_reason":"length"}],"timings":{"prompt_n":6}}',
     measure.Chunk(final=True, timings={"prompt_n": 6})),
    ("[DONE]", measure.Chunk(final=True)),
    ('{"error":{"code":500,"message":"boom","type":"server_error"}}', measure.Chunk(error="boom")),
    ("not json", measure.Chunk(error="not JSON: 'not json'")),
])
def test_parse_chunk(data: str, chunk: measure.Chunk) -> None:
    assert parse_chunk(data) == chunk


COMPLETION = "completion_stream_0c1e570_gemma270m_real.txt"
V1 = "v1_completions_stream_0c1e570_gemma270m_real.txt"
RECORDED = [
    # fixture, text, tokens, prompt tok/s, server tok/s (the final event's timings)
    (COMPLETION, " the capital of the", 4, 35.65443719470888, 18.267175711963173),
    (V1, " the capital of the", 4, 41.87926208740202, 19.227564636663118),
]


@pytest.mark.parametrize(("name", "text", "tokens", "prompt_tps", "server_tps"), RECORDED)
def test_result_from_recorded_stream(name: str, text: str, tokens: int, prompt_tps: float,
                                     server_tps: float) -> None:
    events = list(sse_data(fixture(name).splitlines(keepends=True)))
    # request at t=10, first token at 10.25, then one event every 0.1 s
    timed = [(10.25 + 0.1 * i, data) for i, data in enumerate(events)]
    result = result_from_events(timed, started=10.0)
    assert result.ok and result.error == ""
    assert result.text == text and result.tokens == tokens
    assert result.ttft_s == pytest.approx(0.25)
    assert result.tok_s == pytest.approx((tokens - 1) / 0.3)  # tokens 2..4 over the three gaps after the first
    assert result.total_s == pytest.approx(0.25 + 0.1 * (len(events) - 1))
    assert (result.prompt_tok_s, result.server_tok_s, result.prompt_n) == (prompt_tps, server_tps, 6)


def test_stream_that_stops_short_is_an_error() -> None:
    events = list(sse_data(fixture(COMPLETION).splitlines(keepends=True)))[:2]
    result = result_from_events([(1.0, e) for e in events], started=0.5)
    assert not result.ok and result.error == "the stream ended before its final event"
    assert result.tokens == 2 and result.ttft_s == pytest.approx(0.5)


def test_error_event_ends_the_stream() -> None:
    events = list(sse_data(fixture("completion_stream_error_reconstructed.txt").splitlines(keepends=True)))
    result = result_from_events([(1.0 + i, e) for i, e in enumerate(events)], started=0.0)
    assert not result.ok and result.error == "Failed to decode the batch" and result.tokens == 1


@pytest.mark.parametrize(("endpoint", "name"), [("/completion", COMPLETION), ("/v1/completions", V1)])
def test_stream_completion_against_a_streaming_server(sse_server, endpoint: str, name: str) -> None:
    server = sse_server(body=fixture(name), first_delay=0.2, gap=0.05, api_key="s3cret")
    result = stream_completion(server.url, "The capital of France is", n_predict=4, api_key="s3cret",
                               endpoint=endpoint, timeout=10)
    assert result.ok, result.error
    assert result.status == 200 and result.text == " the capital of the" and result.tokens == 4
    assert 0.2 <= result.ttft_s < 0.35
    # first to last token event: 3 gaps of 0.05 s for 3 tokens
    assert 3 / (0.15 + 0.1) < result.tok_s <= 3 / 0.15 * 1.05
    assert result.total_s >= result.ttft_s
    path, headers, body = server.requests[0]
    assert path == endpoint and headers["Authorization"] == "Bearer s3cret"
    count = "n_predict" if endpoint == "/completion" else "max_tokens"
    assert body == {"prompt": "The capital of France is", count: 4, "stream": True, "temperature": 0, "top_k": 1,
                    "cache_prompt": False, "ignore_eos": True}


def test_stream_completion_reports_http_errors(sse_server) -> None:
    server = sse_server(api_key="right")
    result = stream_completion(server.url, api_key="wrong", timeout=5)
    assert not result.ok and result.status == 401 and result.error == "HTTP 401: Invalid API Key"


def test_stream_completion_reports_a_dead_server() -> None:
    result = stream_completion("http://127.0.0.1:1", timeout=2)
    assert not result.ok and result.error.startswith("ConnectionRefusedError")


def test_stream_completion_times_out(sse_server) -> None:
    server = sse_server(body=fixture(COMPLETION), first_delay=3)
    started = time.monotonic()
    result = stream_completion(server.url, timeout=0.5)
    assert not result.ok and "timed out" in result.error and time.monotonic() - started < 2


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 50, None), ([3.0], 95, 3.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.5), ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 100, 4.0), (list(map(float, range(1, 21))), 95, 19.05),
])
def test_percentile_matches_linear_interpolation(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == (pytest.approx(expected) if expected is not None else None)


def ok(total: float, ttft: float, tokens: int) -> StreamResult:
    return StreamResult(ok=True, total_s=total, ttft_s=ttft, tokens=tokens)


def test_aggregate_counts_good_tokens_and_errors() -> None:
    results = [ok(1.0, 0.1, 64), ok(2.0, 0.2, 64), ok(3.0, 0.3, 64),
               StreamResult(ok=False, error="HTTP 503: Loading model"), StreamResult(ok=False, error="timed out"),
               StreamResult(ok=False, error="timed out")]
    got = aggregate(4, results, wall_s=4.0)
    assert (got.clients, got.requests, got.errors, got.tokens) == (4, 6, 3, 192)
    assert got.aggregate_tok_s == pytest.approx(48.0)
    assert got.latency_p50_s == pytest.approx(2.0) and got.latency_p95_s == pytest.approx(2.9)
    assert got.ttft_p50_s == pytest.approx(0.2)
    assert got.error_samples == ["HTTP 503: Loading model", "timed out"]


def test_sweep_runs_a_count_of_requests_on_n_clients() -> None:
    lock, active, peak = threading.Lock(), [0], [0]

    def request() -> StreamResult:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return ok(0.05, 0.01, 10)

    got = sweep(request, clients=4, requests=10)
    assert got.requests == 10 and got.errors == 0 and got.tokens == 100 and peak[0] == 4
    assert 0.15 <= got.wall_s < 0.5  # three rounds of 0.05 s


def test_sweep_for_a_duration() -> None:
    got = sweep(lambda: (time.sleep(0.02), ok(0.02, 0.01, 1))[1], clients=2, duration_s=0.2)
    assert 10 <= got.requests <= 24 and 0.2 <= got.wall_s < 0.4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"clients": 0, "requests": 1}, "clients must be between 1 and 256"),
    ({"clients": 300, "requests": 1}, "clients must be between 1 and 256"),
    ({"clients": 1}, "either a number of requests or a duration"),
    ({"clients": 1, "requests": 1, "duration_s": 1.0}, "either a number of requests or a duration"),
    ({"clients": 1, "requests": 0}, "must be positive"),
])
def test_sweep_refuses_bad_bounds(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sweep(lambda: ok(1, 1, 1), **kwargs)


def test_main_measures_and_sweeps_a_streaming_server(sse_server, tmp_path: Path, monkeypatch, capsys) -> None:
    server = sse_server(body=": ping\n\n" + fixture(COMPLETION), gap=0.01, api_key="k")
    key = tmp_path / "key"
    key.write_text("k\n")
    out = tmp_path / "m.json"
    rc = measure.main(["--url", server.url, "--api-key-file", str(key), "--repetitions", "2", "--n-predict", "4",
                       "--sweep", "1,3", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == data
    assert [r["ok"] for r in data["repetitions"]] == [True, True]
    assert [(s["clients"], s["requests"], s["errors"], s["tokens"]) for s in data["sweep"]] == [(1, 2, 0, 8),
                                                                                              (3, 6, 0, 24)]
    assert len(server.requests) == 2 + 2 + 6
    monkeypatch.setenv("LLAMAFLEET_API_KEY", "wrong")
    assert measure.main(["--url", server.url, "--repetitions", "1"]) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--n-predict", "1"], "--n-predict must be 2 or more"),
    (["--sweep", "1,x"], "invalid literal"),
    (["--sweep", "1", "--sweep-requests", "2", "--sweep-duration", "1"], "exclude each other"),
    (["--sweep", "0"], "clients must be between 1 and 256"),
])
def test_main_refuses_bad_arguments(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        measure.main(["--url", "http://127.0.0.1:1", "--repetitions", "0", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
