# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Client-side measurements of a llama-server: streamed completions and a concurrency sweep.

    python -m llamafleet.bench.measure --url http://10.0.0.1:8080 [--api-key-file F] \\
        [--repetitions 3] [--n-predict 64] [--sweep 1,4,16 --sweep-requests 16] [--out result.json]

What llama-server (llama.cpp 0c1e570, tools/server) streams with ``"stream": true``
-------------------------------------------------------------------------------------
The body is ``text/event-stream``: events ``data: <compact JSON>\\n\\n``, and
``:\\n\\n`` comments as keep-alive pings. Headers are sent before the first token
(an empty first result), so the first event is the first token.

- ``/completion``: one event per token, ``{"index", "content", "tokens": [id],
  "stop": false, "id_slot", "tokens_predicted", "tokens_evaluated"}``, then a final
  event with ``"stop": true``, empty ``content`` and ``timings``; no ``[DONE]``.
- ``/v1/completions``: ``{"choices": [{"text", "index", "logprobs", "finish_reason":
  null}], ...}`` per token, a final event whose ``finish_reason`` is set, with
  ``usage`` and ``timings``, then ``data: [DONE]``.
- With ``return_progress`` there are also events with ``prompt_progress`` (no token).
- An error after the stream began is an event ``{"error": {"code", "message", "type"}}``;
  before, an ordinary JSON error body with its HTTP status.

``timings`` = ``prompt_n, prompt_ms, prompt_per_token_ms, prompt_per_second,
predicted_n, predicted_ms, predicted_per_token_ms, predicted_per_second, cache_n``.

What the client measures: time to first token (request sent -> first token
event), generation tok/s between the first and the last token event (so prompt
processing is not in it), total time; prompt-processing tok/s comes from the
server's ``timings`` (the client cannot separate it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

# stdlib only, with http_wire (the gate's): python3 -m runs it on a host too, as the edge's e2e test does
from ..core.http_wire import error_message

# About 120 tokens: long enough for prompt tok/s to mean something, short enough for small contexts.
DEFAULT_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 8)
ENDPOINTS = {"completion": "/completion", "v1": "/v1/completions"}
MAX_CLIENTS = 256


@dataclass
class StreamResult:
    """One streamed completion as the client saw it. Times in seconds, rates in tokens per second."""

    ok: bool
    error: str = ""
    status: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int = 0
    tok_s: float | None = None
    prompt_tok_s: float | None = None
    server_tok_s: float | None = None
    prompt_n: int | None = None
    text: str = ""
    timings: dict[str, Any] = field(default_factory=dict)


def sse_data(lines: Iterable[bytes | str]) -> Iterator[str]:
    """The ``data`` of each server-sent event, from the body's lines (comments and other fields skipped).

    Data lines of one event are joined with newlines, as the SSE specification says;
    a blank line ends an event, and so does the end of the body.
    """
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


@dataclass(frozen=True)
class Chunk:
    """What one streamed event says: tokens it carries, their text, and whether it ends the stream."""

    tokens: int = 0
    text: str = ""
    final: bool = False
    timings: dict[str, Any] | None = None
    error: str = ""


def parse_chunk(data: str) -> Chunk:
    """Read one event's data, from /completion or /v1/completions (see the module docstring)."""
    if data.strip() == "[DONE]":
        return Chunk(final=True)
    try:
        obj = json.loads(data)
    except ValueError:
        return Chunk(error="not JSON: %r" % data[:200])
    if not isinstance(obj, dict):
        return Chunk(error="unexpected event: %r" % data[:200])
    if "error" in obj:
        err = obj["error"]
        return Chunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    timings = obj.get("timings") if isinstance(obj.get("timings"), dict) else None
    if "choices" in obj:
        choice = (obj.get("choices") or [{}])[0]
        final = choice.get("finish_reason") is not None
        text = choice.get("text") or ""
        tokens = 0 if final or "prompt_progress" in obj else 1
    else:
        final = bool(obj.get("stop"))
        text = obj.get("content") or ""
        tokens = 0 if final or "prompt_progress" in obj else len(obj.get("tokens") or ()) or int(bool(text))
    return Chunk(tokens, text if tokens else "", final, timings)


