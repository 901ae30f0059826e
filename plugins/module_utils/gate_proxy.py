# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gate's proxy: listens where clients connect (TLS when configured), answers 503 with the reason itself while
the cluster is down, relays each request to llama-server on loopback (one upstream connection per request,
``Connection: close``, answers streamed as they arrive), and ends every request in flight when the state goes down
(an SSE stream gets an error event first). :class:`Gate` holds the cluster state the watchdog sets.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from .gate_budget import (ALONE_PATHS, BUDGET_PATHS, MAX_BUDGET_BODY, NO_ROUTE, BudgetError, TokenBudget, cost_of,
                          decode_body, prompt_tokens)
from .gate_config import Config
from .gate_decision import DOWN, RETRY_AFTER, STARTING, STATES, admission, retry_after
from .gate_metrics import GATE_METRICS_PATH, metrics_response
from .http_wire import (LAST_CHUNK, MAX_HEAD_BYTES, ChunkDecoder, ChunkError, HeadError, RequestHead, ResponseHead,
                        client_response_head, encode_chunk, error_message, error_response, http_request,
                        is_event_stream, parse_request_head, parse_response_head, request_body, response_body,
                        sse_error_event, upstream_request_head, wants_continue)


RELAY_READ_SIZE = 64 * 1024
CLIENT_HEAD_TIMEOUT = 30.0
CLOSE_TIMEOUT = 2.0
LOG_PREFIX = "llamafleet-gate: "
NOT_RUNNING = "llama-server is not running (restarting)"
# The interim answer to a client's Expect: 100-continue (written once, by _serve).
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
BODY_CLOSED = "the client closed the connection in the request body"


def log(message: str) -> None:
    """One line to stdout (the journal)."""
    sys.stdout.write(LOG_PREFIX + message + "\n")
    sys.stdout.flush()


