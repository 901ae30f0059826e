# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""FNV-1a 64-bit hashes of file byte ranges, as llama.cpp's RPC weight cache computes them.

ggml-rpc.cpp's ``fnv_hash`` starts from the offset basis 0xcbf29ce484222325 and,
for every byte, xors the byte in and then multiplies by the prime 0x100000001b3
(mod 2**64). rpc-server names a cache file after that hash of a tensor's bytes,
as 16 lowercase hex digits.

Hashing a model is a serial byte loop, so it is done by a small C helper
(``llamafleet-fnv1a64``, installed next to the llama.cpp binaries by the
``llamacpp_build`` role) when one is available; a pure-Python fallback gives the
same answers about a hundred times slower.

Stdlib only (module_utils shared with the ``llamafleet`` library as ``llamafleet.core.fnv``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Sequence

FNV1A64_BASIS = 0xCBF29CE484222325
FNV1A64_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF

HELPER_NAME = "llamafleet-fnv1a64"
HELPER_ENV = "LLAMAFLEET_FNV_HELPER"
_CHUNK = 4 << 20


class HashError(Exception):
    """A hash could not be computed: unreadable file, bad range or failing helper."""


def fnv1a64(data: bytes | bytearray | memoryview, value: int = FNV1A64_BASIS) -> int:
    """FNV-1a 64 of ``data``, continuing from ``value`` (the basis for a fresh hash)."""
    prime = FNV1A64_PRIME
    mask = _MASK
    for byte in bytes(data):
        value = ((value ^ byte) * prime) & mask
    return value


def hash_name(value: int) -> str:
    """The rpc-server cache file name of a hash: 16 lowercase hex digits."""
    return "%016x" % value


def find_helper(helper: str | None = None) -> str | None:
    """Locate the C helper.

    An explicit ``helper`` must exist and be executable (HashError otherwise).
    Without one, ``$LLAMAFLEET_FNV_HELPER`` and then ``llamafleet-fnv1a64`` on
    ``$PATH`` are tried; None means the Python fallback will be used.
    """
    if helper:
        if not (os.path.isfile(helper) and os.access(helper, os.X_OK)):
            raise HashError("hash helper %s does not exist or is not executable" % helper)
        return helper
    from_env = os.environ.get(HELPER_ENV)
    if from_env:
        return find_helper(from_env)
    return shutil.which(HELPER_NAME)


def _check_ranges(path: str, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise HashError("%s: %s" % (path, exc.strerror or exc)) from exc
    checked = []
    for offset, length in ranges:
        offset, length = int(offset), int(length)
        if offset < 0 or length < 0 or offset + length > size:
            raise HashError("%s: range %d:%d is outside the file (%d bytes)" % (path, offset, length, size))
        checked.append((offset, length))
    return checked


def hash_ranges_python(path: str | os.PathLike[str], ranges: Sequence[tuple[int, int]]) -> list[str]:
    """The pure-Python fallback of hash_ranges (about a hundred times slower than the helper)."""
    path = os.fspath(path)
    ranges = _check_ranges(path, ranges)
    names = []
    try:
        with open(path, "rb") as handle:
            for offset, length in ranges:
                handle.seek(offset)
                value = FNV1A64_BASIS
                left = length
                while left:
                    chunk = handle.read(min(left, _CHUNK))
                    if not chunk:
                        raise HashError("%s: file shrank while hashing range %d:%d" % (path, offset, length))
                    value = fnv1a64(chunk, value)
                    left -= len(chunk)
                names.append(hash_name(value))
    except OSError as exc:
        raise HashError("%s: %s" % (path, exc.strerror or exc)) from exc
    return names


def _hash_ranges_helper(helper: str, path: str, ranges: Sequence[tuple[int, int]], jobs: int) -> list[str]:
    spec = "".join("%d:%d\n" % (offset, length) for offset, length in ranges)
    try:
        proc = subprocess.run(
            [helper, "-j", str(max(1, jobs)), "--", path],
            input=spec.encode("ascii"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            check=False,
        )
    except OSError as exc:
        raise HashError("cannot run hash helper %s: %s" % (helper, exc.strerror or exc)) from exc
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", errors="replace").strip()
        raise HashError("hash helper %s failed on %s (exit %d): %s" % (helper, path, proc.returncode, message))
    names = proc.stdout.decode("ascii", errors="replace").split()
    if len(names) != len(ranges) or not all(len(n) == 16 for n in names):
        raise HashError("hash helper %s printed %d hashes for %d ranges of %s"
                        % (helper, len(names), len(ranges), path))
    return names


def hash_ranges(path: str | os.PathLike[str], ranges: Sequence[tuple[int, int]],
                helper: str | None = None, jobs: int = 1) -> list[str]:
    """Hash byte ranges of one file.

    :param path: the file.
    :param ranges: ``(offset, length)`` pairs.
    :param helper: path of the ``llamafleet-fnv1a64`` binary; None looks for one
        (see find_helper) and falls back to pure Python when there is none.
    :param jobs: ranges hashed in parallel by the helper (ignored by the fallback).
    :returns: one 16-hex-digit name per range, in order.
    :raises HashError: unreadable file, range outside it, or helper failure.
    """
    path = os.fspath(path)
    checked = _check_ranges(path, ranges)
    if not checked:
        return []
    resolved = find_helper(helper)
    if resolved is None:
        return hash_ranges_python(path, checked)
    return _hash_ranges_helper(resolved, path, checked, jobs)