def result_from_events(events: Iterable[tuple[float, str]], started: float) -> StreamResult:
    """A StreamResult from (arrival time, event data) pairs of one response, the request sent at ``started``.

    The total runs to the last event; generation tok/s counts the tokens after the
    first over the time from the first token event to the last. A stream that
    ends without its final event (or with an error event) is not ok.
    """
    tokens, texts, timings = 0, [], None
    first = last = None
    end = started
    final, error = False, ""
    for at, data in events:
        end = at
        chunk = parse_chunk(data)
        if chunk.error:
            error = chunk.error
            break
        if chunk.tokens:
            first = at if first is None else first
            last = at
            tokens += chunk.tokens
            texts.append(chunk.text)
        timings = chunk.timings or timings
        final = final or chunk.final
    if not error and not final:
        error = "the stream ended before its final event"
    timings = timings or {}
    # A token that ends inside a UTF-8 character gets no event of its own: trust the server's count.
    if isinstance(timings.get("predicted_n"), int) and timings["predicted_n"] >= tokens:
        tokens = timings["predicted_n"]
    gen = (tokens - 1) / (last - first) if first is not None and last is not None and last > first else None
    return StreamResult(
        ok=not error, error=error, ttft_s=None if first is None else first - started, total_s=end - started,
        tokens=tokens, tok_s=gen, prompt_tok_s=_number(timings.get("prompt_per_second")),
        server_tok_s=_number(timings.get("predicted_per_second")), prompt_n=timings.get("prompt_n"),
        text="".join(texts), timings=timings)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def request_body(endpoint: str, prompt: str, n_predict: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy streamed request of exactly ``n_predict`` tokens that re-processes the whole prompt."""
    count = "n_predict" if endpoint == ENDPOINTS["completion"] else "max_tokens"
    body = {"prompt": prompt, count: n_predict, "stream": True, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "ignore_eos": True}
    body.update(extra or {})
    return body


def stream_completion(url: str, prompt: str = DEFAULT_PROMPT, n_predict: int = 64, api_key: str = "",
                      endpoint: str = ENDPOINTS["completion"], timeout: float = 300.0,
                      extra: dict[str, Any] | None = None,
                      clock: Callable[[], float] = time.perf_counter) -> StreamResult:
    """POST a streamed completion to ``url`` (``http://host:port``) and time it; never raises for the server's faults.

    ``timeout`` bounds the whole request (and each read). ``api_key`` goes in
    ``Authorization: Bearer``.
    """
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = "Bearer %s" % api_key
    body = json.dumps(request_body(endpoint, prompt, n_predict, extra)).encode()
    conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    started = clock()
    try:
        conn.request("POST", parts.path.rstrip("/") + endpoint, body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return StreamResult(ok=False, status=resp.status, total_s=clock() - started,
                                error="HTTP %d: %s" % (resp.status, error_message(resp.read())))
        events = []
        for data in sse_data(iter(resp.readline, b"")):
            events.append((clock(), data))
            if clock() - started > timeout:
                result = result_from_events(events, started)
                result.ok, result.error = False, "no end after %.0f s" % timeout
                return result
        result = result_from_events(events, started)
        result.status = resp.status
        return result
    except (OSError, http.client.HTTPException) as exc:
        return StreamResult(ok=False, total_s=clock() - started, error="%s: %s" % (type(exc).__name__, exc))
    finally:
        conn.close()


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between ranks (numpy's default); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class SweepResult:
    """N clients sending streamed completions at once: throughput, latency percentiles, errors."""

    clients: int
    requests: int
    errors: int
    wall_s: float
    tokens: int
    aggregate_tok_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    error_samples: list[str] = field(default_factory=list)


def aggregate(clients: int, results: list[StreamResult], wall_s: float) -> SweepResult:
    """Sum a sweep's results: tokens of successful requests over the wall time, percentiles of their times."""
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    latencies = [r.total_s for r in good if r.total_s is not None]
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    errors = [r.error for r in results if not r.ok]
    return SweepResult(
        clients=clients, requests=len(results), errors=len(errors), wall_s=wall_s, tokens=tokens,
        aggregate_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        latency_p50_s=percentile(latencies, 50), latency_p95_s=percentile(latencies, 95),
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        error_samples=sorted(set(errors))[:5])


def sweep(request: Callable[[], StreamResult], clients: int, requests: int | None = None,
          duration_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> SweepResult:
    """Run ``request`` from ``clients`` threads: ``requests`` in all, or new ones for ``duration_s`` seconds.

    Requests started before the end run to completion (``request`` must bound
    itself, as stream_completion's timeout does).
    """
    if not 1 <= clients <= MAX_CLIENTS:
        raise ValueError("clients must be between 1 and %d, not %r" % (MAX_CLIENTS, clients))
    if (requests is None) == (duration_s is None):
        raise ValueError("give either a number of requests or a duration")
    if (requests is not None and requests < 1) or (duration_s is not None and not duration_s > 0):
        raise ValueError("the number of requests and the duration must be positive")
    lock = threading.Lock()
    results: list[StreamResult] = []
    started = clock()
    budget = [requests]

    def more() -> bool:
        with lock:
            if budget[0] is None:
                return clock() - started < duration_s  # type: ignore[operator]
            budget[0] -= 1
            return budget[0] >= 0

    def client() -> None:
        while more():
            result = request()
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return aggregate(clients, results, clock() - started)


def read_api_key(path: str | None) -> str:
    """The API key from a file (first line), else $LLAMAFLEET_API_KEY, else none."""
    if not path:
        return os.environ.get("LLAMAFLEET_API_KEY", "")
    text = Path(path).read_text(encoding="utf-8").strip()
    return text.splitlines()[0].strip() if text else ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m llamafleet.bench.measure",
                                     description="Time streamed completions of a llama-server and a concurrency sweep.")
    parser.add_argument("--url", required=True, help="llama-server base URL, http://HOST:PORT")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completion",
                        help="completion: /completion (default); v1: /v1/completions")
    parser.add_argument("--api-key-file", help="file holding the API key (default: $LLAMAFLEET_API_KEY)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--n-predict", type=int, default=64, help="tokens per completion (64)")
    parser.add_argument("--repetitions", type=int, default=3, help="sequential completions (3)")
    parser.add_argument("--sweep", default="", help="client counts for the concurrency sweep, e.g. 1,4,16")
    parser.add_argument("--sweep-requests", type=int, help="requests per sweep step (default: 2 per client)")
    parser.add_argument("--sweep-duration", type=float, help="seconds per sweep step instead of a count")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take (300)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print (and with --out write) ``{"repetitions": [...], "sweep": [...]}``; 1 when a repetition failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        clients = [int(n) for n in args.sweep.split(",") if n.strip()]
        if args.n_predict < 2 or args.repetitions < 0 or not args.timeout > 0:
            raise ValueError("--n-predict must be 2 or more, --repetitions 0 or more, --timeout above 0")
        if args.sweep_requests is not None and args.sweep_duration is not None:
            raise ValueError("--sweep-requests and --sweep-duration exclude each other")
        api_key = read_api_key(args.api_key_file)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))

    def one() -> StreamResult:
        return stream_completion(args.url, args.prompt, args.n_predict, api_key, ENDPOINTS[args.endpoint],
                                 args.timeout)

    reps = [one() for _ in range(args.repetitions)]
    try:
        steps = [sweep(one, n, requests=None if args.sweep_duration else (args.sweep_requests or 2 * n),
                       duration_s=args.sweep_duration) for n in clients]
    except ValueError as exc:
        parser.error(str(exc))
    text = json.dumps({"repetitions": [asdict(r) for r in reps], "sweep": [asdict(s) for s in steps]}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0 if all(r.ok for r in reps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
