# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""HTTP/1.1 on the wire, as the serving gate speaks it: request and response heads parsed strictly (no
smuggling: bare CR/LF, folding, both framings, lengths other than ASCII digits, a missing or second Host are
refused), body framing, the chunked codec, error answers in llama-server's JSON shape, the SSE error event, and a
one-shot client (the watchdog's ``/health``, ``/metrics`` and canary).

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any


# Fixed limits.
MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE = 4096
MAX_ANSWER_BYTES = 4 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 408: "Request Timeout", 411: "Length Required",
            413: "Content Too Large", 500: "Internal Server Error",
            501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 408: "invalid_request_error", 411: "invalid_request_error",
                413: "invalid_request_error",
                501: "not_supported_error", 502: "server_error", 503: "unavailable_error", 504: "timeout_error"}
# Hop-by-hop headers (RFC 9110 7.6.1) the gate replaces; Expect is answered by the gate itself.
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"))
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_REQUEST_LINE = re.compile(r"^([!#$%&'*+.^_`|~0-9A-Za-z-]+) (\S+) HTTP/(1\.[01])$")
_STATUS_LINE = re.compile(r"^HTTP/(1\.[01]) ([0-9]{3})(?: (.*))?$")
# a Content-Length: ASCII digits only (no sign, space or other script), short enough for int() and 64 bits
_LENGTH = re.compile(r"[0-9]{1,18}")
LAST_CHUNK = b"0\r\n\r\n"


class HeadError(Exception):
    """A request (or response) head the gate cannot relay; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Head:
    """Header access shared by request and response heads (headers keep their order and spelling)."""

    headers: list[tuple[str, str]]

    def get(self, name: str) -> list[str]:
        """Every value of header ``name`` (case-insensitive)."""
        return [value for key, value in self.headers if key.lower() == name.lower()]

    def codings(self) -> list[str]:
        """The Transfer-Encoding codings, lower-cased, in order."""
        return [item.strip().lower() for value in self.get("transfer-encoding") for item in value.split(",")
                if item.strip()]


@dataclass
class RequestHead(_Head):
    """A parsed request head."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass
class ResponseHead(_Head):
    """A parsed response head."""

    version: str
    status: int
    reason: str
    headers: list[tuple[str, str]]


def _parse_headers(lines: list[str], status: int) -> list[tuple[str, str]]:
    headers = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name):
            raise HeadError(status, "malformed header line %r" % line[:80])
        headers.append((name, value.strip(" \t")))
    return headers


def _split_head(head: bytes, status: int) -> list[str]:
    if not head.endswith(b"\r\n\r\n"):
        raise HeadError(status, "incomplete head")
    try:
        text = head[:-4].decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise HeadError(status, "undecodable head") from None
    lines = text.split("\r\n")
    if any("\n" in line or "\r" in line or "\0" in line for line in lines):
        raise HeadError(status, "bare CR, LF or NUL in the head")
    if any(line[:1] in (" ", "\t") for line in lines[1:]):
        raise HeadError(status, "folded header lines are not allowed")
    return lines


def parse_request_head(head: bytes) -> RequestHead:
    """Parse ``head`` (request line and headers, ending in an empty line); HeadError(400) on garbage."""
    lines = _split_head(head, 400)
    match = _REQUEST_LINE.match(lines[0])
    if not match:
        raise HeadError(400, "malformed request line %r" % lines[0][:80])
    req = RequestHead(match.group(1), match.group(2), match.group(3), _parse_headers(lines[1:], 400))
    # RFC 9112 3.2: one Host line at most, and one in every HTTP/1.1 request (HTTP/1.0 may go without)
    hosts = len(req.get("host"))
    if hosts > 1 or (not hosts and req.version == "1.1"):
        raise HeadError(400, "more than one Host header" if hosts else "an HTTP/1.1 request needs a Host header")
    return req


def parse_response_head(head: bytes) -> ResponseHead:
    """Parse a response head from llama-server; HeadError(502) on garbage."""
    lines = _split_head(head, 502)
    match = _STATUS_LINE.match(lines[0])
    if not match:
        raise HeadError(502, "malformed status line %r" % lines[0][:80])
    return ResponseHead(match.group(1), int(match.group(2)), match.group(3) or "", _parse_headers(lines[1:], 502))


