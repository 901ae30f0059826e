"""The lab's file mirror: a threaded HTTP server for the llama.cpp source archive and models.

Hosts download from it as a real fleet downloads from a web server: GET and HEAD,
with byte ranges (``206 Partial Content``) so interrupted downloads resume, and
``ETag``/``Last-Modified``/``If-Range`` so a resumed download never splices two
versions of a file.  It serves ``$LLAMAFLEET_CACHE/mirror``; :func:`publish` puts
files there (hard links to the cache, so nothing is copied).

Run as a daemon: ``python -m llamafleet.lab.mirror --listen 10.77.0.1:8089 --root DIR``.
"""

from __future__ import annotations

import argparse
import email.utils
import logging
import mimetypes
import os
import posixpath
import re
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from .daemon import SERVER_PREFIX, configure_logging, serve
from .net import GATEWAY
from .paths import LabPaths

MIRROR_PORT = 8089
MIRROR_URL = f"http://{GATEWAY}:{MIRROR_PORT}"

log = logging.getLogger("lab-mirror")


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class ByteRange:
    """An inclusive byte range ``first``..``last`` of a file of ``size`` bytes."""

    first: int
    last: int
    size: int

    @property
    def length(self) -> int:
        return self.last - self.first + 1

    @property
    def content_range(self) -> str:
        return f"bytes {self.first}-{self.last}/{self.size}"


class RangeNotSatisfiable(ValueError):
    """The Range header is valid but selects no byte of the file (answer 416)."""


_RANGE_SPEC_RE = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """Interpret a ``Range`` header for a file of ``size`` bytes (RFC 9110, section 14).

    Returns the range to send, or None to send the whole file (no header, a unit
    other than bytes, a malformed header, or several ranges: a server may always
    answer those with the full representation).  Raises
    :class:`RangeNotSatisfiable` when the single range lies wholly past the end.
    """
    if not header:
        return None
    unit, sep, spec = header.partition("=")
    if not sep or unit.strip().lower() != "bytes" or "," in spec:
        return None
    match = _RANGE_SPEC_RE.match(spec)
    if not match or match.group(1) == match.group(2) == "":
        return None
    first_s, last_s = match.groups()
    if first_s == "":  # suffix range: the last N bytes
        suffix = int(last_s)
        if suffix == 0 or size == 0:
            raise RangeNotSatisfiable(header)
        return ByteRange(max(size - suffix, 0), size - 1, size)
    first = int(first_s)
    if last_s and int(last_s) < first:
        return None  # invalid: ignore the header
    if first >= size:
        raise RangeNotSatisfiable(header)
    last = min(int(last_s), size - 1) if last_s else size - 1
    return ByteRange(first, last, size)


def entity_tag(size: int, mtime_ns: int) -> str:
    """A strong validator for a file version: changes whenever size or mtime do."""
    return f'"{size:x}-{mtime_ns:x}"'


def if_range_allows(if_range: str | None, etag: str, last_modified: str) -> bool:
    """True if a Range request may be honoured given its ``If-Range`` precondition."""
    if not if_range:
        return True
    value = if_range.strip()
    if value.startswith(("W/", '"')):
        return value == etag  # If-Range needs a strong match; weak tags never match
    return value == last_modified


def safe_relative_path(url_path: str) -> str | None:
    """The file path a URL path names under the mirror root, or None if it tries to leave it."""
    parts = []
    for segment in unquote(urlsplit(url_path).path).split("/"):
        if segment in ("", "."):
            continue
        if segment == ".." or "\0" in segment or "\\" in segment:
            return None
        parts.append(segment)
    return posixpath.join(*parts) if parts else ""


def mirror_url(subdir: str, name: str, base: str = MIRROR_URL) -> str:
    """The URL under which the mirror serves ``subdir/name``."""
    return f"{base}/{quote(subdir.strip('/'))}/{quote(name)}"


# --------------------------------------------------------------------------- publishing


