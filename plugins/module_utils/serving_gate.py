# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The orchestrator's serving gate: a front door for llama-server and a watchdog for its RPC links.

llama-server talks to its rpc-server workers over TCP without timeouts: a
silent partition to one worker blocks it forever inside a computation while
``/health`` keeps answering 200. The gate listens where clients connect,
relays each request to llama-server on loopback (one upstream connection per
request, ``Connection: close``, responses streamed as they arrive) and keeps a
cluster state, ``serving``, ``loading`` or ``down``, with a reason:

- ``down``: requests get an immediate 503 with a JSON error in llama-server's
  shape and ``Retry-After`` (``/health`` included); going down ends every
  request in flight at once (an SSE stream gets an error event first);
  ``loading``: requests are relayed (llama-server answers 503 "Loading model"
  itself until it is ready);
- the watchdog polls every ``poll_interval`` seconds: the unit's process
  (``systemctl show``), llama-server's ``/health``, and the kernel's view of
  llama-server's connections to the workers (``ss -tinHO``: a link with
  unacknowledged data and no ACK for ``stall_seconds``, seen on two polls in a
  row, is stalled; so is a link that has waited that long for the worker's
  answer while the worker's host, which answered ping before, answers ping no
  more). It never connects to an rpc-server (one client at a time,
  backlog 1). A canary completion every ``canary_interval`` seconds keeps RPC
  traffic flowing on an idle cluster; one that misses ``canary_deadline``
  while ``/metrics`` shows no progress means the cluster is stuck;
- stuck or stalled: SIGKILL to llama-server's MainPID; systemd restarts it,
  its ExecStartPre waits for the workers, it loads and serves again.

Run on the orchestrator as ``python3 serving_gate.py --config /etc/llamafleet/gate.json``.

The same file guards each worker's rpc-server (``python3 serving_gate.py guard
PORT=UNIT ...``): after a silent partition the worker's rpc-server still holds
the dead connection of the llama-server that was killed (its reset was lost in
the partition, and rpc-server has no keepalive), so it never accepts the new
llama-server, which waits for it forever. The guard sees a live client queued
behind the one being served (see :func:`guard_decide`) and restarts rpc-server.

Stdlib only: a module_utils file of the collection, installed on the hosts in the host package
(constants.HOST_PACKAGE) with ``systemd_show.py``, the one reader of ``systemctl show`` it imports.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import os
import re
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

from .systemd_show import parse_show, show_argv

# Configuration defaults (seconds unless named otherwise).
DEFAULT_LISTEN_HOST = "0.0.0.0"
DEFAULT_UPSTREAM_HOST = "127.0.0.1"
DEFAULT_DEADLINE = 10.0
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_STALL_SECONDS = 4.0
# A stall answers clients 503 at once; llama-server is restarted only once it has lasted this long
# (a short blip heals by TCP's own retransmission, and a restart costs a model load).
DEFAULT_RESTART_AFTER = 30.0
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_CANARY_INTERVAL = 30.0
DEFAULT_CANARY_DEADLINE = 60.0
DEFAULT_RESTART_GRACE = 15.0
DEFAULT_MAX_CONNECTIONS = 256
# Degraded mode: seconds down before the gate serves without a lost worker, seconds between HELLO probes of
# the workers while it decides (or of the lost one while degraded), answers in a row that bring the full plan back.
DEFAULT_DEGRADE_AFTER = 45.0
DEFAULT_DEGRADE_PROBE_INTERVAL = 10.0
DEFAULT_RETURN_PROBES = 3
FULL_PLAN = "full"
_PLAN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")

# Fixed limits.
MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE = 4096
RELAY_READ_SIZE = 64 * 1024
CLIENT_HEAD_TIMEOUT = 30.0
SUBPROCESS_TIMEOUT = 5.0
# Liveness probe of a worker's host (ICMP echo): its timeout, and how often each host is pinged while its
# link is quiet, to learn whether it answers ping at all (a host that never did is not judged by ping).
PING_TIMEOUT = 1.0
PING_BASELINE_INTERVAL = 60.0
HEALTH_TIMEOUT = 2.0
METRICS_TIMEOUT = 5.0
MAX_ANSWER_BYTES = 4 * 1024 * 1024
CLOSE_TIMEOUT = 2.0
# A link must look stalled on this many polls in a row: a snapshot taken right after llama-server sent a
# request on a link that was idle shows unacked data and an old lastack for one round trip.
STALL_CONFIRM_POLLS = 2
RETRY_AFTER = {"loading": 10, "down": 15, "busy": 1}

SERVING = "serving"
LOADING = "loading"
DOWN = "down"
STATES = (SERVING, LOADING, DOWN)
ACTION_NONE = "none"
ACTION_RESTART = "restart"

# The gate's own metrics, answered by the gate in every state (with the API key when one is set).
GATE_METRICS_PATH = "/llamafleet/metrics"
# /metrics counters that move whenever llama-server makes progress (n_decode_total: every llama_decode call).
PROGRESS_COUNTERS = ("llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total", "llamacpp:n_decode_total")
CANARY_BODY = {"prompt": "ping", "n_predict": 1, "cache_prompt": False}
LOG_PREFIX = "llamafleet-gate: "
NOT_RUNNING = "llama-server is not running (restarting)"
STARTING = "the gate is starting"

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 408: "Request Timeout", 411: "Length Required", 500: "Internal Server Error",
            501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 408: "invalid_request_error", 411: "invalid_request_error",
                501: "not_supported_error", 502: "server_error", 503: "unavailable_error", 504: "timeout_error"}
# Hop-by-hop headers (RFC 9110 7.6.1) the gate replaces; Expect is answered by the gate itself.
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"))
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_REQUEST_LINE = re.compile(r"^([!#$%&'*+.^_`|~0-9A-Za-z-]+) (\S+) HTTP/(1\.[01])$")
_STATUS_LINE = re.compile(r"^HTTP/(1\.[01]) ([0-9]{3})(?: (.*))?$")
LAST_CHUNK = b"0\r\n\r\n"


# ---------------------------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Worker:
    """One rpc-server endpoint llama-server connects to."""

    host: str
    address: str
    port: int


@dataclass(frozen=True)
class Degrade:
    """Degraded mode: ``plans`` maps each worker host to the name of the plan without it (None: the model does
    not fit without it, ``reasons`` says why). After ``after`` seconds down with one worker host not answering
    HELLO (``probe`` + ``--timeout S HOST:PORT``), the gate writes ``{"plan": NAME}`` to ``request_file``; once
    the host has answered ``return_probes`` probes in a row, ``{"plan": "full"}``."""

    plans: dict[str, str | None]
    reasons: dict[str, str]
    request_file: str
    probe: tuple[str, ...]
    after: float = DEFAULT_DEGRADE_AFTER
    probe_interval: float = DEFAULT_DEGRADE_PROBE_INTERVAL
    return_probes: int = DEFAULT_RETURN_PROBES


@dataclass(frozen=True)
class Config:
    """The gate's validated configuration (see load_config)."""

    listen_port: int
    upstream_port: int
    unit: str
    workers: tuple[Worker, ...]
    listen_host: str = DEFAULT_LISTEN_HOST
    upstream_host: str = DEFAULT_UPSTREAM_HOST
    api_key_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    deadline: float = DEFAULT_DEADLINE
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    stall_seconds: float = DEFAULT_STALL_SECONDS
    restart_after: float = DEFAULT_RESTART_AFTER
    poll_interval: float = DEFAULT_POLL_INTERVAL
    canary_interval: float = DEFAULT_CANARY_INTERVAL
    canary_deadline: float = DEFAULT_CANARY_DEADLINE
    restart_grace: float = DEFAULT_RESTART_GRACE
    # where the gate writes its state (JSON); none without one (the role names constants.GATE_STATE_PATH)
    state_file: str | None = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    degrade: Degrade | None = None


_NUMBER_KEYS = ("deadline", "request_timeout", "stall_seconds", "restart_after", "poll_interval", "canary_interval", "canary_deadline",
                "restart_grace")
_OPTIONAL_PATH_KEYS = ("api_key_file", "tls_cert", "tls_key")
_KNOWN_KEYS = frozenset(("listen_host", "listen_port", "upstream_host", "upstream_port", "unit", "workers",
                         "state_file", "max_connections", "degrade") + _NUMBER_KEYS + _OPTIONAL_PATH_KEYS)


