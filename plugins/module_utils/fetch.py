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
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.error
import urllib.parse
from dataclasses import dataclass, field

from ansible.module_utils.urls import open_url

from .checksum import CHUNK, sha256_file, verify_in_place, write_marker
from .gguf import (
    GGUF_MAGIC,
    GGUFError,
    GGUFFile,
    GGUFIncomplete,
    architecture,
    data_end,
    read_gguf_prefix,
)

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_RANGE_RE = re.compile(r"^\s*bytes\s+(?:\d+-\d+|\*)/(\d+)\s*$", re.IGNORECASE)
# The header check reads this much first, then doubles the range until the tensor table is
# parsed (a 262k-token vocabulary takes about 6 MiB), up to the cap.
HEADER_FIRST_BYTES = 1024 * 1024
HEADER_MAX_BYTES = 64 * 1024 * 1024
# Metadata arrays longer than this (vocabularies) are skipped, not decoded, while checking.
_HEADER_ARRAY_LIMIT = 65536


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
                f"{self.url}: sha256 must be 64 hex digits (got {self.sha256!r}); pin every model file"
            )
        if not self.name:
            self.name = os.path.basename(urllib.parse.urlparse(self.url).path)
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise FetchError(f"{self.url}: cannot derive a file name; set 'name'")


@dataclass
class FileState:
    spec: FileSpec
    path: str
    present: bool = False
    verified: bool = False
    remote_size: int | None = None
    partial_bytes: int = 0
    accepts_ranges: bool = False
    action: str = "none"  # none | download | resume | replace
    notes: list[str] = field(default_factory=list)


def probe(url: str, timeout: float) -> tuple[int | None, bool]:
    """HEAD the URL: (size or None, whether it accepts byte ranges)."""
    try:
        with open_url(url, method="HEAD", timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            ranges = response.headers.get("Accept-Ranges", "").lower() == "bytes"
            return (int(length) if length and length.isdigit() else None), ranges
    except urllib.error.HTTPError as exc:
        raise FetchError(f"{url}: the server answered HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"{url}: unreachable ({reason})") from exc


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


def _read_exactly(response: object, count: int) -> bytes:
    """Up to ``count`` bytes of ``response`` (fewer only at its end)."""
    parts, got = [], 0
    while got < count:
        block = response.read(min(CHUNK, count - got))  # type: ignore[attr-defined]
        if not block:
            break
        parts.append(block)
        got += len(block)
    return b"".join(parts)


def read_range(url: str, start: int, end: int, timeout: float) -> tuple[bytes, int | None, str]:
    """Bytes ``start`` to ``end - 1`` of ``url`` (fewer at its end): (bytes, the file's size or None, Content-Type).

    Asks for a byte range; a server that ignores it answers the whole file, of which only
    the first ``end`` bytes are read before the connection is closed.
    """
    try:
        with open_url(url, headers={"Range": "bytes=%d-%d" % (start, end - 1)}, timeout=timeout) as response:
            content_type = response.headers.get("Content-Type", "")
            if response.status == 206:
                return (_read_exactly(response, end - start),
                        content_range_total(response.headers.get("Content-Range")), content_type)
            length = response.headers.get("Content-Length")
            return (_read_exactly(response, end)[start:], int(length) if length and length.isdigit() else None,
                    content_type)
    except urllib.error.HTTPError as exc:
        if exc.code == 416:  # the range starts past the end: nothing more to read
            return b"", content_range_total(exc.headers.get("Content-Range") if exc.headers else None), ""
        raise FetchError(f"{url}: the server answered HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"{url}: unreachable ({reason})") from exc


def check_header(url: str, label: str, timeout: float = 30.0, first_bytes: int = HEADER_FIRST_BYTES,
                 max_bytes: int = HEADER_MAX_BYTES) -> None:
    """Read the GGUF header of ``url`` over HTTP ranges; FetchError naming ``label`` if it cannot be the model.

    Refuses a file that does not start with the GGUF magic (saying what it got), one
    shorter than its header implies, one whose header does not parse within
    ``max_bytes``, and an architecture the planner does not know.
    """
    name = "%s (%s)" % (label, url)
    buf, served, content_type = read_range(url, 0, first_bytes, timeout)
    if buf[:len(GGUF_MAGIC)] != GGUF_MAGIC:
        raise FetchError("%s.url %s: not a GGUF file (%s)" % (label, url, describe_start(content_type, buf)))
    while True:
        try:
            header = read_gguf_prefix(buf, name, served, _HEADER_ARRAY_LIMIT)
            break
        except GGUFIncomplete as more:
            if len(buf) >= max_bytes:
                raise FetchError("%s: the GGUF header is longer than %d MiB, the most this check reads"
                                 % (name, max_bytes // 2**20)) from None
            want = min(max(2 * len(buf), more.needed), max_bytes)
            block = read_range(url, len(buf), want, timeout)[0]
            if not block:  # the server has no more (and did not say its size)
                raise FetchError("%s: the server has %d bytes, the GGUF header needs more" % (name, len(buf))) from None
            buf += block
        except GGUFError as exc:
            raise FetchError(str(exc)) from None
    problem = header_problem(name, header, served)
    if problem:
        raise FetchError(problem)


def check_headers(states: list[FileState], label: str = "files", timeout: float = 30.0) -> None:
    """:func:`check_header` for every file that must be fetched; ``label[N]`` names the N-th file."""
    for index, state in enumerate(states):
        if state.action != "none":
            check_header(state.spec.url, "%s[%d]" % (label, index), timeout)


def plan(specs: list[FileSpec], dest_dir: str, timeout: float = 30.0, record: bool = True) -> list[FileState]:
    """Decide, for every file, whether it is in place or must be (re)fetched."""
    states = []
    for spec in specs:
        path = os.path.join(dest_dir, spec.name)
        state = FileState(spec=spec, path=path, present=os.path.isfile(path))
        if state.present and verify_in_place(path, spec.sha256, record=record):
            state.verified = True
            states.append(state)
            continue
        state.remote_size, state.accepts_ranges = probe(spec.url, timeout)
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


def download(state: FileState, timeout: float = 60.0) -> None:
    """Fetch one file into ``<path>.part`` (resuming when possible), verify, rename."""
    spec = state.spec
    part = state.path + ".part"
    offset = state.partial_bytes if state.action == "resume" else 0
    digest = hashlib.sha256()
    if offset:
        sha256_file(part, digest, limit=offset)
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        with open_url(spec.url, headers=headers, timeout=timeout) as response:
            if offset and response.status != 206:
                offset = 0  # the server ignored the range: start over
                digest = hashlib.sha256()
            with open(part, "r+b" if offset else "wb") as handle:
                handle.seek(offset)
                handle.truncate()
                while True:
                    block = response.read(CHUNK)
                    if not block:
                        break
                    handle.write(block)
                    digest.update(block)
                handle.flush()
                os.fsync(handle.fileno())
    except urllib.error.HTTPError as exc:
        raise FetchError(f"{spec.url}: the server answered HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"{spec.url}: download interrupted ({reason}); run again to resume") from exc
    got = digest.hexdigest()
    if got != spec.sha256:
        os.unlink(part)
        raise FetchError(
            f"{spec.url}: sha256 mismatch: expected {spec.sha256}, got {got}; "
            "the pinned sha256 or the source is wrong"
        )
    os.replace(part, state.path)
    write_marker(state.path, spec.sha256)
