# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""sha256 verification of large pinned files, remembered by a marker next to the file.

A file is *verified* when its sha256 matches the pinned one.  Hashing a
multi-gigabyte model on every run would be slow, so a small marker next to the
file (``.<name>.verified``, JSON ``{"sha256", "size", "mtime_ns"}``) records
what was verified; while size and mtime still match, the file is trusted
without hashing it again.

Used by ``fetch`` (the ``model_fetch`` module) on managed hosts and by the lab
(``llamafleet.lab.artifacts``) on the controller.  Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import os

CHUNK = 4 * 1024 * 1024


def sha256_file(path: str | os.PathLike[str], start_hash=None, limit: int | None = None):
    """Hash ``path`` (its first ``limit`` bytes) into a hashlib object (``start_hash`` continues one)."""
    digest = start_hash or hashlib.sha256()
    remaining = limit
    with open(path, "rb") as handle:
        while True:
            size = CHUNK if remaining is None else min(CHUNK, remaining)
            if size == 0:
                break
            block = handle.read(size)
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest


def sha256_hex(path: str | os.PathLike[str]) -> str:
    """The sha256 of a whole file, as 64 lowercase hex digits."""
    return sha256_file(path).hexdigest()


def marker_path(path: str | os.PathLike[str]) -> str:
    """Where the verification marker of ``path`` lives: ``.<name>.verified`` in the same directory."""
    path = os.fspath(path)
    return os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".verified")


def _fingerprint(path: str | os.PathLike[str], sha256: str) -> dict:
    st = os.stat(path)
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def marker_matches(path: str | os.PathLike[str], sha256: str) -> bool:
    """True when the marker of ``path`` records ``sha256`` for the file's current size and mtime."""
    try:
        with open(marker_path(path), encoding="utf-8") as handle:
            data = json.load(handle)
        return data == _fingerprint(path, sha256)
    except (OSError, ValueError):
        return False


def write_marker(path: str | os.PathLike[str], sha256: str) -> None:
    """Record that ``path``, as it is now, has content ``sha256`` (atomically)."""
    target = marker_path(path)
    tmp = target + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(_fingerprint(path, sha256), handle)
    os.replace(tmp, target)


def verify_in_place(path: str | os.PathLike[str], sha256: str, record: bool = True) -> bool:
    """True when ``path`` holds the pinned bytes (marker first, else a full hash).

    With ``record`` a successful full hash leaves a marker for later runs.
    """
    if not os.path.isfile(path):
        return False
    if marker_matches(path, sha256):
        return True
    if sha256_hex(path) != sha256:
        return False
    if record:
        write_marker(path, sha256)
    return True