def publish(path: str | os.PathLike[str], subdir: str, *, name: str | None = None,
            mirror_dir: Path | None = None) -> str:
    """Make the file ``path`` available on the lab mirror under ``subdir``; return its URL.

    The file is hard-linked into the mirror directory (or symlinked if it lives on
    another file system), so publishing a large model costs nothing.  Re-publishing
    the same file is a no-op; publishing another file under the same name replaces it.
    Works whether or not the mirror daemon is running.
    """
    source = Path(path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"cannot publish {path}: not a file")
    rel = safe_relative_path(subdir)
    if not rel:
        raise ValueError(f"subdir {subdir!r} must be a relative directory such as 'models'")
    name = name or source.name
    if "/" in name or name in (".", ".."):
        raise ValueError(f"name {name!r} must be a plain file name")
    target_dir = (mirror_dir or LabPaths.default().mirror_dir) / rel
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / name
    if target.exists() and os.path.samefile(target, source):
        return mirror_url(rel, name)
    tmp = target_dir / f".{name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        os.symlink(source, tmp)
    os.replace(tmp, target)
    return mirror_url(rel, name)


# --------------------------------------------------------------------------- server


class MirrorHandler(BaseHTTPRequestHandler):
    """GET/HEAD of files under the server's root, with single byte ranges."""

    protocol_version = "HTTP/1.1"
    server_version = SERVER_PREFIX + "mirror"
    server: MirrorServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(send_body=False)

    def _serve(self, send_body: bool) -> None:
        rel = safe_relative_path(self.path)
        if rel is None:
            self._plain(HTTPStatus.BAD_REQUEST, "path leaves the mirror\n", send_body)
            return
        path = self.server.root / rel
        if path.is_dir():
            self._listing(path, rel, send_body)
            return
        try:
            handle = open(path, "rb")  # noqa: SIM115 (closed below, after sendfile)
        except OSError:
            self._plain(HTTPStatus.NOT_FOUND, f"not found: /{rel}\n", send_body)
            return
        with handle:
            st = os.fstat(handle.fileno())
            size = st.st_size
            etag = entity_tag(size, st.st_mtime_ns)
            last_modified = email.utils.formatdate(st.st_mtime, usegmt=True)
            byte_range = None
            if if_range_allows(self.headers.get("If-Range"), etag, last_modified):
                try:
                    byte_range = parse_range(self.headers.get("Range"), size)
                except RangeNotSatisfiable:
                    self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            if byte_range is None:
                self.send_response(HTTPStatus.OK)
                offset, count = 0, size
            else:
                self.send_response(HTTPStatus.PARTIAL_CONTENT)
                self.send_header("Content-Range", byte_range.content_range)
                offset, count = byte_range.first, byte_range.length
            ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(count))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", last_modified)
            self.end_headers()
            if send_body and count:
                sent = 0
                try:
                    sent = self.connection.sendfile(handle, offset, count)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                # what left the source, per client: benchmarks.big_model sums these lines
                log.info("%s sent %d bytes of /%s", self.address_string(), sent, rel)

    def _listing(self, path: Path, rel: str, send_body: bool) -> None:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir() if not p.name.startswith("."))
        self._plain(HTTPStatus.OK, "".join(n + "\n" for n in names), send_body)

    def _plain(self, status: HTTPStatus, text: str, send_body: bool) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (signature of the base class)
        log.info("%s %s", self.address_string(), format % args)


class MirrorServer(ThreadingHTTPServer):
    """A threaded HTTP server with the directory it serves."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], root: Path) -> None:
        self.root = root.resolve()
        super().__init__(address, MirrorHandler)


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` as a (host, port) pair."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {value!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llamafleet.lab.mirror", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=parse_listen, default=(GATEWAY, MIRROR_PORT), metavar="HOST:PORT")
    parser.add_argument("--root", type=Path, required=True, help="directory to serve")
    parser.add_argument("--pidfile", type=Path, help="written once listening, removed on exit")
    args = parser.parse_args(argv)
    configure_logging()
    args.root.mkdir(parents=True, exist_ok=True)
    serve(MirrorServer(args.listen, args.root), args.pidfile, "lab-mirror")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
