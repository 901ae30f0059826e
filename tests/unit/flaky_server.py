"""A loopback HTTP server that misbehaves on cue, for the download tests.

It serves a directory with byte ranges (the lab mirror's handler) once its rules let a request
through, and can
- want headers (``require``: a bearer token, an API key) and answer 401 without them;
- answer the next requests of a kind with a status (503, 429 with ``Retry-After``, 403, ...);
- send the head and part of the body of a download, then close the connection (``drop_after``);
- redirect every request to another server (``redirect_to``), like Hugging Face to its CDN, with a
  signed query string.

Every request is recorded (method, path, kind, headers) so tests count attempts and see what
each request carried.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from llamafleet.lab.mirror import MirrorHandler, MirrorServer, RangeNotSatisfiable, parse_range, safe_relative_path


def request_kind(method: str, range_header: str | None) -> str:
    """``HEAD``, ``range`` (a bounded range: the GGUF header check) or ``get`` (the whole file or the rest of it:
    the download and its resumes)."""
    if method == "HEAD":
        return "HEAD"
    if range_header and not range_header.strip().endswith("-"):
        return "range"
    return "get"


@dataclass
class Rule:
    """What the next ``times`` requests of ``kind`` (``HEAD``, ``range``, ``get`` or ``any``) get instead of the file:
    a ``status`` with ``headers``, or the file's head and ``drop_after`` bytes of its body before the connection closes."""

    kind: str = "any"
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    drop_after: int | None = None
    times: int = 1


@dataclass
class Seen:
    method: str
    path: str
    kind: str
    headers: dict[str, str]


class FlakyHandler(MirrorHandler):
    server: FlakyServer

    def _serve(self, send_body: bool) -> None:
        srv = self.server
        kind = request_kind(self.command, self.headers.get("Range"))
        with srv.lock:
            srv.seen.append(Seen(self.command, self.path, kind, dict(self.headers.items())))
            rule = srv.take(kind)
        if rule is not None and rule.status:
            self._status(rule.status, rule.headers, send_body)
        elif any(self.headers.get(name) != value for name, value in srv.require.items()):
            self._status(HTTPStatus.UNAUTHORIZED, {"WWW-Authenticate": "Bearer"}, send_body)
        elif srv.redirect_to:
            self._status(HTTPStatus.FOUND, {"Location": srv.redirect_to + self.path.split("?")[0]
                                            + "?X-Amz-Signature=" + srv.signature}, send_body)
        elif rule is not None and rule.drop_after is not None:
            self._drop(rule.drop_after)
        else:
            super()._serve(send_body)

    def _status(self, status: int, headers: dict[str, str], send_body: bool) -> None:
        body = ("%d\n" % status).encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _drop(self, count: int) -> None:
        """The head of the answer (200 or 206) with its full Content-Length, ``count`` bytes of the body, then close."""
        data = (self.server.root / (safe_relative_path(self.path) or "")).read_bytes()
        try:
            byte_range = parse_range(self.headers.get("Range"), len(data))
        except RangeNotSatisfiable:
            byte_range = None
        if byte_range is None:
            self.send_response(HTTPStatus.OK)
            body = data
        else:
            self.send_response(HTTPStatus.PARTIAL_CONTENT)
            self.send_header("Content-Range", byte_range.content_range)
            body = data[byte_range.first:byte_range.last + 1]
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body[:count])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class FlakyServer(MirrorServer):
    """The lab mirror's server with rules; ``url(name)`` is a file's URL (``host`` names the server in it)."""

    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        super().__init__(("127.0.0.1", 0), root)
        self.RequestHandlerClass = FlakyHandler
        self.host = host
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.require: dict[str, str] = {}
        self.redirect_to = ""
        self.signature = "cdn-signature-0123456789"
        self.seen: list[Seen] = []
        self.handle_error = lambda *args: None  # a client that closes early is no error here

    @property
    def base(self) -> str:
        return "http://%s:%d" % (self.host, self.server_address[1])

    def url(self, name: str) -> str:
        return "%s/%s" % (self.base, name)

    def take(self, kind: str) -> Rule | None:
        """The first rule for ``kind`` (or ``any``) with uses left, one use fewer; None: serve the file."""
        for rule in self.rules:
            if rule.times > 0 and rule.kind in (kind, "any"):
                rule.times -= 1
                return rule
        return None

    def kinds(self) -> list[str]:
        return [seen.kind for seen in self.seen]


def start(root: Path, host: str = "127.0.0.1") -> FlakyServer:
    """A FlakyServer serving ``root`` on a thread; stop it with ``shutdown()`` and ``server_close()``."""
    srv = FlakyServer(root, host)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv
