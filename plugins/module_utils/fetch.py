# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pinned, checksummed, resumable downloads of model files (GGUF and its shards).

Standard library plus ansible-core's ``open_url`` (proxies, TLS validation),
so it runs on any managed host.  The Ansible module
``llamafleet.cluster.model_fetch`` and the library both use it.

A file is *verified* when its sha256 matches the pinned one; ``checksum``
remembers a verified file by a marker next to it, so a multi-gigabyte model is
not hashed again on every run.

Before anything is downloaded, :func:`check_headers` reads the start of every
file to fetch with HTTP range requests and refuses what llama.cpp could not
load: a page that is not a GGUF file (a login or error page served with 200),
a file shorter than its GGUF header says (truncated at the source: a sha256
pinned for that file does not catch it), or an architecture the planner does
not know.

Every request goes through :class:`Http`: it carries the credentials (a bearer token, extra headers) to
the configured URL's host only (see ``fetch_policy``: a redirect to another host gets them only when the
user lists that host), follows redirects itself to decide that per hop, and retries transient failures
with backoff; a download that fails midway continues from the bytes already in its ``.part`` file.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import ssl
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ansible.module_utils.urls import open_url

from .checksum import CHUNK, sha256_file, verify_in_place, write_marker
from .fetch_policy import (
    MAX_REDIRECTS,
    PROGRESS_RESETS_RETRIES,
    REDIRECT_STATUSES,
    Names,
    RetryRefused,
    credential_headers,
    describe_error,
    host_of,
    is_transient_error,
    is_transient_status,
    parse_retry_after,
    redact_url,
    redirect_target,
    sends_credentials,
    status_problem,
    wait_before_retry,
)
from .gguf import (
    GGUF_MAGIC,
    GGUFError,
    GGUFFile,
    GGUFIncomplete,
    assemble_model,
    data_end,
    read_gguf,
    read_gguf_prefix,
)
from .gguf_facts import FACTS_ARRAY_LIMIT, architecture, facts_of_model

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_RANGE_RE = re.compile(r"^\s*bytes\s+(?:\d+-\d+|\*)/(\d+)\s*$", re.IGNORECASE)
# The header check reads this much first, then doubles the range until the tensor table is
# parsed (a 262k-token vocabulary takes about 6 MiB), up to the cap.
HEADER_FIRST_BYTES = 1024 * 1024
HEADER_MAX_BYTES = 64 * 1024 * 1024
# Metadata arrays longer than this (vocabularies) are skipped, not decoded, while checking: the limit the planner's
# facts are read with, so header_facts() gives what gguf_facts.model_facts() gives from the files.
_HEADER_ARRAY_LIMIT = FACTS_ARRAY_LIMIT


class FetchError(Exception):
    """A download problem, with a message that names the file and what to do."""


@dataclass
class FileSpec:
    url: str
    sha256: str
    name: str = ""

    def __post_init__(self) -> None:
        self.sha256 = (self.sha256 or "").strip().lower()
        if not self.url:
            raise FetchError("a model file has no url")
        if not SHA256_RE.match(self.sha256):
            raise FetchError(
                f"{redact_url(self.url)}: sha256 must be 64 hex digits (got {self.sha256!r}); pin every model file"
            )
        if not self.name:
            self.name = os.path.basename(urllib.parse.urlparse(self.url).path)
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise FetchError(f"{redact_url(self.url)}: cannot derive a file name; set 'name'")


@dataclass
class FileState:
    spec: FileSpec
    path: str
    label: str = "files[0]"  # how messages name the file: <names.files>[<index>]
    present: bool = False
    verified: bool = False
    remote_size: int | None = None
    partial_bytes: int = 0
    accepts_ranges: bool = False
    action: str = "none"  # none | download | resume | replace
    notes: list[str] = field(default_factory=list)


T = TypeVar("T")
# What a request raises besides an HTTP status (urllib wraps the failures of opening in URLError).
_REQUEST_ERRORS = (urllib.error.URLError, http.client.HTTPException, ssl.SSLError, TimeoutError, ConnectionError)