class _Abort(Exception):
    """End the request: answer ``code`` (0: the client is gone, nothing to say) with ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _UpstreamGone(Exception):
    """llama-server stopped taking the request body."""


@dataclass(eq=False)
class _Flight:
    abort: asyncio.Future  # type: ignore[type-arg]  # result: (code, message)


def _settle(future: asyncio.Future, code: int, message: str) -> None:  # type: ignore[type-arg]
    if not future.done():
        future.set_result((code, message))


def _reason_shape(reason: str) -> str:
    """A reason with its numbers blanked out, to tell a new reason from the same one with new figures."""
    return re.sub(r"[0-9]+(\.[0-9]+)?", "#", reason)


class Gate:
    """The proxy and the cluster state it enforces (the watchdog sets the state with set_state)."""

    def __init__(self, cfg: Config, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.state = DOWN
        self.reason = STARTING
        self.since = clock()
        self.counters = {"requests": 0, "rejected_503": 0, "aborted": 0}
        # the shared KV cache's guard (gate_budget.py): None without a shared cache of several slots
        self.budget = TokenBudget(cfg.kv_budget) if cfg.kv_budget > 0 else None
        self._flights: set[_Flight] = set()
        self._connections = 0
        # time.monotonic() of the last answer llama-server completed or streamed on for a client (the canary's proof)
        self.last_answer = float("-inf")
        self._server: asyncio.AbstractServer | None = None
        self._stopping = False
        # the gate's own metrics (GATE_METRICS_PATH) and the API key they need: set by serve() from the watchdog
        # (no key while cfg names an api_key_file: the metrics stay closed)
        self.metrics_text: Callable[[], str] | None = None
        self.metrics_key: Callable[[], str | None] = lambda: None

    def set_state(self, state: str, reason: str) -> bool:
        """Set the cluster state; going ``down`` ends every request in flight at once.
        Logs and returns True when state or reason changed."""
        if state not in STATES:
            raise ValueError("unknown state %r" % state)
        if (state, reason) == (self.state, self.reason):
            return False
        old = self.state
        if state != old:
            self.since = self.clock()
        # a reason whose only change is its figures (a stall growing by the second) is not logged again
        if state != old or _reason_shape(reason) != _reason_shape(self.reason):
            log("%s -> %s: %s" % (old, state, reason))
        self.state, self.reason = state, reason
        if state == DOWN:
            self.abort_all(503, reason)
        return True

    def abort_all(self, code: int, message: str) -> None:
        """End every request in flight with ``code`` and ``message``."""
        for flight in list(self._flights):
            _settle(flight.abort, code, message)

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server-side TLS context from tls_cert/tls_key, or None."""
        if not self.cfg.tls_cert:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        return context

    async def start(self) -> asyncio.AbstractServer:
        """Listen on listen_host:listen_port (port 0: any; see ``port``)."""
        self._server = await asyncio.start_server(self._client, self.cfg.listen_host, self.cfg.listen_port,
                                                  ssl=self.ssl_context(), limit=MAX_HEAD_BYTES, backlog=512)
        return self._server

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the gate is not listening yet")
        return self._server.sockets[0].getsockname()[1]

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting; give requests in flight ``grace`` seconds (default: deadline), then end them."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        end = time.monotonic() + (self.cfg.deadline if grace is None else grace)
        while self._flights and time.monotonic() < end:
            await asyncio.sleep(0.05)
        self.abort_all(503, "the gate is stopping")
        while self._flights and time.monotonic() < end + CLOSE_TIMEOUT:
            await asyncio.sleep(0.02)

    # -- one client connection -----------------------------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= self.cfg.max_connections or self._stopping:
            self.counters["rejected_503"] += 1
            await self._answer(writer, error_response(503, "too many connections to the gate" if not self._stopping
                                                      else "the gate is stopping", RETRY_AFTER["busy"]))
            return
        self._connections += 1
        try:
            await self._serve(reader, writer)
        except Exception as exc:  # noqa: BLE001 - one connection must never take the gate down
            log("error relaying a request: %s: %s" % (type(exc).__name__, exc))
            writer.transport.abort()
        finally:
            self._connections -= 1

    async def _answer(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write ``data`` (bounded by deadline) and close."""
        try:
            writer.write(data)
            await asyncio.wait_for(writer.drain(), self.cfg.deadline)
        except (OSError, asyncio.TimeoutError, RuntimeError):
            writer.transport.abort()
            return
        await self._close(writer)

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        try:
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT)
        except (OSError, asyncio.TimeoutError, RuntimeError, ssl.SSLError):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLIENT_HEAD_TIMEOUT)
        except asyncio.LimitOverrunError:
            await self._answer(writer, error_response(400, "request head larger than %d bytes" % MAX_HEAD_BYTES))
            return
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                await self._answer(writer, error_response(400, "incomplete request head"))
            else:
                await self._close(writer)
            return
        except asyncio.TimeoutError:
            await self._answer(writer, error_response(408, "no complete request head in %.0f s"
                                                      % CLIENT_HEAD_TIMEOUT))
            return
        except (OSError, ssl.SSLError):
            writer.transport.abort()
            return
        try:
            req = parse_request_head(head)
            framing = request_body(req)
        except HeadError as exc:
            await self._answer(writer, error_response(exc.status, exc.message))
            return
        if req.path == GATE_METRICS_PATH and req.method in ("GET", "HEAD") and self.metrics_text is not None:
            await self._answer(writer, metrics_response(req, self.metrics_key(), self.metrics_text(),
                                                        key_required=self.cfg.api_key_file is not None))
            return
        self.counters["requests"] += 1
        if not admission(self.state, req):
            self.counters["rejected_503"] += 1
            await self._answer(writer, error_response(503, self.reason, retry_after(self.state),
                                                      body=req.method != "HEAD"))
            return
        flight = _Flight(asyncio.get_running_loop().create_future())
        self._flights.add(flight)
        pump = None
        reserved = 0
        try:
            body = None
            # once, before the body is read here or relayed (a 503 may follow it: an interim answer binds nothing)
            if wants_continue(req) and framing[0] != "none":
                writer.write(CONTINUE)
            budget = self.budget
            if budget is not None and req.method == "POST" and req.path in BUDGET_PATHS:
                try:
                    body = await self._read_body(reader, framing)
                    # the client's hang-up is watched from here on (the body is read)
                    pump = asyncio.ensure_future(self._pump(reader, None, ("none", 0), flight))
                    reserved = await self._admit(budget, req, body, flight)
                except _Abort as exc:
                    await self._abort(req, writer, None, exc, False, False, b"")
                    return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.cfg.upstream_host, self.cfg.upstream_port, limit=MAX_HEAD_BYTES),
                    self.cfg.deadline)
            except (OSError, asyncio.TimeoutError):
                self.counters["rejected_503"] += 1
                await self._answer(writer, error_response(503, NOT_RUNNING, retry_after(DOWN),
                                                          body=req.method != "HEAD"))
                return
            if not admission(self.state, req):  # the state changed while connecting
                _settle(flight.abort, 503, self.reason)
            try:
                if body is None:
                    up_writer.write(upstream_request_head(req))
                    pump = asyncio.ensure_future(self._pump(reader, up_writer, framing, flight))
                else:
                    up_writer.write(upstream_request_head(req, len(body)) + body)
                await self._relay(req, up_reader, writer, flight)
            finally:
                up_writer.transport.abort()
        finally:
            self._flights.discard(flight)
            if pump is not None:
                pump.cancel()
            if reserved and self.budget is not None:
                self.budget.release(reserved)

    async def _read_body(self, reader: asyncio.StreamReader, framing: tuple[str, int]) -> bytes:
        """The whole request body (to count its tokens), at most MAX_BUDGET_BODY bytes, each read within
        CLIENT_HEAD_TIMEOUT."""
        kind, length = framing
        if kind == "length" and length > MAX_BUDGET_BODY:
            raise _Abort(413, "request body larger than %d bytes" % MAX_BUDGET_BODY)
        slow = _Abort(408, "no complete request body in %.0f s" % CLIENT_HEAD_TIMEOUT)
        try:
            if kind == "length":
                return await asyncio.wait_for(reader.readexactly(length), CLIENT_HEAD_TIMEOUT)
            body = b""
            if kind == "chunked":
                decoder = ChunkDecoder()
                while not decoder.done:
                    data = await asyncio.wait_for(reader.read(RELAY_READ_SIZE), CLIENT_HEAD_TIMEOUT)
                    if not data:
                        raise _Abort(0, BODY_CLOSED)
                    body += b"".join(decoder.feed(data))
                    if len(body) > MAX_BUDGET_BODY:
                        raise _Abort(413, "request body larger than %d bytes" % MAX_BUDGET_BODY)
            return body
        except asyncio.TimeoutError:
            raise slow from None
        except asyncio.IncompleteReadError:
            raise _Abort(0, BODY_CLOSED) from None
        except ChunkError as exc:
            raise _Abort(400, "bad chunked request body: %s" % exc) from None
        except (OSError, ssl.SSLError):
            raise _Abort(0, "the client closed the connection") from None

    async def _admit(self, budget: TokenBudget, req: RequestHead, body: bytes, flight: _Flight) -> int:
        """Wait until the generation's tokens fit the shared KV cache (``budget``) beside those in flight
        (gate_budget.py); returns the tokens reserved."""
        try:
            data = decode_body(body)
        except BudgetError as exc:
            raise _Abort(exc.status, exc.message) from None
        auth = req.get("authorization")

        async def upstream(path: str, payload: dict[str, Any]) -> dict[str, Any]:
            headers = {"Content-Type": "application/json"}
            if auth:
                headers["Authorization"] = auth[0]
            status, answer = await http_request(self.cfg.upstream_host, self.cfg.upstream_port, "POST", path,
                                                self.cfg.deadline, headers, json.dumps(payload).encode("utf-8"))
            if status != 200:
                raise BudgetError(status, error_message(answer))
            try:
                value = json.loads(answer.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                value = None
            if not isinstance(value, dict):
                raise BudgetError(502, "llama-server's %s answered something other than a JSON object" % path)
            return value

        tokens = budget.capacity  # not counted (a route the gate cannot count, a build without the counting route,
        # llama-server not answering it within the deadline): the generation runs alone
        try:
            if req.path not in ALONE_PATHS:
                counted, prompts = await self._race(prompt_tokens(req.path, data, upstream), flight, None,
                                                    _Abort(0, "unreachable: no timeout"))
                tokens = cost_of(counted, data, budget.capacity, self.cfg.default_max_tokens, prompts).tokens
        except BudgetError as exc:
            if exc.status < 500 and exc.status not in NO_ROUTE:
                raise _Abort(exc.status, exc.message) from None
        except (OSError, asyncio.TimeoutError):
            pass
        waited = time.monotonic()
        task = asyncio.ensure_future(budget.acquire(tokens))
        await asyncio.wait({task, flight.abort}, timeout=self.cfg.request_timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        if task.done() and not task.cancelled():
            reserved = task.result()
            if not flight.abort.done():
                return reserved
            budget.release(reserved)
        task.cancel()
        if flight.abort.done():
            raise _Abort(*flight.abort.result())
        self.counters["rejected_503"] += 1
        raise _Abort(503, "the generations in flight held llama-server's shared KV cache (%d tokens) for %.0f s; "
                          "this one needs %d" % (budget.capacity, time.monotonic() - waited, tokens))

    async def _pump(self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter | None,
                    framing: tuple[str, int], flight: _Flight) -> None:
        """Send the request body upstream (re-framed when chunked; none: the gate read it already), then watch
        the client for a hang-up."""
        kind, remaining = framing
        try:
            if kind == "length":
                while remaining:
                    data = await reader.read(min(RELAY_READ_SIZE, remaining))
                    if not data:
                        raise ConnectionResetError(BODY_CLOSED)
                    remaining -= len(data)
                    await self._send_up(up_writer, data)
            elif kind == "chunked":
                decoder = ChunkDecoder()
                while not decoder.done:
                    data = await reader.read(RELAY_READ_SIZE)
                    if not data:
                        raise ConnectionResetError(BODY_CLOSED)
                    await self._send_up(up_writer, b"".join(encode_chunk(piece) for piece in decoder.feed(data)))
                await self._send_up(up_writer, LAST_CHUNK)
            while await reader.read(RELAY_READ_SIZE):
                pass  # a pipelined request is not served: the gate closes after one answer
            _settle(flight.abort, 0, "the client closed the connection")
        except _UpstreamGone:
            return  # the relay sees llama-server's answer or hang-up
        except ChunkError as exc:
            _settle(flight.abort, 400, "bad chunked request body: %s" % exc)
        except (OSError, ssl.SSLError):
            _settle(flight.abort, 0, "the client closed the connection")

    @staticmethod
    async def _send_up(up_writer: asyncio.StreamWriter, data: bytes) -> None:
        try:
            up_writer.write(data)
            await up_writer.drain()
        except (OSError, RuntimeError) as exc:
            raise _UpstreamGone(str(exc)) from None

    async def _race(self, awaitable: Awaitable[Any], flight: _Flight, timeout: float | None,
                    on_timeout: _Abort) -> Any:
        """Await ``awaitable`` unless the flight is aborted or ``timeout`` passes first."""
        task = asyncio.ensure_future(awaitable)
        done, _pending = await asyncio.wait({task, flight.abort}, timeout=timeout,
                                            return_when=asyncio.FIRST_COMPLETED)
        if flight.abort.done():
            task.cancel()
            raise _Abort(*flight.abort.result())
        if task not in done:
            task.cancel()
            raise on_timeout
        return task.result()

    async def _relay(self, req: RequestHead, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     flight: _Flight) -> None:
        """Relay llama-server's answer as it arrives; on an abort answer or end the stream (see _abort)."""
        timeout = self.cfg.request_timeout
        idle = _Abort(504, "llama-server sent nothing for %g s" % timeout)
        resp: ResponseHead | None = None
        chunked = sse = False
        mode, length = "none", 0
        tail = b""
        try:
            buf = b""
            while resp is None:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise _Abort(502, "llama-server sent an oversized response head")
                    data = await self._race(up_reader.read(RELAY_READ_SIZE), flight, timeout, idle)
                    if not data:
                        raise _Abort(503, "llama-server closed the connection without answering (restarting?)")
                    buf += data
                    continue
                try:
                    head = parse_response_head(buf[:end + 4])
                    mode, length = response_body(req.method, head)
                except HeadError as exc:
                    raise _Abort(502, "bad answer from llama-server: %s" % exc.message) from None
                buf = buf[end + 4:]
                if 100 <= head.status < 200 and head.status != 101:
                    continue  # an interim answer: the gate already said 100 Continue itself
                resp = head
            chunked, sse = mode == "chunked", is_event_stream(resp)
            writer.write(client_response_head(resp))
            decoder = ChunkDecoder() if chunked else None
            while True:
                if decoder is not None:
                    try:
                        pieces = decoder.feed(buf)
                    except ChunkError as exc:
                        raise _Abort(502, "bad chunked answer from llama-server: %s" % exc) from None
                    for piece in pieces:
                        writer.write(encode_chunk(piece))
                        tail = (tail + piece)[-2:]
                    if decoder.done:
                        writer.write(LAST_CHUNK)
                        break
                elif mode == "length":
                    piece = buf[:length]
                    length -= len(piece)
                    writer.write(piece)
                    tail = (tail + piece)[-2:]
                    if not length:
                        break
                elif mode == "close":
                    writer.write(buf)
                    tail = (tail + buf)[-2:]
                else:
                    break
                await self._race(writer.drain(), flight, timeout, _Abort(0, "the client stopped reading"))
                buf = await self._race(up_reader.read(RELAY_READ_SIZE), flight, timeout, idle)
                if not buf:
                    if mode == "close":
                        break
                    raise _Abort(503, "llama-server closed the connection in mid-answer (restarting?)")
                if resp.status < 500:
                    # a streamed answer still coming is proof of a working cluster (the watchdog's canary)
                    self.last_answer = time.monotonic()
            await self._race(writer.drain(), flight, timeout, _Abort(0, "the client stopped reading"))
            if resp.status < 500:
                self.last_answer = time.monotonic()
        except _Abort as exc:
            await self._abort(req, writer, resp, exc, chunked, sse, tail)
            return
        except (OSError, ssl.SSLError):
            await self._abort(req, writer, resp, _Abort(503, "llama-server closed the connection (restarting?)"),
                              chunked, sse, tail)
            return
        await self._close(writer)

    async def _abort(self, req: RequestHead, writer: asyncio.StreamWriter, resp: ResponseHead | None, exc: _Abort,
                     chunked: bool, sse: bool, tail: bytes) -> None:
        """End a relayed request: an error answer if nothing was sent yet, an SSE error event on a stream."""
        if exc.code == 0:
            writer.transport.abort()
            return
        self.counters["aborted"] += 1
        if resp is None:
            await self._answer(writer, error_response(exc.code, exc.message,
                                                      retry_after(self.state) if exc.code == 503 else None,
                                                      body=req.method != "HEAD"))
            return
        if sse:
            event = sse_error_event(exc.code, exc.message, tail)
            await self._answer(writer, encode_chunk(event) + LAST_CHUNK if chunked else event)
            return
        writer.transport.abort()