def request_body(req: RequestHead) -> tuple[str, int]:
    """How the request body is framed: ("none", 0), ("length", N) or ("chunked", 0); HeadError otherwise (400 for
    a Content-Length that is not ASCII digits, 411 for a coding other than chunked)."""
    encodings = req.codings()
    if encodings:
        if req.get("content-length"):
            raise HeadError(400, "both Content-Length and Transfer-Encoding")
        if encodings != ["chunked"]:
            raise HeadError(411, "unsupported Transfer-Encoding %s (send chunked or a Content-Length)"
                            % ", ".join(encodings))
        return "chunked", 0
    length = content_length(req, 400)
    return ("length", length) if length else ("none", 0)


def content_length(head: _Head, status: int) -> int | None:
    """The Content-Length of ``head`` (None without one); HeadError(``status``) unless every value is the same
    run of 1 to 18 ASCII digits (``str.isdigit`` takes superscripts and other scripts' digits, which ``int``
    then refuses or reads)."""
    values = set(head.get("content-length"))
    if not values:
        return None
    value = values.pop()
    if values or not _LENGTH.fullmatch(value):
        raise HeadError(status, "invalid Content-Length %r" % value[:20])
    return int(value)


def wants_continue(req: RequestHead) -> bool:
    """True when the client waits for ``100 Continue`` before it sends the body."""
    return any(value.strip().lower() == "100-continue" for value in req.get("expect"))


def _without_hop_by_hop(headers: list[tuple[str, str]], extra: frozenset[str]) -> list[tuple[str, str]]:
    named = {token.strip().lower() for key, value in headers if key.lower() == "connection"
             for token in value.split(",") if token.strip()}
    drop = _HOP_BY_HOP | extra | (named - {"content-length", "transfer-encoding", "authorization", "host"})
    return [(key, value) for key, value in headers if key.lower() not in drop]