class _Failure(Exception):
    """One failed attempt. ``what`` says it without the file's label and URL; ``transient``: worth another
    attempt; ``code`` and ``headers``: the HTTP status and its headers, when it was one."""

    def __init__(self, what: str, transient: bool, retry_after: float | None = None, code: int = 0,
                 headers: object = None) -> None:
        super().__init__(what)
        self.what = what
        self.transient = transient
        self.retry_after = retry_after
        self.code = code
        self.headers = headers


@dataclass
class Http:
    """How the requests of a download go: the timeout of each, the credentials, the retries.

    The credentials (``token``, ``headers``) are kept out of ``repr`` and of every message; they go to the
    configured URL's host and to ``auth_redirect_hosts`` only (fetch_policy.sends_credentials), so this
    follows redirects itself. ``names`` are how messages call the settings; ``notes`` gets one line per
    retry (no secrets) for the module's result.
    """

    timeout: float = 60.0
    token: str = field(default="", repr=False)
    headers: dict[str, object] = field(default_factory=dict, repr=False)
    auth_redirect_hosts: tuple[str, ...] = ()
    retries: int = 5
    retry_delay: float = 5.0
    names: Names = field(default_factory=Names)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        try:
            self._credentials = credential_headers(self.token, self.headers, self.names)
        except ValueError as exc:
            raise FetchError(str(exc)) from None
        self._host = ""  # the server of the latest request, for messages

    def open(self, url: str, label: str, method: str = "GET", headers: dict[str, str] | None = None):
        """The response to ``method url`` with ``headers``, after redirects (each hop gets the credentials or
        not); _Failure for an HTTP error status, with what it means for the file ``label``."""
        current = url
        for _hop in range(MAX_REDIRECTS + 1):
            send = self._credentials if sends_credentials(url, current, self.auth_redirect_hosts) else {}
            self._host = host_of(current)
            try:
                return open_url(current, method=method, headers={**send, **(headers or {})}, timeout=self.timeout,
                                follow_redirects="none", use_netrc="Authorization" not in send)
            except urllib.error.HTTPError as exc:
                exc.close()
                location = exc.headers.get("Location") if exc.headers is not None else None
                if exc.code in REDIRECT_STATUSES and location:
                    try:
                        current = redirect_target(current, location)
                    except ValueError as bad:
                        raise _Failure("%s answered with %s" % (self._host, bad), False) from None
                    continue
                credentials = "sent" if send else ("withheld" if self._credentials else "none")
                retry_after = parse_retry_after(exc.headers.get("Retry-After") if exc.headers is not None else None,
                                                self.clock())
                raise _Failure(status_problem(exc.code, exc.reason, current, label, credentials, url, self.names),
                               is_transient_status(exc.code), retry_after, exc.code, exc.headers) from None
        raise _Failure("more than %d redirects from %s" % (MAX_REDIRECTS, host_of(url)), False)

    def retry(self, label: str, url: str, attempt: Callable[[], T], progress: Callable[[], int] = lambda: 0,
              then: str = "run again later") -> T:
        """``attempt()``, again after each transient failure (with a wait), up to ``retries`` failures in a row.

        An attempt that moved ``progress()`` (bytes on disk) on by PROGRESS_RESETS_RETRIES starts the count
        again, so a long download over a link that drops now and then gets there. FetchError names ``label``,
        the URL without secrets, what failed and, when it gives up on a transient failure, ``then``.
        """
        prefix = "%s.url %s: " % (label, redact_url(url))
        failures = 0
        while True:
            before = progress()
            try:
                return attempt()
            except _Failure as exc:
                failure = exc
            except _REQUEST_ERRORS as exc:
                failure = _Failure("%s %s" % (self._host or host_of(url), describe_error(exc)), is_transient_error(exc))
            if not failure.transient:
                raise FetchError(prefix + failure.what) from None
            if progress() - before >= PROGRESS_RESETS_RETRIES:
                failures = 0
            failures += 1
            try:
                delay = wait_before_retry(failures, self.retries, self.retry_delay, failure.retry_after, self.names)
            except RetryRefused as refused:
                raise FetchError(prefix + "; ".join(p for p in (failure.what, str(refused), then) if p)) from None
            self.notes.append("%s%s: retry %d of %d in %g s" % (prefix, failure.what, failures, self.retries, delay))
            self.sleep(delay)


