"""The gate's KV budget (gate_budget.py): the reservation arithmetic table-driven, the queue in asyncio, and the gate
over real sockets against a stand-in llama-server that keeps a shared KV cache and records when it would overflow."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable

import pytest

from llamafleet.core import gate_metrics, http_wire
from llamafleet.core.gate_budget import (PROMPT_MARGIN, BudgetError, TokenBudget, copies, cost_of, generation_limit,
                                         prompt_tokens)
from llamafleet.core.gate_config import Config, load_config
from llamafleet.core.gate_proxy import Gate
from tests.unit.gate_harness import LoopbackServer, run_gate

# answers bounded to tenths of a second: make check runs these before its parallel workers, alone
pytestmark = pytest.mark.timing


@pytest.mark.parametrize(("body", "default", "limit"), [
    ({"max_tokens": 24}, 0, 24),
    ({"max_completion_tokens": 30, "max_tokens": 24}, 0, 30),
    ({"n_predict": 5, "max_tokens": 24}, 0, 5),
    ({"n_predict": 0}, 512, 0),
    ({}, 512, 512),
    ({}, 0, None),
    ({"max_tokens": -1}, 512, 512),
    ({"max_tokens": "24"}, 0, None),
    ({"max_tokens": True}, 64, 64),
    ({"max_output_tokens": 40}, 0, 40),   # the responses API
])
def test_generation_limit(body: dict[str, Any], default: int, limit: int | None) -> None:
    assert generation_limit(body, default) == limit


@pytest.mark.parametrize(("body", "count"), [({}, 1), ({"n": 3}, 3), ({"n_cmpl": 2, "n": 5}, 2), ({"n": 0}, 1),
                                             ({"n": "3"}, 1), ({"n": False}, 1)])
def test_copies(body: dict[str, Any], count: int) -> None:
    assert copies(body) == count


def test_cost_of_adds_the_prompt_its_margin_and_the_bound_per_answer() -> None:
    assert cost_of(100, {"max_tokens": 24}, 2048, 0).tokens == 100 + PROMPT_MARGIN + 24
    assert cost_of(100, {"max_tokens": 24, "n": 2}, 2048, 0).tokens == 2 * (100 + PROMPT_MARGIN + 24)
    # two prompts counted together (100 tokens in all), one answer each
    assert cost_of(100, {"max_tokens": 24}, 2048, 0, prompts=2).tokens == 100 + 2 * (PROMPT_MARGIN + 24)
    # without a bound a generation may fill the whole cache, and it can never hold more than the cache
    assert cost_of(100, {}, 2048, 0).tokens == 2048
    assert cost_of(100, {}, 2048, 256).tokens == 100 + PROMPT_MARGIN + 256
    assert cost_of(5000, {"max_tokens": 24}, 2048, 0).tokens == 2048


Upstream = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


def _fake_upstream(calls: list[tuple[str, dict[str, Any]]]) -> Upstream:
    async def upstream(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        calls.append((path, payload))
        if path.endswith(("/input_tokens", "/count_tokens")):
            words = " ".join(m["content"] for m in payload["messages"]).split()
            return {"input_tokens": len(words) + 2}  # a template's turn markers
        return {"tokens": list(range(len(payload["content"].split())))}
    return upstream


@pytest.mark.parametrize(("path", "body", "expected", "paths"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}]}, (5, 1),
     ["/v1/chat/completions/input_tokens"]),
    ("/chat/completions", {"messages": [{"role": "user", "content": "one"}]}, (3, 1), ["/chat/completions/input_tokens"]),
    ("/v1/responses", {"messages": [{"role": "user", "content": "a b"}]}, (4, 1), ["/v1/responses/input_tokens"]),
    ("/v1/messages", {"messages": [{"role": "user", "content": "a"}]}, (3, 1), ["/v1/messages/count_tokens"]),
    ("/v1/completions", {"prompt": "one two"}, (2, 1), ["/tokenize"]),
    ("/completion", {"content": "a b c d"}, (4, 1), ["/tokenize"]),
    ("/completion", {"prompt": [1, 2, 3]}, (3, 1), []),
    ("/v1/completions", {"prompt": ["a b", [7, 8, 9]]}, (5, 2), ["/tokenize"]),
])
def test_prompt_tokens_asks_llama_servers_tokenizer(path: str, body: dict[str, Any], expected: tuple[int, int],
                                                    paths: list[str]) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    assert asyncio.run(prompt_tokens(path, body, _fake_upstream(calls))) == expected
    assert [call[0] for call in calls] == paths
    if path.endswith(("completions", "responses", "messages")) and path != "/v1/completions":
        assert calls[0][1] == body  # the body as the client sent it: the template sees tools and all


@pytest.mark.parametrize("body", [{"prompt": 5}, {"prompt": [{"x": 1}]}, {"prompt": []}])
def test_prompt_tokens_refuses_a_prompt_it_cannot_count(body: dict[str, Any]) -> None:
    with pytest.raises(BudgetError) as caught:
        asyncio.run(prompt_tokens("/v1/completions", body, _fake_upstream([])))
    assert caught.value.status == 400


def test_the_budget_admits_in_order_and_a_cancelled_wait_takes_nothing() -> None:
    asyncio.run(_in_order())


async def _in_order() -> None:
    budget = TokenBudget(100)
    assert await budget.acquire(60) == 60
    order: list[str] = []

    async def take(name: str, tokens: int) -> int:
        got = await budget.acquire(tokens)
        order.append(name)
        return got

    big = asyncio.ensure_future(take("big", 70))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(take("small", 10))  # fits now, but waits behind big: first come first served
    gone = asyncio.ensure_future(take("gone", 20))
    await asyncio.sleep(0.01)
    assert (budget.reserved, budget.waiting, order) == (60, 3, [])
    gone.cancel()
    await asyncio.sleep(0.01)
    assert budget.waiting == 2
    budget.release(60)
    await asyncio.sleep(0.01)
    assert order == ["big", "small"] and budget.reserved == 80
    assert await big == 70 and await small == 10
    budget.release(80)
    # more than the whole cache is clamped to it (llama-server stops a generation at the cache's end)
    assert await budget.acquire(1000) == 100 and budget.reserved == 100
    with pytest.raises(ValueError):
        TokenBudget(0)


def test_load_config_reads_the_budget_keys() -> None:
    raw = {"listen_port": 8080, "upstream_port": 8081, "unit": "u.service", "workers": []}
    assert (load_config(raw).kv_budget, load_config(raw).default_max_tokens) == (0, 0)
    assert load_config(dict(raw, kv_budget=2048, default_max_tokens=512)).kv_budget == 2048
    for bad in (-1, 1.5, True, "2048"):
        with pytest.raises(ValueError, match="kv_budget must be a number of tokens"):
            load_config(dict(raw, kv_budget=bad))


class KvServer(LoopbackServer):
    """A llama-server stand-in with one KV cache of ``capacity`` tokens shared by its generations: a generation holds
    its prompt's words plus max_tokens for ``hold`` seconds; ``overflowed`` counts the times the generations in
    flight outgrew the cache (where llama-server fails all of them)."""

    def __init__(self, capacity: int, hold: float = 0.3, key: str | None = None, n_predict: int = 0,
                 count_delay: float = 0.0) -> None:
        self.capacity = capacity
        self.count_delay = count_delay  # seconds /tokenize takes to answer
        self.n_predict = n_predict  # -n: the bound of a generation that gives none
        self.hold = hold
        self.key = key
        self.used = 0
        self.peak = 0
        self.overflowed = 0
        self.paths: list[str] = []
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            req = http_wire.parse_request_head(head)
            _kind, length = http_wire.request_body(req)
            body = json.loads(await reader.readexactly(length)) if length else {}
            self.paths.append(req.path)
            self.heads.append(head)
            if self.key and req.get("authorization") != ["Bearer " + self.key]:
                await self._json(writer, 401, {"error": {"code": 401, "message": "Invalid API Key"}})
            elif req.path == "/v1/chat/completions/input_tokens":
                words = " ".join(m["content"] for m in body["messages"]).split()
                await self._json(writer, 200, {"input_tokens": len(words)})
            elif req.path == "/v1/responses/input_tokens":
                await self._json(writer, 404, {"error": {"code": 404, "message": "File Not Found"}})
            elif req.path == "/tokenize":
                await asyncio.sleep(self.count_delay)
                await self._json(writer, 200, {"tokens": list(range(len(body["content"].split())))})
            else:
                words = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
                limit = body.get("max_tokens", body.get("max_output_tokens", self.n_predict or self.capacity))
                need = min(self.capacity, len(words.split()) + limit)
                self.used += need
                self.peak = max(self.peak, self.used)
                if self.used > self.capacity:
                    self.overflowed += 1
                try:
                    if body.get("stream"):
                        await self._stream(writer)
                    else:
                        await asyncio.sleep(self.hold)
                        await self._json(writer, 200, {"content": "ok", "tokens": need})
                finally:
                    self.used -= need
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        """An SSE answer, a token every 0.1 s for ``hold`` seconds."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        end = time.monotonic() + self.hold
        while time.monotonic() < end:
            writer.write(http_wire.encode_chunk(b'data: {"content":"t"}\n\n'))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(http_wire.LAST_CHUNK)
        await writer.drain()

    @staticmethod
    async def _json(writer: asyncio.StreamWriter, status: int, value: Any) -> None:
        payload = json.dumps(value).encode()
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, len(payload), payload))
        await writer.drain()