def _port(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError("gate config: %s must be a port number (1-65535), got %r" % (key, value))
    return value


def _text(raw: dict[str, Any], key: str, default: str | None) -> str | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("gate config: %s must be a non-empty string, got %r" % (key, value))
    return value


def _seconds(raw: dict[str, Any], keys: tuple[str, ...], defaults: type, prefix: str = "") -> dict[str, float]:
    """``keys`` of ``raw`` as seconds > 0 (missing: the dataclass ``defaults``' own value)."""
    numbers = {}
    for key in keys:
        value = raw.get(key, getattr(defaults, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError("gate config: %s%s must be a number of seconds > 0, got %r" % (prefix, key, value))
        numbers[key] = float(value)
    return numbers


def _count(raw: dict[str, Any], key: str, default: int, prefix: str = "") -> int:
    """``key`` of ``raw`` as an integer >= 1 (missing: ``default``)."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("gate config: %s%s must be an integer >= 1, got %r" % (prefix, key, value))
    return value


def plan_workers(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gate config's ``workers`` from a split plan's devices: each remote RPC endpoint once, in the
    plan's order, as {host, address, port} (``[v6]:port`` endpoints unbracketed)."""
    workers: list[dict[str, Any]] = []
    for device in devices:
        endpoint = device.get("endpoint")
        if device.get("local") or not endpoint or any(w["endpoint"] == endpoint for w in workers):
            continue
        address, _sep, port = endpoint.rpartition(":")
        workers.append({"host": device["host"], "endpoint": endpoint, "address": address.strip("[]"),
                        "port": int(port)})
    return workers


def degrade_plans(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The gate config's ``degrade`` plans and reasons from rpc_plan's ``degraded`` entries: each worker host ->
    the name of the plan without it, or None when the model does not fit without it."""
    return {"plans": {entry["without"]: entry["name"] if entry["fits"] else None for entry in entries},
            "reasons": {entry["without"]: entry["reason"] for entry in entries}}


def _workers(value: Any) -> tuple[Worker, ...]:
    if not isinstance(value, list):
        raise ValueError("gate config: workers must be a list of {host, address, port}, got %r" % (value,))
    workers = []
    for index, item in enumerate(value):
        where = "workers[%d]" % index
        if not isinstance(item, dict):
            raise ValueError("gate config: %s must be a mapping with host, address and port" % where)
        for key in ("host", "address"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise ValueError("gate config: %s.%s must be a non-empty string, got %r" % (where, key, item.get(key)))
        port = item.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError("gate config: %s.port must be a port number (1-65535), got %r" % (where, port))
        workers.append(Worker(item["host"], normalize_address(item["address"]), port))
    return tuple(workers)


def _degrade(value: Any, hosts: list[str]) -> Degrade | None:
    """``degrade``: null (off) or {plans: {host: name|null}, reasons: {host: text}, request_file, probe: [argv],
    after, probe_interval, return_probes}; every worker host needs an entry in plans (a host that holds no
    layer in the full plan may have one too)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("gate config: degrade must be null or a mapping, got %r" % (value,))
    unknown = sorted(set(value) - {"plans", "reasons", "request_file", "probe", "after", "probe_interval",
                                   "return_probes"})
    if unknown:
        raise ValueError("gate config: unknown key degrade.%s" % ", degrade.".join(unknown))
    plans = value.get("plans")
    if not isinstance(plans, dict) or not set(hosts) <= set(plans):
        raise ValueError("gate config: degrade.plans must name a plan (or null) for each worker host (%s), got %r"
                         % (", ".join(sorted(set(hosts))), plans))
    for host, name in plans.items():
        if name is not None and (not isinstance(name, str) or not _PLAN_NAME.match(name) or name == FULL_PLAN):
            raise ValueError("gate config: degrade.plans.%s must be a plan file name or null, got %r" % (host, name))
    reasons = value.get("reasons", {})
    if not isinstance(reasons, dict) or not all(isinstance(text, str) for text in reasons.values()):
        raise ValueError("gate config: degrade.reasons must map hosts to text, got %r" % (reasons,))
    probe = value.get("probe")
    if not isinstance(probe, list) or not probe or not all(isinstance(word, str) and word for word in probe):
        raise ValueError("gate config: degrade.probe must be a command (a list of words), got %r" % (probe,))
    numbers = _seconds(value, ("after", "probe_interval"), Degrade, "degrade.")
    return_probes = _count(value, "return_probes", DEFAULT_RETURN_PROBES, "degrade.")
    request_file = _text(value, "request_file", None)
    if request_file is None:
        raise ValueError("gate config: degrade.request_file is required")
    return Degrade(dict(plans), dict(reasons), request_file, tuple(probe), return_probes=return_probes, **numbers)


def load_config(raw: dict[str, Any]) -> Config:
    """Validate the decoded JSON config; a ValueError names the offending key."""
    if not isinstance(raw, dict):
        raise ValueError("gate config: expected a JSON object")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise ValueError("gate config: unknown key %s" % ", ".join(unknown))
    for key in ("listen_port", "upstream_port", "unit", "workers"):
        if key not in raw:
            raise ValueError("gate config: %s is required" % key)
    numbers = _seconds(raw, _NUMBER_KEYS, Config)
    max_connections = _count(raw, "max_connections", DEFAULT_MAX_CONNECTIONS)
    # an empty path means none (the role writes every key)
    paths = {key: _text(raw, key, None) if raw.get(key) != "" else None for key in _OPTIONAL_PATH_KEYS}
    if (paths["tls_cert"] is None) != (paths["tls_key"] is None):
        raise ValueError("gate config: tls_cert and tls_key go together (%s is missing)"
                         % ("tls_key" if paths["tls_key"] is None else "tls_cert"))
    workers = _workers(raw["workers"])
    return Config(
        listen_port=_port(raw, "listen_port"), upstream_port=_port(raw, "upstream_port"),
        unit=str(_text(raw, "unit", None)), workers=workers,
        degrade=_degrade(raw.get("degrade"), [worker.host for worker in workers]),
        listen_host=str(_text(raw, "listen_host", DEFAULT_LISTEN_HOST)),
        upstream_host=str(_text(raw, "upstream_host", DEFAULT_UPSTREAM_HOST)),
        state_file=_text(raw, "state_file", None), max_connections=max_connections,
        **paths, **numbers)


# ---------------------------------------------------------------------------------------------------------------------
# HTTP heads, error answers, chunked framing


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
    return RequestHead(match.group(1), match.group(2), match.group(3), _parse_headers(lines[1:], 400))


def parse_response_head(head: bytes) -> ResponseHead:
    """Parse a response head from llama-server; HeadError(502) on garbage."""
    lines = _split_head(head, 502)
    match = _STATUS_LINE.match(lines[0])
    if not match:
        raise HeadError(502, "malformed status line %r" % lines[0][:80])
    return ResponseHead(match.group(1), int(match.group(2)), match.group(3) or "", _parse_headers(lines[1:], 502))


def request_body(req: RequestHead) -> tuple[str, int]:
    """How the request body is framed: ("none", 0), ("length", N) or ("chunked", 0); HeadError otherwise."""
    encodings = req.codings()
    lengths = {value.strip() for value in req.get("content-length")}
    if encodings:
        if lengths:
            raise HeadError(400, "both Content-Length and Transfer-Encoding")
        if encodings != ["chunked"]:
            raise HeadError(411, "unsupported Transfer-Encoding %s (send chunked or a Content-Length)"
                            % ", ".join(encodings))
        return "chunked", 0
    if not lengths:
        return "none", 0
    if len(lengths) > 1 or not lengths.pop().isdigit():
        raise HeadError(400, "invalid Content-Length")
    length = int(req.get("content-length")[0].strip())
    return ("length", length) if length else ("none", 0)


def wants_continue(req: RequestHead) -> bool:
    """True when the client waits for ``100 Continue`` before it sends the body."""
    return any(value.strip().lower() == "100-continue" for value in req.get("expect"))


def _without_hop_by_hop(headers: list[tuple[str, str]], extra: frozenset[str]) -> list[tuple[str, str]]:
    named = {token.strip().lower() for key, value in headers if key.lower() == "connection"
             for token in value.split(",") if token.strip()}
    drop = _HOP_BY_HOP | extra | (named - {"content-length", "transfer-encoding", "authorization", "host"})
    return [(key, value) for key, value in headers if key.lower() not in drop]


def upstream_request_head(req: RequestHead) -> bytes:
    """The head sent to llama-server: hop-by-hop headers (Connection, Keep-Alive, Expect, ...) replaced by
    ``Connection: close``; every other header, Authorization included, unchanged."""
    headers = _without_hop_by_hop(req.headers, frozenset()) + [("Connection", "close")]
    lines = ["%s %s HTTP/%s" % (req.method, req.target, req.version)] + ["%s: %s" % item for item in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def client_response_head(resp: ResponseHead) -> bytes:
    """The response head relayed to the client: Connection/Keep-Alive replaced by ``Connection: close``."""
    headers = _without_hop_by_hop(resp.headers, frozenset()) + [("Connection", "close")]
    status_line = "HTTP/%s %d %s" % (resp.version, resp.status, resp.reason)
    return ("\r\n".join([status_line.rstrip(" ")] + ["%s: %s" % item for item in headers]) + "\r\n\r\n").encode(
        "latin-1")


def response_body(method: str, resp: ResponseHead) -> tuple[str, int]:
    """How the response body is framed: ("none", 0), ("length", N), ("chunked", 0) or ("close", 0)."""
    if method == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200:
        return "none", 0
    encodings = resp.codings()
    if encodings:
        return ("chunked", 0) if encodings[-1] == "chunked" else ("close", 0)
    lengths = [value.strip() for value in resp.get("content-length")]
    if lengths and lengths[0].isdigit():
        return "length", int(lengths[0])
    return "close", 0


def is_event_stream(resp: ResponseHead) -> bool:
    """True for a streaming (``text/event-stream``) response."""
    return any(value.split(";")[0].strip().lower() == "text/event-stream" for value in resp.get("content-type"))


def error_object(code: int, message: str) -> dict[str, Any]:
    """The error in llama-server's shape: ``{"error": {"code", "type", "message"}}``."""
    return {"error": {"code": code, "type": _ERROR_TYPES.get(code, "server_error"),
                      "message": "llamafleet: %s" % message}}


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


def retry_after(state: str) -> int:
    """The Retry-After seconds for a 503 in ``state``."""
    return RETRY_AFTER.get(state, RETRY_AFTER[DOWN])


def admission(state: str, req: RequestHead) -> bool:
    """True when a request goes to llama-server in ``state``: serving or loading, all (while loading,
    llama-server answers 503 "Loading model" itself, and serves the moment it is ready, without waiting
    for the gate's next poll); down, none (``req`` is kept for rules by path)."""
    return state in (SERVING, LOADING)


# ---------------------------------------------------------------------------------------------------------------------
# Prometheus text exposition: the gate's own metrics, and the workers' (rpc_metrics.py)

Sample = tuple[str, Mapping[str, str], float]

# name: (type, help) of the gate's metrics, in the order it lists them.
GATE_METRICS: dict[str, tuple[str, str]] = {
    "llamafleet_gate_state": (
        "gauge", "1 for the cluster state the gate enforces now (label state: serving, loading or down), else 0."),
    "llamafleet_gate_state_since_seconds": ("gauge", "Unix time the gate entered its current state."),
    "llamafleet_gate_requests_total": ("counter", "Client requests the gate read (its own metrics excluded)."),
    "llamafleet_gate_rejected_total": ("counter", "Client requests the gate answered 503 itself."),
    "llamafleet_gate_aborted_total": ("counter", "Requests in flight the gate ended because the cluster went down."),
    "llamafleet_gate_in_flight": ("gauge", "Requests relayed to llama-server now."),
    "llamafleet_gate_restarts_total": (
        "counter", "llama-server restarts the watchdog made (SIGKILL when stuck or stalled; systemd starts it again)."),
    "llamafleet_gate_degraded": (
        "gauge", "1 while llama-server runs a plan without a lost worker host (llama_server_degrade), else 0."),
    "llamafleet_llama_server_load_seconds": (
        "gauge", "Seconds the last model load took: from llama-server's start (systemd's ExecMainStartTimestamp) to "
                 "its first /health 200, as the gate's poll saw it. Absent until the gate saw a load end."),
    "llamafleet_llama_server_ready_since_seconds": (
        "gauge", "Unix time llama-server's last load ended (its first /health 200)."),
    "llamafleet_llama_server_loads_total": ("counter", "Model loads the gate saw end since it started."),
}


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as the text format writes it (integers without a fraction)."""
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return "%d" % number if number.is_integer() and abs(number) < 2 ** 53 else repr(number)


def render_exposition(metrics: Mapping[str, tuple[str, str]], samples: Sequence[Sample]) -> str:
    """Prometheus text exposition of ``samples``: each metric of ``metrics`` (name: (type, help)) that has
    samples, in that order, with its HELP and TYPE lines and its samples sorted by labels. A sample of a name
    not in ``metrics`` is a ValueError."""
    unknown = sorted({name for name, _labels, _value in samples} - set(metrics))
    if unknown:
        raise ValueError("unknown metric(s): %s" % ", ".join(unknown))
    lines = []
    for name, (kind, text) in metrics.items():
        rows = sorted((sorted(labels.items()), value) for metric, labels, value in samples if metric == name)
        if not rows:
            continue
        lines += ["# HELP %s %s" % (name, text.replace("\\", "\\\\").replace("\n", "\\n")),
                  "# TYPE %s %s" % (name, kind)]
        for labels, value in rows:
            label_text = ",".join('%s="%s"' % (key, _escape_label(str(val))) for key, val in labels)
            lines.append("%s%s %s" % (name, "{%s}" % label_text if label_text else "", format_value(value)))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class LoadClock:
    """What the gate knows of llama-server's model loads: the process it watches (``pid``, and when systemd
    started it, monotonic seconds), whether its load has ended, and the last load that did."""

    pid: int = 0
    started: float | None = None
    ready: bool = False
    last_seconds: float | None = None
    ready_at: float | None = None  # Unix time
    loads: int = 0


def track_load(clock: LoadClock, pid: int, started: float | None, health: int | str | None, now: float,
               wall: float) -> LoadClock:
    """One poll: a new ``pid`` begins a load (``started``: systemd's start of it, monotonic seconds; unknown:
    ``now``); its first /health 200 ends it, and the load took ``now - started``. ``pid`` 0 (not running)
    forgets the process, so a restart of the same pid number is a new load too."""
    if pid <= 0:
        return LoadClock(last_seconds=clock.last_seconds, ready_at=clock.ready_at, loads=clock.loads)
    if pid != clock.pid:
        clock = LoadClock(pid, started if started is not None else now, False, clock.last_seconds, clock.ready_at,
                          clock.loads)
    if health == 200 and not clock.ready:
        begun = clock.started if clock.started is not None else now
        return LoadClock(pid, clock.started, True, max(0.0, now - begun), wall, clock.loads + 1)
    return clock


def gate_samples(state: str, since: float, counters: Mapping[str, int], in_flight: int, restarts: int,
                 degraded: bool | None, load: LoadClock) -> list[Sample]:
    """The gate's metrics (:data:`GATE_METRICS`) from its state; ``degraded`` None: degraded mode is off."""
    samples: list[Sample] = [("llamafleet_gate_state", {"state": name}, 1 if name == state else 0) for name in STATES]
    samples += [("llamafleet_gate_state_since_seconds", {}, since),
                ("llamafleet_gate_requests_total", {}, counters.get("requests", 0)),
                ("llamafleet_gate_rejected_total", {}, counters.get("rejected_503", 0)),
                ("llamafleet_gate_aborted_total", {}, counters.get("aborted", 0)),
                ("llamafleet_gate_in_flight", {}, in_flight),
                ("llamafleet_gate_restarts_total", {}, restarts),
                ("llamafleet_llama_server_loads_total", {}, load.loads)]
    if degraded is not None:
        samples.append(("llamafleet_gate_degraded", {}, 1 if degraded else 0))
    if load.last_seconds is not None:
        samples.append(("llamafleet_llama_server_load_seconds", {}, round(load.last_seconds, 3)))
    if load.ready_at is not None:
        samples.append(("llamafleet_llama_server_ready_since_seconds", {}, round(load.ready_at, 3)))
    return samples


def bearer_ok(req: RequestHead, key: str | None) -> bool:
    """True when no key is set, or ``req`` carries ``Authorization: Bearer <key>`` (compared in constant time)."""
    if not key:
        return True
    expected = ("Bearer %s" % key).encode("utf-8")
    return any(hmac.compare_digest(value.strip().encode("utf-8"), expected) for value in req.get("authorization"))


def metrics_response(req: RequestHead, key: str | None, text: str) -> bytes:
    """The answer to ``GET``/``HEAD`` :data:`GATE_METRICS_PATH`: 401 without the API key (when one is set),
    else ``text`` as Prometheus text format."""
    if not bearer_ok(req, key):
        return error_response(401, "the gate's metrics need the API key (Authorization: Bearer)",
                              body=req.method != "HEAD")
    payload = text.encode("utf-8")
    head = ["HTTP/1.1 200 OK", "Content-Type: text/plain; version=0.0.4; charset=utf-8",
            "Content-Length: %d" % len(payload), "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (payload if req.method != "HEAD" else b"")


# ---------------------------------------------------------------------------------------------------------------------
# Observations: ss, systemctl, /metrics


def normalize_address(text: str) -> str:
    """An address as ss prints it, made comparable: brackets, IPv4-mapped IPv6 and ``%iface`` removed."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    text = text.split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text.lower()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _endpoint(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return normalize_address(host), int(port)


def _int(value: str) -> int:
    try:
        return int(float(value))
    except ValueError:
        return 0


def parse_ss(text: str) -> list[dict[str, Any]]:
    """Parse ``ss -tinHO [state established]`` output: one dict per TCP socket.

    Each line is ``[State] Recv-Q Send-Q Local:Port Peer:Port`` then tcp_info as ``key:value``
    words (ss leaves out the state column when a state filter is given, and leaves out
    ``unacked``, ``retrans``, ``backoff`` and the ``last*`` timers when they are zero).
    Keys: state, recv_q, send_q, local, peer ((address, port)), unacked (segments),
    lastsnd_ms, lastrcv_ms, lastack_ms, retrans ((outstanding, total)), rto_ms, backoff.
    Lines that do not parse are skipped.
    """
    conns = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 4:
            continue
        state = "ESTAB"
        if not words[0].isdigit():
            state = words.pop(0)
        if len(words) < 4 or not words[0].isdigit() or not words[1].isdigit():
            continue
        local, peer = _endpoint(words[2]), _endpoint(words[3])
        if local is None or peer is None:
            continue
        info: dict[str, str] = {}
        for word in words[4:]:
            key, sep, value = word.partition(":")
            if sep and key.isidentifier() and key not in info:
                info[key] = value
        current, _sep, total = info.get("retrans", "0/0").partition("/")
        conns.append({
            "state": state, "recv_q": int(words[0]), "send_q": int(words[1]), "local": local, "peer": peer,
            "unacked": _int(info.get("unacked", "0")), "lastsnd_ms": _int(info.get("lastsnd", "0")),
            "lastrcv_ms": _int(info.get("lastrcv", "0")), "lastack_ms": _int(info.get("lastack", "0")),
            "retrans": (_int(current), _int(total or "0")), "rto_ms": _int(info.get("rto", "0")),
            "backoff": _int(info.get("backoff", "0")),
        })
    return conns


def rpc_endpoints(cmdline: bytes) -> list[tuple[str, int]]:
    """The ``--rpc HOST:PORT,...`` endpoints of a llama-server command line (``/proc/PID/cmdline``:
    NUL-separated words), in order; [] when it has none."""
    words = [w.decode("utf-8", "replace") for w in cmdline.split(b"\0")]
    value = None
    for i, word in enumerate(words):
        if word == "--rpc" and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith("--rpc="):
            value = word[len("--rpc="):]
    endpoints = []
    for item in (value or "").split(","):
        found = _endpoint(item.strip())
        if found is not None:
            endpoints.append(found)
    return endpoints


def running_workers(configured: tuple[Worker, ...], endpoints: list[tuple[str, int]] | None) -> tuple[Worker, ...]:
    """The workers llama-server really connects to: its ``--rpc`` endpoints, named as the config names
    them (an endpoint the config does not know, such as a benchmark's proxy, is named by itself).
    ``endpoints`` None (the command line could not be read): the configured workers."""
    if endpoints is None:
        return configured
    names = {(w.address, w.port): w.host for w in configured}
    return tuple(Worker(names.get((normalize_address(a), p), "%s:%d" % (a, p)), normalize_address(a), p)
                 for a, p in endpoints)


def link_names(workers: tuple[Worker, ...] | list[Worker]) -> list[str]:
    """The name each worker's link goes by: its host, or ``host:port`` where a host has several
    endpoints (one rpc-server per device), so each is watched on its own."""
    hosts = [worker.host for worker in workers]
    return [w.host if hosts.count(w.host) == 1 else "%s:%d" % (w.host, w.port) for w in workers]


def link_stalled(conn: dict[str, Any], stall_seconds: float) -> bool:
    """Data sent on the link and no ACK from the worker for ``stall_seconds``."""
    return conn["unacked"] > 0 and conn["lastack_ms"] >= stall_seconds * 1000


def awaiting_ms(conn: dict[str, Any]) -> int:
    """How long the link has carried no data either way with nothing unacknowledged (0 while data is
    unacknowledged: link_stalled's case). llama-server waiting for an answer, or for the rest of one,
    a worker computing, an idle link and a worker cut off all look the same here; only a liveness probe
    of the worker's host tells the lost one apart. (Waiting only where the last data went out after the
    last data came in missed a partition that began in the middle of an answer: seen in CI.)"""
    if conn["unacked"] > 0:
        return 0
    return min(conn["lastsnd_ms"], conn["lastrcv_ms"])


def worker_links(conns: list[dict[str, Any]], workers: tuple[Worker, ...] | list[Worker],
                 stall_seconds: float = DEFAULT_STALL_SECONDS,
                 unreachable: frozenset[str] | set[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """Each worker's link from llama-server, from ``parse_ss`` output.

    Only connections whose peer is the worker's address:port count (the orchestrator's own
    rpc-server, if any, has the worker as its local end). ``link`` is "stalled" when any of them
    has data unacknowledged for ``stall_seconds``, or has waited that long for an answer while the
    worker's host (named in ``unreachable``) does not answer a liveness probe; "ok" when one is
    established, "lost" when none is. ``silent_ms``: how long the stalled link has had nothing from
    the worker (no ACK, or no answer); ``awaiting_ms``: see :func:`awaiting_ms`.
    """
    links = {}
    for worker, name in zip(workers, link_names(workers)):
        key = (normalize_address(worker.address), worker.port)
        mine = [conn for conn in conns if conn["peer"] == key and conn["state"].upper().startswith("ESTAB")]
        stalled = [(conn, conn["lastack_ms"]) for conn in mine if link_stalled(conn, stall_seconds)]
        if name in unreachable:
            stalled += [(conn, awaiting_ms(conn)) for conn in mine if awaiting_ms(conn) >= stall_seconds * 1000]
        worst, silent = max(stalled, key=lambda item: (item[1], item[0]["unacked"]), default=(None, 0))
        if worst is None:
            worst = max(mine, key=lambda conn: (conn["unacked"], conn["lastack_ms"]), default=None)
        links[name] = {
            "address": worker.address, "port": worker.port,
            "link": "stalled" if stalled else ("ok" if mine else "lost"),
            "unacked": worst["unacked"] if worst else 0, "lastack_ms": worst["lastack_ms"] if worst else None,
            "send_q": worst["send_q"] if worst else 0, "retrans": list(worst["retrans"]) if worst else [0, 0],
            "silent_ms": silent, "awaiting_ms": max((awaiting_ms(conn) for conn in mine), default=0),
        }
    return links


def awaiting_workers(links: dict[str, dict[str, Any]] | None, stall_seconds: float) -> list[str]:
    """The links that have waited ``stall_seconds`` or more for an answer (their hosts get probed)."""
    return sorted(name for name, info in (links or {}).items() if info["awaiting_ms"] >= stall_seconds * 1000)


# ICMP echo. The gate pings from an unprivileged datagram socket (Linux: the group must be in
# net.ipv4.ping_group_range; the kernel sets the identifier and the checksum). The link_rtt module pings from a
# raw socket as root and builds and reads the same packets (with its own identifier, the IP header first).
ICMP_ECHO = {False: (8, 0), True: (128, 129)}  # ipv6 -> (request type, reply type)
ECHO_PAYLOAD = b"llamafleet-gate"


def icmp_checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(seq: int, ipv6: bool = False, ident: int = 0) -> bytes:
    """An ICMP(v6) echo request: IPv4 with its checksum (a raw socket sends it as it is); ICMPv6's checksum and a
    datagram socket's identifier are the kernel's."""
    kind, _reply = ICMP_ECHO[ipv6]
    header = struct.pack("!BBHHH", kind, 0, 0, ident & 0xFFFF, seq & 0xFFFF)
    if not ipv6:
        header = header[:2] + struct.pack("!H", icmp_checksum(header + ECHO_PAYLOAD)) + header[4:]
    return header + ECHO_PAYLOAD


def echo_reply_of(packet: bytes, ipv6: bool = False, with_ip_header: bool = False) -> tuple[int, int] | None:
    """(identifier, sequence) of an echo reply as a socket returns it (a raw IPv4 socket: the IP header first),
    None for anything else."""
    if with_ip_header:
        if not packet:
            return None
        packet = packet[(packet[0] & 0x0F) * 4:]
    _kind, reply = ICMP_ECHO[ipv6]
    if len(packet) < 8 or packet[0] != reply or packet[1] != 0:
        return None
    ident, seq = struct.unpack("!HH", packet[4:8])
    return ident, seq


def is_echo_reply(data: bytes, seq: int, ipv6: bool = False) -> bool:
    """True when ``data`` (as a datagram ICMP socket returns it, no IP header) is the reply to ``seq``."""
    got = echo_reply_of(data, ipv6)
    return got is not None and got[1] == seq & 0xFFFF


def count_stalls(previous: dict[str, int], links: dict[str, dict[str, Any]] | None) -> dict[str, int]:
    """Polls in a row each worker's link has looked stalled (all zero when the links are unknown)."""
    if links is None:
        return {}
    return {host: previous.get(host, 0) + 1 if info["link"] == "stalled" else 0 for host, info in links.items()}


def systemctl_show_argv(unit: str) -> list[str]:
    """The command whose output parse_systemctl_show reads (the gate's watchdog and the guard use it)."""
    return show_argv(unit, ("MainPID", "ActiveState", "ExecMainStartTimestampMonotonic"))


# ss commands: the gate reads tcp_info of established links; the guard reads listeners and established peers.
SS_LINKS = ["ss", "-tinHO", "state", "established"]
SS_LISTENERS = ["ss", "-ltnH"]
SS_ESTABLISHED = ["ss", "-tnH", "state", "established"]


def parse_systemctl_show(text: str) -> tuple[str, int]:
    """``systemctl show`` of MainPID and ActiveState (:func:`systemctl_show_argv`) -> (active state, main pid)."""
    values = parse_show(text)
    pid = values.get("MainPID", "0").strip()
    return values.get("ActiveState", "unknown").strip() or "unknown", int(pid) if pid.isdigit() else 0


def main_start(text: str) -> float | None:
    """When systemd started the unit's main process (``ExecMainStartTimestampMonotonic``, microseconds of
    CLOCK_MONOTONIC, as time.monotonic() counts) in seconds; None when not shown or 0."""
    raw = parse_show(text).get("ExecMainStartTimestampMonotonic", "").strip()
    return int(raw) / 1e6 if raw.isdigit() and int(raw) > 0 else None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name: value} (labels kept in the name, comments skipped)."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _sep, rest = line.rpartition(" ")
        try:
            values[name.strip()] = float(rest)
        except ValueError:
            continue
    return values


def made_progress(before: dict[str, float] | None, after: dict[str, float] | None) -> bool | None:
    """True when a progress counter moved between two /metrics reads, None when either read failed
    or they share no progress counter."""
    if before is None or after is None:
        return None
    common = [name for name in PROGRESS_COUNTERS if name in before and name in after]
    if not common:
        return None
    return any(before[name] != after[name] for name in common)


def left_out(configured: tuple[Worker, ...], running: tuple[Worker, ...]) -> str | None:
    """The worker host a degraded llama-server runs without (its --rpc lacks every endpoint of that host),
    None when it runs the full plan (or lacks more than one host, which no plan of the gate does)."""
    missing = sorted({w.host for w in configured} - {w.host for w in running})
    return missing[0] if len(missing) == 1 else None


def degrade_choice(deg: Degrade, answered: dict[str, bool]) -> tuple[str | None, str]:
    """The plan to ask for when the workers' hosts answered HELLO as in ``answered`` (host -> bool), with the
    reason to log: one host silent and a plan without it -> that plan; otherwise None and why not ("" when
    every host answers)."""
    silent = sorted(host for host, ok in answered.items() if not ok)
    if not silent:
        return None, ""
    if len(silent) > 1:
        return None, "not serving degraded: %d worker hosts do not answer HELLO (%s), and a degraded plan leaves " \
                     "out one" % (len(silent), ", ".join(silent))
    host = silent[0]
    name = deg.plans.get(host)
    if name is None:
        return None, "not serving degraded without %s: %s" % (host, deg.reasons.get(host, "no plan without it"))
    return name, "worker %s does not answer HELLO: serving degraded without it (plan %s)" % (host, name)


# ---------------------------------------------------------------------------------------------------------------------
# The decision


@dataclass(frozen=True)
class CanaryOutcome:
    """A finished canary: ``missed`` its deadline; ``progress`` from /metrics (None: unknown)."""

    pid: int
    ok: bool
    missed: bool
    progress: bool | None = None
    elapsed: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class Observation:
    """One poll's view. ``active_state`` None: systemctl gave no answer. ``health``: the HTTP status,
    "timeout", "refused" or None (not asked). ``links`` None: ss gave no answer."""

    now: float
    active_state: str | None
    main_pid: int
    health: int | str | None
    links: dict[str, dict[str, Any]] | None
    stall_polls: dict[str, int] = field(default_factory=dict)
    canary: CanaryOutcome | None = None


@dataclass
class Memory:
    """What decide needs from earlier polls (the watchdog updates it with remember)."""

    state: str = DOWN
    reason: str = STARTING
    restart_at: float | None = None  # the last restart action, until llama-server serves again
    restart_pid: int = 0
    seen_pid: int = 0
    seen_links: frozenset[str] = frozenset()  # workers seen connected by seen_pid


@dataclass(frozen=True)
class Decision:
    """decide's answer: the new state and reason, and "none" or "restart"."""

    state: str
    reason: str
    action: str = ACTION_NONE


def _stall_reason(host: str, info: dict[str, Any]) -> str:
    if not info["unacked"]:
        return ("worker %s (%s:%d) has not answered llama-server's request for %.1f s and its host does not "
                "answer ping" % (host, info["address"], info["port"], info["silent_ms"] / 1000.0))
    return ("worker %s (%s:%d) stopped acknowledging: %d bytes unsent or unacked (%d segments in flight, "
            "%d retransmitted), no ACK for %.1f s"
            % (host, info["address"], info["port"], info["send_q"], info["unacked"], info["retrans"][1],
               info["silent_ms"] / 1000.0))


def _restart_allowed(obs: Observation, mem: Memory, cfg: Config) -> bool:
    if mem.restart_at is None:
        return obs.main_pid > 0
    return obs.main_pid > 0 and obs.now - mem.restart_at >= cfg.restart_grace and obs.main_pid != mem.restart_pid


def _fault(obs: Observation, mem: Memory, cfg: Config, reason: str) -> Decision:
    """Down because of a fault that a restart cures: restart unless one is under way."""
    if mem.restart_at is not None and not _restart_allowed(obs, mem, cfg):
        return Decision(DOWN, mem.reason)
    if not _restart_allowed(obs, mem, cfg):
        return Decision(DOWN, reason)
    return Decision(DOWN, "%s; restarting llama-server (pid %d)" % (reason, obs.main_pid), ACTION_RESTART)


def decide(obs: Observation, mem: Memory, cfg: Config) -> Decision:
    """The cluster state after one poll, and whether to restart llama-server.

    - systemctl gave no answer: nothing changes;
    - the unit is not active or has no MainPID: down;
    - a worker link stalled on STALL_CONFIRM_POLLS polls in a row: down; restart once nothing came
      for ``restart_after`` seconds (a link that heals before then serves again without a reload);
    - /health 503: loading; timeout: nothing changes; refused: loading (starting); other: down;
    - /health 200: serving when every worker has an established link; a worker llama-server was
      connected to and is no more: down, restart; one never seen connected: down (check the address);
    - a canary of this llama-server missed its deadline with no progress in /metrics: down, restart.
    After a restart action none follows for ``restart_grace`` seconds and until MainPID changes, and
    the state stays down with the restart's reason until llama-server serves again.
    """
    sticky = mem.restart_at is not None
    if obs.active_state is None:
        if mem.reason == STARTING:
            return Decision(DOWN, "cannot read the state of %s (systemctl show gave no answer)" % cfg.unit)
        return Decision(mem.state, mem.reason)
    if obs.active_state != "active" or obs.main_pid <= 0:
        if sticky:
            return Decision(DOWN, mem.reason)
        return Decision(DOWN, "llama-server is %s (waiting for workers or restarting)" % obs.active_state)
    for host, count in sorted(obs.stall_polls.items()):
        if count >= STALL_CONFIRM_POLLS and obs.links and obs.links.get(host, {}).get("link") == "stalled":
            info = obs.links[host]
            if info["silent_ms"] >= cfg.restart_after * 1000:
                return _fault(obs, mem, cfg, _stall_reason(host, info))
            if sticky:
                return Decision(DOWN, mem.reason)
            return Decision(DOWN, "%s; llama-server is restarted if it lasts %g s"
                            % (_stall_reason(host, info), cfg.restart_after))
    canary = obs.canary
    if canary is not None and canary.missed and not canary.progress and canary.pid == obs.main_pid:
        return _fault(obs, mem, cfg, "canary completion got no answer in %.0f s and no token was produced"
                      % cfg.canary_deadline)
    health = obs.health
    if health == "timeout":
        return Decision(mem.state, mem.reason)
    if health == 503 or health == "refused":
        if sticky:
            return Decision(DOWN, mem.reason)
        return Decision(LOADING, "llama-server is loading the model" if health == 503 else "llama-server is starting")
    if health != 200:
        return Decision(DOWN, mem.reason if sticky else "llama-server /health answered %s" % health)
    lost = sorted(host for host, info in (obs.links or {}).items() if info["link"] == "lost")
    if lost:
        seen = [host for host in lost if host in mem.seen_links and mem.seen_pid == obs.main_pid]
        if seen:
            info = obs.links[seen[0]]  # type: ignore[index]
            return _fault(obs, mem, cfg, "worker %s (%s:%d) lost its connection from llama-server"
                          % (seen[0], info["address"], info["port"]))
        if sticky:
            return Decision(DOWN, mem.reason)
        workers = ", ".join("%s (%s:%d)" % (host, obs.links[host]["address"], obs.links[host]["port"])  # type: ignore
                            for host in lost)
        return Decision(DOWN, "llama-server has no connection to worker %s (check the gate's worker addresses)"
                        % workers)
    return Decision(SERVING, "llama-server is serving")


def remember(mem: Memory, obs: Observation, decision: Decision) -> Memory:
    """The memory after a poll: the state, the restart under way (cleared once serving), the workers seen
    connected by the current llama-server."""
    links = obs.links or {}
    connected = frozenset(host for host, info in links.items() if info["link"] in ("ok", "stalled"))
    if obs.main_pid != mem.seen_pid:
        seen = connected
    else:
        seen = mem.seen_links | connected
    restart_at, restart_pid = mem.restart_at, mem.restart_pid
    if decision.action == ACTION_RESTART:
        restart_at, restart_pid = obs.now, obs.main_pid
    elif decision.state == SERVING:
        restart_at, restart_pid = None, 0
    return Memory(decision.state, decision.reason, restart_at, restart_pid, obs.main_pid or mem.seen_pid, seen)


# ---------------------------------------------------------------------------------------------------------------------
# The proxy


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
        self._flights: set[_Flight] = set()
        self._connections = 0
        # time.monotonic() of the last answer llama-server completed for a client (the canary's proof)
        self.last_answer = float("-inf")
        self._server: asyncio.AbstractServer | None = None
        self._stopping = False
        # the gate's own metrics (GATE_METRICS_PATH) and the API key they need: set by serve() from the watchdog
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
            await self._answer(writer, metrics_response(req, self.metrics_key(), self.metrics_text()))
            return
        self.counters["requests"] += 1
        if not admission(self.state, req):
            self.counters["rejected_503"] += 1
            await self._answer(writer, error_response(503, self.reason, retry_after(self.state),
                                                      body=req.method != "HEAD"))
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.cfg.upstream_host, self.cfg.upstream_port, limit=MAX_HEAD_BYTES),
                self.cfg.deadline)
        except (OSError, asyncio.TimeoutError):
            self.counters["rejected_503"] += 1
            await self._answer(writer, error_response(503, NOT_RUNNING, retry_after(DOWN), body=req.method != "HEAD"))
            return
        flight = _Flight(asyncio.get_running_loop().create_future())
        self._flights.add(flight)
        if not admission(self.state, req):  # the state changed while connecting
            _settle(flight.abort, 503, self.reason)
        pump = None
        try:
            if wants_continue(req) and framing[0] != "none":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            up_writer.write(upstream_request_head(req))
            pump = asyncio.ensure_future(self._pump(reader, up_writer, framing, flight))
            await self._relay(req, up_reader, writer, flight)
        finally:
            self._flights.discard(flight)
            if pump is not None:
                pump.cancel()
            up_writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, framing: tuple[str, int],
                    flight: _Flight) -> None:
        """Send the request body upstream (re-framed when chunked), then watch the client for a hang-up."""
        kind, remaining = framing
        try:
            if kind == "length":
                while remaining:
                    data = await reader.read(min(RELAY_READ_SIZE, remaining))
                    if not data:
                        raise ConnectionResetError("client closed the connection in the request body")
                    remaining -= len(data)
                    await self._send_up(up_writer, data)
            elif kind == "chunked":
                decoder = ChunkDecoder()
                while not decoder.done:
                    data = await reader.read(RELAY_READ_SIZE)
                    if not data:
                        raise ConnectionResetError("client closed the connection in the request body")
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
                except HeadError as exc:
                    raise _Abort(502, "bad answer from llama-server: %s" % exc.message) from None
                buf = buf[end + 4:]
                if 100 <= head.status < 200 and head.status != 101:
                    continue  # an interim answer: the gate already said 100 Continue itself
                resp = head
            mode, length = response_body(req.method, resp)
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


# ---------------------------------------------------------------------------------------------------------------------
# The watchdog


async def run_command(argv: list[str], timeout: float = SUBPROCESS_TIMEOUT) -> str | None:
    """stdout of ``argv`` when it exits 0 within ``timeout``, else None."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                    stderr=subprocess.DEVNULL)
    except OSError:
        return None
    try:
        out, _err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return out.decode("utf-8", "replace") if proc.returncode == 0 else None


async def icmp_echo(address: str, timeout: float = PING_TIMEOUT, seq: int = 1) -> bool | None:
    """Ping ``address`` once: True on a reply within ``timeout``, False on none (or an ICMP error),
    None when this process may not open an ICMP datagram socket (see ping_group_range)."""
    loop = asyncio.get_running_loop()
    try:
        family, _type, _proto, _name, sockaddr = (await loop.getaddrinfo(address, None, type=socket.SOCK_DGRAM))[0]
        ipv6 = family == socket.AF_INET6
        sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6 if ipv6 else socket.IPPROTO_ICMP)
    except OSError:
        return None
    try:
        sock.setblocking(False)
        sock.connect(sockaddr)
        await loop.sock_sendall(sock, echo_request(seq, ipv6))
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            data = await asyncio.wait_for(loop.sock_recv(sock, 2048), deadline - loop.time())
            if is_echo_reply(data, seq, ipv6):
                return True
        return False
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        sock.close()


def ping_group_range(current: str, gid: int) -> tuple[str | None, str]:
    """``net.ipv4.ping_group_range`` that lets group ``gid`` open ICMP datagram sockets (the gate's ping), from
    the ``current`` "LOW HIGH": (None, why) when it already does or may not be changed safely, else (the value,
    what it does). Only an empty range (the kernel's "1 0", Debian 12's default) is changed, to the one group:
    widening a range someone set would let other groups in."""
    try:
        low, high = (int(word) for word in current.split())
    except ValueError:
        return None, "cannot read net.ipv4.ping_group_range %r" % current
    if low <= gid <= high:
        return None, "net.ipv4.ping_group_range %d-%d already lets group %d ping" % (low, high, gid)
    if low > high:
        return "%d %d" % (gid, gid), "net.ipv4.ping_group_range set to group %d alone (it was empty)" % gid
    return None, ("net.ipv4.ping_group_range %d-%d leaves out group %d and was set by someone: left as it is, so the "
                  "gate cannot ping the workers' hosts (a worker lost while llama-server waits for its answer is "
                  "found by the canary only)" % (low, high, gid))


class Pinger:
    """Liveness of the workers' hosts by ICMP echo, trusted only for hosts that have answered before
    (a host whose firewall drops ping must not look dead while it computes)."""

    def __init__(self) -> None:
        self.answers: dict[str, str] = {}  # address -> "ok", "no answer" or "unavailable"
        self.answered: set[str] = set()
        self.last_baseline = float("-inf")
        self.warned = False
        self._seq = 0

    async def ping(self, addresses: list[str]) -> dict[str, bool | None]:
        """Ping each address at once; remember what answered."""
        self._seq = (self._seq + 1) % 65536
        results = await asyncio.gather(*(icmp_echo(address, PING_TIMEOUT, self._seq) for address in addresses))
        for address, result in zip(addresses, results):
            self.answers[address] = {True: "ok", False: "no answer", None: "unavailable"}[result]
            if result:
                self.answered.add(address)
        if None in results and not self.warned:
            self.warned = True
            log("cannot ping the workers' hosts (no ICMP datagram socket: net.ipv4.ping_group_range leaves out "
                "this user's group); a worker lost while llama-server waits for its answer is found by the "
                "canary only")
        return dict(zip(addresses, results))

    async def unreachable(self, addresses: dict[str, str]) -> set[str]:
        """The names (name -> address) whose host answered ping before and does not now (all are pinged, so a
        host that answers now is known from then on)."""
        known_before = set(self.answered)
        results = await self.ping(sorted(set(addresses.values())))
        return {name for name, address in addresses.items()
                if address in known_before and results.get(address) is False}


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


class Watchdog:
    """Polls llama-server's unit, /health and its worker links; runs the canary; restarts when stuck."""

    def __init__(self, gate: Gate, cfg: Config) -> None:
        self.gate = gate
        self.cfg = cfg
        self.memory = Memory()
        self.workers = cfg.workers
        self.stall_polls: dict[str, int] = {}
        self.links: dict[str, dict[str, Any]] | None = None
        self.restarts = 0
        self.last_action: dict[str, Any] | None = None
        self.health_timeouts = 0
        self.main_started: float | None = None  # systemd's start of llama-server's main process (monotonic s)
        self.load = LoadClock()
        self.canary_state: dict[str, Any] = {"last_ok": None, "last_ms": None}
        self._canary_task: asyncio.Task | None = None  # type: ignore[type-arg]
        self._canary_started = 0.0
        self._canary_done: CanaryOutcome | None = None
        self._errors: set[str] = set()
        self.pinger = Pinger()
        self._baseline_task: asyncio.Task | None = None  # type: ignore[type-arg]
        # degraded mode (cfg.degrade)
        self.without: str | None = None  # the host the running llama-server leaves out
        self.not_serving_since: float | None = None
        self.last_probe = float("-inf")
        self.returns = 0
        self.requested: tuple[str, float] | None = None
        self.plan_reason = ""

    def _error(self, key: str, message: str | None) -> None:
        """Log an error once until it clears."""
        if message is None:
            self._errors.discard(key)
        elif key not in self._errors:
            self._errors.add(key)
            log(message)

    def api_key(self) -> str | None:
        """The API key from api_key_file (read on each use: the file may be rotated)."""
        if not self.cfg.api_key_file:
            return None
        try:
            with open(self.cfg.api_key_file, encoding="utf-8") as handle:
                key = handle.read().strip()
            self._error("key", None)
            return key or None
        except OSError as exc:
            self._error("key", "cannot read api_key_file %s: %s" % (self.cfg.api_key_file, exc))
            return None

    def _auth(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": "Bearer %s" % key} if key else {}

    async def process(self) -> tuple[str | None, int]:
        out = await run_command(systemctl_show_argv(self.cfg.unit))
        self._error("systemctl", None if out is not None else "systemctl show %s gave no answer" % self.cfg.unit)
        self.main_started = main_start(out) if out is not None else None
        return parse_systemctl_show(out) if out is not None else (None, 0)

    async def health(self) -> int | str:
        try:
            status, _body = await http_request(self.cfg.upstream_host, self.cfg.upstream_port, "GET", "/health",
                                               HEALTH_TIMEOUT)
            return status
        except asyncio.TimeoutError:
            self.health_timeouts += 1
            return "timeout"
        except OSError:
            return "refused"

    async def connections(self) -> list[dict[str, Any]] | None:
        out = await run_command(SS_LINKS)
        self._error("ss", None if out is not None else "ss -tinHO gave no answer: worker links are not checked")
        return parse_ss(out) if out is not None else None

    async def metrics(self) -> dict[str, float] | None:
        try:
            status, body = await http_request(self.cfg.upstream_host, self.cfg.upstream_port, "GET", "/metrics",
                                              METRICS_TIMEOUT, self._auth())
        except (OSError, asyncio.TimeoutError):
            return None
        return parse_metrics(body.decode("utf-8", "replace")) if status == 200 else None

    async def canary(self, pid: int) -> CanaryOutcome:
        """POST a one-token completion; on a missed deadline compare /metrics before and after."""
        before = await self.metrics()
        start = time.monotonic()
        body = json.dumps(CANARY_BODY).encode("utf-8")
        headers = dict(self._auth(), **{"Content-Type": "application/json"})
        try:
            status, _answer = await http_request(self.cfg.upstream_host, self.cfg.upstream_port, "POST",
                                                 "/completion", self.cfg.canary_deadline, headers, body)
        except asyncio.TimeoutError:
            progress = made_progress(before, await self.metrics())
            return CanaryOutcome(pid, False, True, progress, time.monotonic() - start)
        except OSError as exc:
            return CanaryOutcome(pid, False, False, None, time.monotonic() - start, str(exc))
        detail = "" if status == 200 else "answered HTTP %d" % status
        return CanaryOutcome(pid, status == 200, False, None, time.monotonic() - start, detail)

    async def _run_canary(self, pid: int) -> None:
        outcome = await self.canary(pid)
        self._canary_done = outcome
        self.canary_state = {"last_ok": outcome.ok, "last_ms": round(outcome.elapsed * 1000),
                             "at": self.gate.clock()}
        self._error("canary", "canary completion %s" % outcome.detail if outcome.detail else None)

    def restart(self, pid: int) -> None:
        """SIGKILL llama-server's main process; without the permission, ``systemctl kill``."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            log("no permission to kill pid %d, asking systemd: systemctl kill -s KILL %s" % (pid, self.cfg.unit))
            subprocess.run(["systemctl", "kill", "-s", "KILL", self.cfg.unit], timeout=SUBPROCESS_TIMEOUT,
                           check=False, stdout=subprocess.DEVNULL)

    def workers_of(self, pid: int) -> tuple[Worker, ...]:
        """The workers of llama-server ``pid``, from its command line (see running_workers)."""
        if pid <= 0:
            return self.workers
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as handle:
                return running_workers(self.cfg.workers, rpc_endpoints(handle.read()))
        except OSError:
            return running_workers(self.cfg.workers, None)

    async def poll(self) -> Decision:
        """One round: observe, decide, act, publish."""
        active, pid = await self.process()
        running = active == "active" and pid > 0
        health = await self.health() if running else None
        loaded = self.load.loads
        self.load = track_load(self.load, pid if running else 0, self.main_started, health, time.monotonic(),
                               self.gate.clock())
        if self.load.loads != loaded:
            log("llama-server (pid %d) loaded the model in %.1f s" % (pid, self.load.last_seconds or 0.0))
        conns = await self.connections()
        self.workers = self.workers_of(pid) if running else self.workers
        self.links = await self.observe_links(conns)
        self.stall_polls = count_stalls(self.stall_polls, self.links)
        canary, self._canary_done = self._canary_done, None
        obs = Observation(self.gate.clock(), active, pid, health, self.links, self.stall_polls, canary)
        decision = decide(obs, self.memory, self.cfg)
        self.memory = remember(self.memory, obs, decision)
        if decision.action == ACTION_RESTART:
            self.restarts += 1
            self.last_action = {"action": "restart", "pid": pid, "at": obs.now, "reason": decision.reason}
            self.gate.set_state(decision.state, decision.reason)
            self.restart(pid)
        else:
            self.gate.set_state(decision.state, decision.reason)
        self._maybe_canary(decision.state, pid)
        if self.cfg.degrade is not None:
            await self.degrade(self.cfg.degrade, decision.state, running)
        self.write_state()
        return decision

    async def probe_host(self, deg: Degrade, host: str) -> bool:
        """True when every rpc-server of ``host`` answers HELLO within 3 s (only asked while llama-server is
        not connected to it: rpc-server serves one client at a time)."""
        endpoints = ["%s:%d" % ("[%s]" % w.address if ":" in w.address else w.address, w.port)
                     for w in self.cfg.workers if w.host == host]
        return await run_command(list(deg.probe) + ["--timeout", "3"] + endpoints, timeout=3.0 * len(endpoints) + 2) \
            is not None

    def request_plan(self, deg: Degrade, name: str, reason: str) -> None:
        """Ask the root switch service for plan ``name`` (or "full")."""
        now = time.monotonic()
        if self.requested is not None and self.requested[0] == name and now - self.requested[1] < 120:
            return
        self.requested = (name, now)
        self.plan_reason = reason
        log(reason)
        try:
            write_json_atomic(deg.request_file, {"plan": name, "reason": reason, "at": self.gate.clock()})
        except OSError as exc:
            log("cannot write the plan request %s: %s" % (deg.request_file, exc))

    async def degrade(self, deg: Degrade, state: str, running: bool) -> None:
        """Degraded mode: serve without a worker host that stays silent, and back with it once it answers.

        The hosts are probed only while llama-server is not running (it waits in ExecStartPre, or restarts), so
        no probe queues behind its connections; the left-out host is probed while degraded (nobody uses it)."""
        now = time.monotonic()
        if running:
            without = left_out(self.cfg.workers, self.workers)
            if without != self.without:
                self.returns = 0
                log("llama-server runs %s" % ("the full plan" if without is None else
                                              "degraded, without worker %s" % without))
            self.without = without
        self.not_serving_since = None if state == SERVING else (self.not_serving_since or now)
        if now - self.last_probe < deg.probe_interval:
            return
        if self.without is None:
            if running or self.not_serving_since is None or now - self.not_serving_since < deg.after:
                return
            self.last_probe = now
            hosts = sorted({w.host for w in self.cfg.workers})
            answers = await asyncio.gather(*(self.probe_host(deg, host) for host in hosts))
            name, reason = degrade_choice(deg, dict(zip(hosts, answers)))
            if name is not None:
                self.request_plan(deg, name, reason)
            else:
                self._error("degrade", reason or None)
            return
        self.last_probe = now
        if await self.probe_host(deg, self.without):
            self.returns += 1
            if self.returns >= deg.return_probes:
                self.request_plan(deg, FULL_PLAN, "worker %s answers HELLO again (%d probes in a row): restoring the "
                                  "full plan" % (self.without, self.returns))
        else:
            self.returns = 0

    async def observe_links(self, conns: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
        """The workers' links; a link that has waited stall_seconds for an answer is stalled when its host,
        which answered ping before, answers no more. Every PING_BASELINE_INTERVAL the hosts are pinged
        in the background to learn which answer."""
        if conns is None:
            return None
        links = worker_links(conns, self.workers, self.cfg.stall_seconds)
        waiting = awaiting_workers(links, self.cfg.stall_seconds)
        if waiting:
            addresses = {name: links[name]["address"] for name in waiting}
            unreachable = await self.pinger.unreachable(addresses)
            if unreachable:
                links = worker_links(conns, self.workers, self.cfg.stall_seconds, unreachable)
        elif time.monotonic() - self.pinger.last_baseline >= PING_BASELINE_INTERVAL:
            self.pinger.last_baseline = time.monotonic()
            addresses = sorted({worker.address for worker in self.workers})
            self._baseline_task = asyncio.ensure_future(self.pinger.ping(addresses))
        return links

    def _maybe_canary(self, state: str, pid: int) -> None:
        """A canary every canary_interval while serving, unless clients' answers already showed the
        cluster working within that interval (their traffic is the proof, and a canary would disturb
        a benchmark's measurements)."""
        now = time.monotonic()
        if state != SERVING or (self._canary_task is not None and not self._canary_task.done()):
            return
        if now - self.gate.last_answer < self.cfg.canary_interval:
            return
        if now - self._canary_started >= self.cfg.canary_interval:
            self._canary_started = now
            self._canary_task = asyncio.ensure_future(self._run_canary(pid))

    def snapshot(self) -> dict[str, Any]:
        """The state file's content."""
        workers = {}
        for worker, name in zip(self.workers, link_names(self.workers)):
            info = (self.links or {}).get(name)
            workers[name] = {"address": worker.address, "port": worker.port,
                             "link": info["link"] if info else "unknown",
                             "unacked": info["unacked"] if info else None,
                             "lastack_ms": info["lastack_ms"] if info else None,
                             "awaiting_ms": info["awaiting_ms"] if info else None,
                             "ping": self.pinger.answers.get(worker.address, "unknown")}
        plan = None
        if self.cfg.degrade is not None:
            plan = {"mode": FULL_PLAN if self.without is None else "degraded", "without": self.without,
                    "reason": self.plan_reason, "requested": self.requested[0] if self.requested else None,
                    "return_probes": self.returns}
        return {"state": self.gate.state, "reason": self.gate.reason, "since": self.gate.since, "plan": plan,
                "updated": self.gate.clock(), "restarts": self.restarts, "last_action": self.last_action,
                "workers": workers, "canary": self.canary_state, "counters": dict(self.gate.counters),
                "in_flight": self.gate.in_flight, "health_timeouts": self.health_timeouts,
                "load": {"last_seconds": self.load.last_seconds, "ready_at": self.load.ready_at,
                         "loads": self.load.loads}}

    def metrics_text(self) -> str:
        """The gate's metrics (GATE_METRICS_PATH) as Prometheus text."""
        degraded = None if self.cfg.degrade is None else self.without is not None
        return render_exposition(GATE_METRICS, gate_samples(self.gate.state, self.gate.since, self.gate.counters,
                                                            self.gate.in_flight, self.restarts, degraded, self.load))

    def write_state(self) -> None:
        """Write the snapshot atomically (temp file + rename) to state_file, when there is one."""
        if self.cfg.state_file is None:
            return
        try:
            write_json_atomic(self.cfg.state_file, self.snapshot())
            self._error("state_file", None)
        except OSError as exc:
            self._error("state_file", "cannot write %s: %s" % (self.cfg.state_file, exc))

    async def run(self) -> None:
        """Poll forever, every poll_interval seconds."""
        while True:
            started = time.monotonic()
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - the watchdog must keep running
                self._error("poll", "watchdog poll failed: %s: %s" % (type(exc).__name__, exc))
            await asyncio.sleep(max(0.0, self.cfg.poll_interval - (time.monotonic() - started)))


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same directory and a rename."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0644) through a temporary file in the same directory and a rename."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=".llamafleet.", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


async def serve(cfg: Config) -> None:
    """Run the gate and its watchdog until SIGTERM or SIGINT."""
    gate = Gate(cfg)
    await gate.start()
    log("listening on %s:%d%s, relaying to %s:%d"
        % (cfg.listen_host, cfg.listen_port, " (TLS)" if cfg.tls_cert else "", cfg.upstream_host, cfg.upstream_port))
    watchdog = Watchdog(gate, cfg)
    gate.metrics_text, gate.metrics_key = watchdog.metrics_text, watchdog.api_key
    task = asyncio.ensure_future(watchdog.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log("stopping")
    task.cancel()
    await gate.stop()
    watchdog.write_state()


# ---------------------------------------------------------------------------------------------------------------------
# The worker side: rpc-server's guard

# Seconds a live client may wait behind the one rpc-server is serving before the guard restarts rpc-server.
# llama-server holds one connection per endpoint and nothing else connects while it runs (the deploy and the
# gate never probe a connected worker), so a second live client that waits this long is a new llama-server
# and the served one is dead. Longer than a HELLO attempt (5 s) so a probe alone never triggers it.
DEFAULT_GUARD_STALE = 20.0
DEFAULT_GUARD_POLL = 2.0
GUARD_LOG_PREFIX = "llamafleet-rpc-guard: "


def parse_listeners(text: str) -> dict[int, tuple[int, int]]:
    """``ss -ltnH`` -> {local port: (connections queued for accept, backlog)} (a listening socket's Recv-Q
    and Send-Q). A connection reset while queued stays counted until rpc-server accepts it; the queue is
    full (new clients cannot even connect) once it holds more than the backlog."""
    queued: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        words = line.split()
        if words and not words[0][0].isdigit():
            words = words[1:]  # the state column, when ss prints it
        if len(words) < 3 or not words[0].isdigit() or not words[1].isdigit():
            continue
        local = _endpoint(words[2])
        if local is not None:
            before = queued.get(local[1], (0, 0))
            queued[local[1]] = (before[0] + int(words[0]), max(before[1], int(words[1])))
    return queued


def established_on(conns: list[dict[str, Any]], port: int) -> int:
    """Established connections whose local port is ``port`` (from :func:`parse_ss`)."""
    return sum(1 for conn in conns if conn["local"] is not None and conn["local"][1] == port
               and conn["state"].upper().startswith("ESTAB"))


def guard_decide(queued: int, established: int, since: float | None, now: float,
                 stale: float = DEFAULT_GUARD_STALE, backlog: int = 1) -> tuple[float | None, bool]:
    """One rpc-server port's poll -> (when clients began waiting or None, restart now?).

    Clients wait when a connection is queued for accept and either a live one is among them (two or
    more established: the one being served and a waiting one) or the queue is full (``queued`` above
    ``backlog``: reset attempts fill it, and no new client can connect at all). The clock starts then
    and stops only when the accept queue empties (a client that gives up and resets stays queued, so
    retrying clients keep it running). Restart when it has run ``stale`` seconds and clients wait now.
    """
    if queued <= 0:
        return None, False
    waiting = established >= 2 or queued > backlog
    if since is None:
        return (now if waiting else None), False
    return since, waiting and now - since >= stale


def _guard_log(message: str) -> None:
    sys.stdout.write(GUARD_LOG_PREFIX + message + "\n")
    sys.stdout.flush()


def command_output(argv: list[str]) -> str | None:
    """stdout of ``argv`` when it exits 0 within SUBPROCESS_TIMEOUT, else None (run_command, blocking)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _main_pid(unit: str) -> int:
    out = command_output(systemctl_show_argv(unit))
    return parse_systemctl_show(out)[1] if out is not None else 0


def guard(servers: dict[int, str], stale: float = DEFAULT_GUARD_STALE, poll: float = DEFAULT_GUARD_POLL,
          rounds: int | None = None) -> None:
    """Watch each rpc-server port (``servers``: port -> unit) and restart the unit's process (SIGKILL; systemd
    restarts it) when a live client has waited ``stale`` seconds behind a dead one."""
    since: dict[int, float | None] = {port: None for port in servers}
    _guard_log("watching %s (restart after a client waits %g s)"
               % (", ".join("%s on port %d" % (unit, port) for port, unit in sorted(servers.items())), stale))
    done = 0
    while rounds is None or done < rounds:
        done += 1
        listeners, conns = command_output(SS_LISTENERS), command_output(SS_ESTABLISHED)
        if listeners is not None and conns is not None:
            queued, established = parse_listeners(listeners), parse_ss(conns)
            for port, unit in sorted(servers.items()):
                now = time.monotonic()
                waiting, backlog = queued.get(port, (0, 0))
                since[port], restart = guard_decide(waiting, established_on(established, port), since[port], now,
                                                    stale, max(backlog, 1))
                if restart:
                    pid = _main_pid(unit)
                    _guard_log("%s (port %d) has kept a client waiting %.0f s behind a connection whose peer is "
                               "gone (a partition or a killed llama-server): restarting it (pid %d)"
                               % (unit, port, now - (since[port] or now), pid))
                    if pid > 0:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError as exc:
                            _guard_log("cannot kill pid %d: %s" % (pid, exc))
                    since[port] = None
        time.sleep(poll)


def guard_main(argv: list[str]) -> int:
    """``python3 serving_gate.py guard [--stale S] PORT=UNIT ...``."""
    import argparse

    parser = argparse.ArgumentParser(prog="llamafleet-rpc-guard",
                                     description="restart an rpc-server stuck on a dead client")
    parser.add_argument("--stale", type=float, default=DEFAULT_GUARD_STALE,
                        help="seconds a live client may wait (default %(default)s)")
    parser.add_argument("--poll", type=float, default=DEFAULT_GUARD_POLL, help=argparse.SUPPRESS)
    parser.add_argument("servers", nargs="+", metavar="PORT=UNIT", help="an rpc-server's port and its unit")
    args = parser.parse_args(argv)
    servers = {}
    for item in args.servers:
        port, sep, unit = item.partition("=")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not unit:
            parser.error("expected PORT=UNIT, got %r" % item)
        servers[int(port)] = unit
    if args.stale <= 0 or args.poll <= 0:
        parser.error("--stale and --poll must be > 0")
    try:
        guard(servers, args.stale, args.poll)
    except KeyboardInterrupt:
        return 0
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# The plan switch (root): puts the plan the gate asks for in place


def switch_plan(request: Any, plans_dir: str, current: str | None) -> tuple[str | None, str]:
    """The drop-in text for ``request`` ({"plan": "full" | NAME}; NAME a file NAME.conf in ``plans_dir``, which
    only the deploy writes) and what it does; None removes the drop-in. ``current``: the drop-in now.
    Raises ValueError for a request that names no plan of ``plans_dir``."""
    if not isinstance(request, dict) or not isinstance(request.get("plan"), str):
        raise ValueError("the request must be {\"plan\": NAME}, got %r" % (request,))
    name = request["plan"]
    if name == FULL_PLAN:
        return None, "the full plan" + (" (no degraded plan in place)" if current is None else "")
    if not _PLAN_NAME.match(name):
        raise ValueError("%r is not a plan name" % name)
    path = os.path.join(plans_dir, name + ".conf")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read(), "plan %s (%s)" % (name, path)
    except OSError as exc:
        raise ValueError("no plan %s: %s" % (name, exc)) from None


def switch_main(argv: list[str]) -> int:
    """``python3 serving_gate.py switch --request FILE --plans DIR --dropin FILE --unit UNIT`` (root)."""
    import argparse

    parser = argparse.ArgumentParser(prog="llamafleet-plan-switch")
    for option in ("--request", "--plans", "--dropin", "--unit"):
        parser.add_argument(option, required=True)
    args = parser.parse_args(argv)
    say = "llamafleet-plan-switch: "
    try:
        with open(args.request, encoding="utf-8") as handle:
            request = json.load(handle)
    except FileNotFoundError:
        sys.stdout.write(say + "no request (the gate stopped): nothing to do\n")
        return 0
    except (OSError, ValueError) as exc:
        sys.stderr.write(say + "cannot read %s: %s\n" % (args.request, exc))
        return 1
    try:
        with open(args.dropin, encoding="utf-8") as handle:
            current: str | None = handle.read()
    except FileNotFoundError:
        current = None
    try:
        text, what = switch_plan(request, args.plans, current)
    except ValueError as exc:
        sys.stderr.write(say + "refused: %s\n" % exc)
        return 1
    if text == current:
        sys.stdout.write(say + "%s is already in place\n" % what)
        return 0
    if text is None:
        os.unlink(args.dropin)
    else:
        os.makedirs(os.path.dirname(args.dropin), exist_ok=True)
        write_text_atomic(args.dropin, text)
    sys.stdout.write(say + "switching llama-server to %s (%s)\n" % (what, request.get("reason", "")))
    for command in (["systemctl", "daemon-reload"], ["systemctl", "restart", "--no-block", args.unit]):
        if command_output(command) is None:
            sys.stderr.write(say + "%s failed\n" % " ".join(command))
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python3 serving_gate.py --config /etc/llamafleet/gate.json`` (or ``guard ...``, see guard_main; or
    ``switch ...``, see switch_main)."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["guard"]:
        return guard_main(argv[1:])
    if argv[:1] == ["switch"]:
        return switch_main(argv[1:])

    parser = argparse.ArgumentParser(prog="llamafleet-gate", description="llamafleet's serving gate for llama-server")
    parser.add_argument("--config", required=True, help="the gate's JSON configuration")
    parser.add_argument("--check", action="store_true", help="validate the configuration and exit")
    args = parser.parse_args(argv)
    try:
        with open(args.config, encoding="utf-8") as handle:
            cfg = load_config(json.load(handle))
    except (OSError, ValueError) as exc:
        sys.stderr.write("llamafleet-gate: %s: %s\n" % (args.config, exc))
        return 2
    if args.check:
        return 0
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        sys.stderr.write("llamafleet-gate: %s\n" % exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