def _content_length(response: object) -> int | None:
    length = response.headers.get("Content-Length")  # type: ignore[attr-defined]
    return int(length) if length and length.isdigit() else None


def _copy(response: object, write: Callable[[bytes], None], limit: int | None = None,
          size_hint: int | None = None) -> int:
    """Hand the body of ``response`` (at most its first ``limit`` bytes) to ``write`` block by block; the bytes read.

    http.client ends a body early without complaint when the server closes the connection: a body shorter
    than its Content-Length (or, without one, than ``size_hint``) is a transient _Failure, which a retry resumes.
    """
    # a gzip body (open_url decompresses it; nothing here asks for one) is longer than its Content-Length
    encoded = response.headers.get("Content-Encoding", "identity").lower() != "identity"  # type: ignore[attr-defined]
    want = None if encoded else _content_length(response)
    if want is None and not encoded:
        want = size_hint
    if limit is not None:
        want = limit if want is None else min(want, limit)
    got = 0
    while want is None or got < want:
        block = response.read(CHUNK if want is None else min(CHUNK, want - got))  # type: ignore[attr-defined]
        if not block:
            break
        write(block)
        got += len(block)
    if want is not None and got < want:
        raise _Failure("%s closed the connection after %d of %d bytes"
                       % (host_of(response.url), got, want), True)  # type: ignore[attr-defined]
    return got


def probe(url: str, http: Http, label: str) -> tuple[int | None, bool]:
    """HEAD the URL: (size or None, whether it accepts byte ranges)."""

    def attempt() -> tuple[int | None, bool]:
        with http.open(url, label, method="HEAD") as response:
            return _content_length(response), response.headers.get("Accept-Ranges", "").lower() == "bytes"

    return http.retry(label, url, attempt)


def content_range_total(value: str | None) -> int | None:
    """The full size from a ``Content-Range`` header (``bytes 0-99/1234`` or ``bytes */1234``), or None."""
    match = _CONTENT_RANGE_RE.match(value or "")
    return int(match.group(1)) if match else None


def describe_start(content_type: str, head: bytes) -> str:
    """What a file that is not GGUF looks like: its media type and first bytes, e.g.
    ``text/html, starts with '<!DOCTYPE html>'``."""
    kind = (content_type or "").split(";")[0].strip() or "no Content-Type"
    if not head:
        return "%s, empty" % kind
    first = head[:64].split(b"\n")[0].strip()
    try:
        text = first.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and text.isprintable():
        return "%s, starts with '%s'" % (kind, text[:48])
    return "%s, starts with bytes %s" % (kind, head[:8].hex(" "))


def header_problem(label: str, header: GGUFFile, served: int | None) -> str:
    """Why a parsed GGUF header cannot be the model, or ``""``.

    :param label: names the file (``model_files[0]``).
    :param served: the bytes the server has (None when it did not say).
    """
    needed = data_end(header)
    if served is not None and served < needed:
        return "%s: the server has %d bytes, the GGUF header needs %d (a truncated file?)" % (label, served, needed)
    # The shards after the first of a split model carry no hyperparameters.
    if not header.metadata.get("split.no"):
        try:
            architecture(header.metadata, label)
        except GGUFError as exc:
            return str(exc)
    return ""


def read_range(url: str, start: int, end: int, http: Http, label: str) -> tuple[bytes, int | None, str]:
    """Bytes ``start`` to ``end - 1`` of ``url`` (fewer at its end): (bytes, the file's size or None, Content-Type).

    Asks for a byte range; a server that ignores it answers the whole file, of which only
    the first ``end`` bytes are read before the connection is closed.
    """

    def attempt() -> tuple[bytes, int | None, str]:
        parts: list[bytes] = []
        try:
            response = http.open(url, label, headers={"Range": "bytes=%d-%d" % (start, end - 1)})
        except _Failure as exc:
            if exc.code == 416:  # the range starts past the end: nothing more to read
                return b"", content_range_total(exc.headers.get("Content-Range") if exc.headers else None), ""
            raise
        with response:
            content_type = response.headers.get("Content-Type", "")
            if response.status == 206:
                _copy(response, parts.append, end - start)
                return b"".join(parts), content_range_total(response.headers.get("Content-Range")), content_type
            _copy(response, parts.append, end)
            return b"".join(parts)[start:], _content_length(response), content_type

    return http.retry(label, url, attempt)