CFG = Config(listen_port=8080, upstream_port=8081, unit="llamafleet-llama-server.service", workers=())


def _run(scenario: Callable[[Gate, KvServer], Awaitable[None]], server: KvServer, **cfg: Any) -> None:
    run_gate(scenario, server, CFG, 10, **cfg)


def _post(path: str, value: dict[str, Any], key: str = "k") -> bytes:
    body = json.dumps(value).encode()
    return (b"POST %s HTTP/1.1\r\nHost: gate\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), key.encode(), len(body), body))


async def _exchange(gate: Gate, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


async def _ask(gate: Gate, raw: bytes) -> tuple[int, Any]:
    head, body = (await _exchange(gate, raw)).split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


COMPLETION = {"prompt": "w " * 20, "max_tokens": 20}  # 20 + PROMPT_MARGIN + 20 = 41 tokens reserved


@pytest.mark.parametrize("budget", [100, 0])
def test_six_generations_share_the_cache_without_outgrowing_it(budget: int) -> None:
    """Six generations of 40 tokens each against a cache of 100: with the budget two run at once and the cache
    never overflows; without it (kv_budget 0, the check that this test can fail) all six run and overflow it."""
    async def scenario(gate: Gate, server: KvServer) -> None:
        started = time.monotonic()
        answers = await asyncio.gather(*(_ask(gate, _post("/v1/completions", COMPLETION)) for _index in range(6)))
        took = time.monotonic() - started
        assert [status for status, _body in answers] == [200] * 6
        if budget:
            assert (server.overflowed, server.peak) == (0, 80)
            assert took >= 3 * server.hold  # three rounds of two
            assert gate.budget is not None and gate.budget.reserved == 0
            assert server.paths.count("/tokenize") == 6
        else:
            assert server.overflowed > 0 and server.peak == 240 and "/tokenize" not in server.paths

    _run(scenario, KvServer(100), kv_budget=budget)


@pytest.mark.parametrize("n_predict", [0, 30])
def test_a_generation_without_a_bound_runs_alone_unless_the_server_sets_one(n_predict: int) -> None:
    """Three generations without max_tokens: each may fill the cache, so one at a time; with the server's -n of 30
    (default_max_tokens) each needs 2 + PROMPT_MARGIN + 30 = 33 tokens, so all three at once."""
    async def scenario(gate: Gate, server: KvServer) -> None:
        unbounded = {"prompt": "w w"}
        answers = await asyncio.gather(*(_ask(gate, _post("/completion", unbounded)) for _index in range(3)))
        assert [status for status, _body in answers] == [200] * 3 and server.overflowed == 0
        assert server.peak == (96 if n_predict else 100)

    _run(scenario, KvServer(100, hold=0.1, n_predict=n_predict), kv_budget=100, default_max_tokens=n_predict)


def test_a_chat_is_counted_through_the_template_and_the_key_goes_along() -> None:
    async def scenario(gate: Gate, server: KvServer) -> None:
        chat = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 10}
        assert (await _ask(gate, _post("/v1/chat/completions", chat, key="s3cret")))[0] == 200
        assert server.paths == ["/v1/chat/completions/input_tokens", "/v1/chat/completions"]
        assert all(b"Authorization: Bearer s3cret" in head for head in server.heads)
        # a wrong key is refused by llama-server's own answer, before any generation starts
        status, body = await _ask(gate, _post("/v1/chat/completions", chat, key="wrong"))
        assert status == 401 and body["error"]["message"].endswith("Invalid API Key")
        assert server.paths[-1] == "/v1/chat/completions/input_tokens"
        assert gate.budget is not None and gate.budget.reserved == 0

    _run(scenario, KvServer(100, hold=0.05, key="s3cret"), kv_budget=100)


@pytest.mark.parametrize("path", ["/v1/responses", "/infill"])
def test_a_generation_the_gate_cannot_count_runs_alone(path: str) -> None:
    """/v1/responses on a build that answers its counting route 404, and /infill, which the gate does not count: each
    reserves the whole cache, so three of them run one after another and never overflow it."""
    async def scenario(gate: Gate, server: KvServer) -> None:
        small = {"messages": [{"role": "user", "content": "a b"}], "prompt": "a b", "max_output_tokens": 5}
        started = time.monotonic()
        answers = await asyncio.gather(*(_ask(gate, _post(path, small)) for _index in range(3)))
        assert [status for status, _body in answers] == [200] * 3
        assert time.monotonic() - started >= 3 * server.hold and server.overflowed == 0 and server.peak == 7
        # the responses' counting route was asked each time (and said 404); /infill's count is never asked
        assert server.paths.count("/v1/responses/input_tokens") == (3 if path == "/v1/responses" else 0)

    _run(scenario, KvServer(100, hold=0.15), kv_budget=100)


def test_a_count_that_does_not_come_within_the_deadline_runs_the_generation_alone() -> None:
    """llama-server too busy to answer /tokenize within the gate's deadline: the generations are served one at a time
    (each reserves the whole cache), not refused."""
    async def scenario(gate: Gate, server: KvServer) -> None:
        answers = await asyncio.gather(*(_ask(gate, _post("/v1/completions", COMPLETION)) for _index in range(2)))
        assert [status for status, _body in answers] == [200, 200]
        assert server.peak == 40 and server.overflowed == 0  # one at a time, where two would fit if counted

    _run(scenario, KvServer(100, hold=0.1, count_delay=0.5), kv_budget=100, deadline=0.2)


def test_a_body_that_is_not_json_is_refused_by_the_gate() -> None:
    async def scenario(gate: Gate, server: KvServer) -> None:
        raw = b"POST /v1/completions HTTP/1.1\r\nHost: gate\r\nContent-Length: 5\r\n\r\n{oops"
        status, body = await _ask(gate, raw)
        assert status == 400 and "not JSON" in body["error"]["message"] and server.paths == []

    _run(scenario, KvServer(100), kv_budget=100)


def test_a_generation_that_waits_past_the_request_timeout_is_answered_503() -> None:
    async def scenario(gate: Gate, server: KvServer) -> None:
        streamed = {"prompt": "w", "max_tokens": 80, "stream": True}
        first = asyncio.ensure_future(_exchange(gate, _post("/v1/completions", streamed)))
        await asyncio.sleep(0.1)
        status, body = await _ask(gate, _post("/v1/completions", {"prompt": "w", "max_tokens": 80}))
        assert status == 503 and "shared KV cache (100 tokens) for 0 s; this one needs" in body["error"]["message"]
        assert (await first).startswith(b"HTTP/1.1 200 OK") and server.overflowed == 0
        assert gate.budget is not None and (gate.budget.reserved, gate.budget.waiting) == (0, 0)

    _run(scenario, KvServer(100, hold=1.0), kv_budget=100, request_timeout=0.4)


def test_the_gates_metrics_show_the_budget_and_the_waiting() -> None:
    async def scenario(gate: Gate, server: KvServer) -> None:
        first = asyncio.ensure_future(_ask(gate, _post("/v1/completions", {"prompt": "w", "max_tokens": 80})))
        second = asyncio.ensure_future(_ask(gate, _post("/v1/completions", {"prompt": "w", "max_tokens": 80})))
        await asyncio.sleep(0.15)
        kv = gate.budget
        assert kv is not None
        samples = gate_metrics.gate_samples(gate.state, gate.since, gate.counters, gate.in_flight, 0, None,
                                            gate_metrics.LoadClock(), (kv.capacity, kv.reserved, kv.waiting))
        values = {name: value for name, _labels, value in samples if name.startswith("llamafleet_gate_kv_")}
        assert values == {"llamafleet_gate_kv_budget_tokens": 100, "llamafleet_gate_kv_reserved_tokens": 82,
                          "llamafleet_gate_kv_waiting": 1}
        assert [status for status, _body in await asyncio.gather(first, second)] == [200, 200]

    _run(scenario, KvServer(100, hold=0.4), kv_budget=100)


def test_a_client_that_leaves_while_it_waits_frees_its_place() -> None:
    async def scenario(gate: Gate, server: KvServer) -> None:
        first = asyncio.ensure_future(_ask(gate, _post("/v1/completions", {"prompt": "w", "max_tokens": 80})))
        await asyncio.sleep(0.1)
        _reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
        writer.write(_post("/v1/completions", {"prompt": "w", "max_tokens": 80}))
        await writer.drain()
        await asyncio.sleep(0.1)
        assert gate.budget is not None and gate.budget.waiting == 1
        writer.transport.abort()
        await asyncio.sleep(0.1)
        assert gate.budget.waiting == 0
        assert (await first)[0] == 200
        assert server.paths.count("/v1/completions") == 1 and gate.budget.reserved == 0

    _run(scenario, KvServer(100, hold=0.5), kv_budget=100)


def test_a_chunked_generation_goes_upstream_with_its_length() -> None:
    async def scenario(gate: Gate, server: KvServer) -> None:
        body = json.dumps({"prompt": "a b", "max_tokens": 4}).encode()
        raw = (b"POST /v1/completions HTTP/1.1\r\nHost: gate\r\nTransfer-Encoding: chunked\r\n\r\n"
               + http_wire.encode_chunk(body[:10]) + http_wire.encode_chunk(body[10:]) + http_wire.LAST_CHUNK)
        assert (await _ask(gate, raw))[0] == 200
        assert b"Content-Length: %d" % len(body) in server.heads[-1] and b"chunked" not in server.heads[-1]

    _run(scenario, KvServer(100, hold=0.05), kv_budget=100)


def test_a_generation_that_expects_100_continue_gets_it_once_before_its_body_is_counted() -> None:
    async def scenario(gate: Gate, server: KvServer) -> None:
        body = json.dumps(COMPLETION).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gate\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        await writer.drain()
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        rest = await reader.read()
        writer.close()
        assert rest.startswith(b"HTTP/1.1 200 ") and b"100 Continue" not in rest, rest[:200]
        assert server.paths.count("/tokenize") == 1 and b"Expect" not in server.heads[-1]

    _run(scenario, KvServer(100, hold=0.05), kv_budget=100)
