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

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


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