def check_header(url: str, label: str, http: Http | None = None, first_bytes: int = HEADER_FIRST_BYTES,
                 max_bytes: int = HEADER_MAX_BYTES) -> GGUFFile:
    """Read the GGUF header of ``url`` over HTTP ranges and return it; FetchError naming ``label`` if it cannot be
    the model.

    Refuses a file that does not start with the GGUF magic (saying what it got), one
    shorter than its header implies, one whose header does not parse within
    ``max_bytes``, and an architecture the planner does not know.
    """
    http = http or Http()
    name = "%s (%s)" % (label, redact_url(url))
    buf, served, content_type = read_range(url, 0, first_bytes, http, label)
    if buf[:len(GGUF_MAGIC)] != GGUF_MAGIC:
        raise FetchError("%s.url %s: not a GGUF file (%s)" % (label, redact_url(url), describe_start(content_type, buf)))
    while True:
        try:
            header = read_gguf_prefix(buf, name, served, _HEADER_ARRAY_LIMIT)
            break
        except GGUFIncomplete as more:
            if len(buf) >= max_bytes:
                raise FetchError("%s: the GGUF header is longer than %d MiB, the most this check reads"
                                 % (name, max_bytes // 2**20)) from None
            want = min(max(2 * len(buf), more.needed), max_bytes)
            block = read_range(url, len(buf), want, http, label)[0]
            if not block:  # the server has no more (and did not say its size)
                raise FetchError("%s: the server has %d bytes, the GGUF header needs more" % (name, len(buf))) from None
            buf += block
        except GGUFError as exc:
            raise FetchError(str(exc)) from None
    problem = header_problem(name, header, served)
    if problem:
        raise FetchError(problem)
    return header


def check_headers(states: list[FileState], http: Http | None = None) -> None:
    """:func:`check_header` for every file that must be fetched, named by its label."""
    for state in states:
        if state.action != "none":
            check_header(state.spec.url, state.label, http)


def header_facts(states: list[FileState], http: Http | None = None) -> dict:
    """The split planner's facts about the model (``gguf_facts.model_facts``) from every file's header: a file in
    place and verified is read here, the others over HTTP ranges (:func:`check_header`, which checks them too).
    FetchError when the headers are not one model."""
    headers = []
    try:
        for state in states:
            if state.action == "none":
                headers.append(read_gguf(state.path, _HEADER_ARRAY_LIMIT))
            else:
                headers.append(check_header(state.spec.url, state.label, http))
        return facts_of_model(assemble_model(headers))
    except GGUFError as exc:
        raise FetchError(str(exc)) from None


def plan(specs: list[FileSpec], dest_dir: str, http: Http | None = None, record: bool = True) -> list[FileState]:
    """Decide, for every file, whether it is in place or must be (re)fetched; ``<names.files>[N]`` labels the N-th."""
    http = http or Http()
    states = []
    for index, spec in enumerate(specs):
        path = os.path.join(dest_dir, spec.name)
        state = FileState(spec=spec, path=path, label="%s[%d]" % (http.names.files, index),
                          present=os.path.isfile(path))
        if state.present and verify_in_place(path, spec.sha256, record=record):
            state.verified = True
            states.append(state)
            continue
        state.remote_size, state.accepts_ranges = probe(spec.url, http, state.label)
        part = path + ".part"
        if os.path.isfile(part) and state.accepts_ranges:
            state.partial_bytes = os.path.getsize(part)
            if state.remote_size is not None and state.partial_bytes > state.remote_size:
                state.partial_bytes = 0
        if state.present:
            state.action = "replace"
            state.notes.append(f"{spec.name}: present but its sha256 differs from the pinned one: replacing")
        elif state.partial_bytes:
            state.action = "resume"
        else:
            state.action = "download"
        states.append(state)
    return states


def bytes_needed(states: list[FileState]) -> int:
    total = 0
    for state in states:
        if state.action == "none":
            continue
        if state.remote_size is None:
            continue
        total += state.remote_size - state.partial_bytes
    return total


def check_space(states: list[FileState], dest_dir: str, margin_bytes: int) -> tuple[int, int]:
    """(needed, free) bytes; raises FetchError when the files would not fit."""
    needed = bytes_needed(states)
    probe_dir = dest_dir
    while not os.path.isdir(probe_dir):
        parent = os.path.dirname(probe_dir)
        if parent == probe_dir:
            break
        probe_dir = parent
    st = os.statvfs(probe_dir)
    free = st.f_bavail * st.f_frsize
    if needed and needed + margin_bytes > free:
        raise FetchError(
            f"{dest_dir}: needs {needed / 2**30:.2f} GiB (+{margin_bytes / 2**30:.2f} GiB margin) for the model, "
            f"only {free / 2**30:.2f} GiB free: free space or point the model directory elsewhere"
        )
    return needed, free


@dataclass
class _Part:
    """The ``.part`` file of a download: how many bytes it holds and their sha256."""

    path: str
    size: int = 0
    digest: object = field(default_factory=hashlib.sha256)
    report: Callable[[int], None] = lambda size: None  # told the size after each block

    def restart(self) -> None:
        """From the first byte again (the server ignored the range, or the file changed)."""
        self.size = 0
        self.digest = hashlib.sha256()

    def writer(self, handle: object) -> Callable[[bytes], None]:
        """Writes a block to ``handle`` and counts and hashes it, so size and digest always match the file."""

        def write(block: bytes) -> None:
            handle.write(block)  # type: ignore[attr-defined]
            self.digest.update(block)  # type: ignore[attr-defined]
            self.size += len(block)
            self.report(self.size)

        return write


def download(state: FileState, http: Http | None = None, report: Callable[[int], None] = lambda size: None) -> None:
    """Fetch one file into ``<path>.part``, verify, rename; ``report`` is told the bytes on disk after each block.

    Resumes from the bytes an earlier run left (when the server takes ranges); a transient failure
    midway (a dropped connection, a timeout, HTTP 429 or 5xx) is retried from the bytes already written.
    """
    http = http or Http()
    spec = state.spec
    part = _Part(state.path + ".part", report=report)
    if state.action == "resume" and state.partial_bytes:
        part.size = state.partial_bytes
        sha256_file(part.path, part.digest, limit=part.size)

    def attempt() -> None:
        try:
            response = http.open(spec.url, state.label, headers={"Range": "bytes=%d-" % part.size} if part.size else {})
        except _Failure as exc:
            if exc.code != 416 or not part.size:
                raise
            if content_range_total(exc.headers.get("Content-Range") if exc.headers else None) == part.size:
                return  # the .part holds the whole file already
            part.restart()
            return attempt()
        with response:
            if part.size and response.status != 206:
                part.restart()  # the server ignored the range: start over
            rest = None if state.remote_size is None else state.remote_size - part.size
            with open(part.path, "r+b" if part.size else "wb") as handle:
                handle.seek(part.size)
                handle.truncate()
                _copy(response, part.writer(handle), size_hint=rest)
                handle.flush()
                os.fsync(handle.fileno())

    try:
        http.retry(state.label, spec.url, attempt, progress=lambda: part.size, then="run again to resume")
    except OSError as exc:  # the disk, not the network
        raise FetchError("%s: cannot write %s (%s)" % (state.label, part.path, exc.strerror or exc)) from exc
    got = part.digest.hexdigest()  # type: ignore[attr-defined]
    if got != spec.sha256:
        os.unlink(part.path)
        raise FetchError(
            f"{state.label}.url {redact_url(spec.url)}: sha256 mismatch: expected {spec.sha256}, got {got}; "
            "the pinned sha256 or the source is wrong"
        )
    os.replace(part.path, state.path)
    write_marker(state.path, spec.sha256)