def upstream_request_head(req: RequestHead, body_length: int | None = None) -> bytes:
    """The head sent to llama-server: hop-by-hop headers (Connection, Keep-Alive, Expect, ...) replaced by
    ``Connection: close``; every other header, Authorization included, unchanged. With ``body_length`` (a body the
    gate read whole), its framing is that Content-Length."""
    framing = frozenset(("content-length", "transfer-encoding")) if body_length is not None else frozenset()
    headers = _without_hop_by_hop(req.headers, framing) + [("Connection", "close")]
    if body_length is not None:
        headers.append(("Content-Length", str(body_length)))
    lines = ["%s %s HTTP/%s" % (req.method, req.target, req.version)] + ["%s: %s" % item for item in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def client_response_head(resp: ResponseHead) -> bytes:
    """The response head relayed to the client: Connection/Keep-Alive replaced by ``Connection: close``."""
    headers = _without_hop_by_hop(resp.headers, frozenset()) + [("Connection", "close")]
    status_line = "HTTP/%s %d %s" % (resp.version, resp.status, resp.reason)
    return ("\r\n".join([status_line.rstrip(" ")] + ["%s: %s" % item for item in headers]) + "\r\n\r\n").encode(
        "latin-1")


def response_body(method: str, resp: ResponseHead) -> tuple[str, int]:
    """How the response body is framed: ("none", 0), ("length", N), ("chunked", 0) or ("close", 0); HeadError(502)
    on a bad Content-Length."""
    if method == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200:
        return "none", 0
    encodings = resp.codings()
    if encodings:
        return ("chunked", 0) if encodings[-1] == "chunked" else ("close", 0)
    length = content_length(resp, 502)
    return ("close", 0) if length is None else ("length", length)


def is_event_stream(resp: ResponseHead) -> bool:
    """True for a streaming (``text/event-stream``) response."""
    return any(value.split(";")[0].strip().lower() == "text/event-stream" for value in resp.get("content-type"))


def error_object(code: int, message: str) -> dict[str, Any]:
    """The error in llama-server's shape: ``{"error": {"code", "type", "message"}}``."""
    return {"error": {"code": code, "type": _ERROR_TYPES.get(code, "server_error"),
                      "message": "llamafleet: %s" % message}}


def error_message(body: bytes | str) -> str:
    """The message of an error body in llama-server's shape (``{"error": {"message": ...}}``), else the body's start:
    what a client shows of an error answer (the library's Endpoint, the benchmark's streamed completions)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    if isinstance(data, dict) and isinstance(data.get("error"), dict) and data["error"].get("message"):
        return str(data["error"]["message"])
    return text.strip()[:300]


def error_response(code: int, message: str, retry_after: int | None = None, body: bool = True) -> bytes:
    """A complete HTTP/1.1 error answer with a JSON body (none for HEAD) and ``Connection: close``."""
    payload = json.dumps(error_object(code, message)).encode("utf-8")
    headers = ["HTTP/1.1 %d %s" % (code, _REASONS.get(code, "Error")),
               "Content-Type: application/json; charset=utf-8",
               "Content-Length: %d" % len(payload)]
    if retry_after is not None:
        headers.append("Retry-After: %d" % retry_after)
    headers.append("Connection: close")
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + (payload if body else b"")


def sse_error_event(code: int, message: str, tail: bytes = b"\n\n") -> bytes:
    """An SSE ``data:`` event carrying the error; ``tail`` (the stream's last bytes) decides how many
    newlines end a partly sent event first."""
    lead = b"" if tail.endswith(b"\n\n") or not tail else (b"\n" if tail.endswith(b"\n") else b"\n\n")
    return lead + b"data: " + json.dumps(error_object(code, message)).encode("utf-8") + b"\n\n"


def encode_chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never the last one: ``data`` must not be empty)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class ChunkError(ValueError):
    """A chunked body that breaks the framing."""


class ChunkDecoder:
    """Incremental decoder of a chunked body: ``feed(bytes)`` returns the data pieces found so far;
    ``done`` turns true after the last chunk and its trailers. Bytes after the end are ignored."""

    def __init__(self) -> None:
        self._buf = b""
        self._remaining = 0  # data bytes left in the current chunk
        self._phase = "size"  # size | data | crlf | trailer
        self.done = False

    def feed(self, data: bytes) -> list[bytes]:
        """Decode ``data``; raises ChunkError on broken framing."""
        pieces: list[bytes] = []
        self._buf += data
        while self._buf and not self.done:
            if self._phase == "data":
                piece, self._buf = self._buf[:self._remaining], self._buf[self._remaining:]
                self._remaining -= len(piece)
                pieces.append(piece)
                if not self._remaining:
                    self._phase = "crlf"
                continue
            if self._phase == "crlf":
                if len(self._buf) < 2:
                    break
                if self._buf[:2] != b"\r\n":
                    raise ChunkError("chunk data not followed by CRLF")
                self._buf = self._buf[2:]
                self._phase = "size"
                continue
            line, sep, rest = self._buf.partition(b"\r\n")
            if not sep:
                if len(self._buf) > MAX_CHUNK_LINE:
                    raise ChunkError("chunk size line too long")
                break
            self._buf = rest
            if self._phase == "trailer":
                if not line:
                    self.done = True
                continue
            size = line.split(b";", 1)[0].strip()
            if not size or not re.fullmatch(rb"[0-9a-fA-F]{1,15}", size):
                raise ChunkError("invalid chunk size %r" % size[:20])
            self._remaining = int(size, 16)
            self._phase = "data" if self._remaining else "trailer"
        return [piece for piece in pieces if piece]


async def http_request(host: str, port: int, method: str, path: str, timeout: float,
                       headers: dict[str, str] | None = None, body: bytes = b"") -> tuple[int, bytes]:
    """A one-shot HTTP/1.1 request (Connection: close) -> (status, body). Raises OSError or TimeoutError."""

    async def exchange() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD_BYTES)
        try:
            lines = ["%s %s HTTP/1.1" % (method, path), "Host: %s:%d" % (host, port), "Connection: close",
                     "Content-Length: %d" % len(body)] + ["%s: %s" % item for item in (headers or {}).items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            head = parse_response_head(await reader.readuntil(b"\r\n\r\n"))
            mode, length = response_body(method, head)
            if mode == "length":
                return head.status, await reader.readexactly(min(length, MAX_ANSWER_BYTES))
            data = await reader.read(MAX_ANSWER_BYTES)
            rest = data
            while rest and len(data) < MAX_ANSWER_BYTES:
                rest = await reader.read(MAX_ANSWER_BYTES - len(data))
                data += rest
            if mode == "chunked":
                return head.status, b"".join(ChunkDecoder().feed(data))
            return head.status, data if mode == "close" else b""
        finally:
            writer.transport.abort()

    try:
        return await asyncio.wait_for(exchange(), timeout)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, HeadError, ChunkError) as exc:
        raise ConnectionError("bad HTTP answer: %s" % exc) from None
