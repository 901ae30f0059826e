# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The host side of model_receive's streamed copy: the bytes the controller sends on stdin go straight into
``TARGET.part`` at the resume offset, hashed as they are written.

The record ``TARGET.part.json`` holds the sha256 of each whole piece written (``digests``). A run first reads
the ``.part``'s recorded prefix once, piece by piece: each piece whose bytes still have their recorded digest is
kept and feeds the running sha256 of the whole file; from the first piece that does not (a corrupt or unwritten
``.part``), the file is sent again. A record of an older run (the pieces it had, ``done``) keeps the pieces from
the first on, as far as they run without a gap. Once the last byte is written, the running sha256 is the whole
file's: when it is not the pinned one, the ``.part`` and its record are removed (the next run sends all again);
when it is, the record says so (``whole``) with the file's size, mtime and inode, and module model_receive
publishes it.

Self-contained (the standard library only): the action plugin runs this file's source on the host with
``python -c SOURCE TARGET.part SIZE SHA256 PIECE MODE``; MODE is ``stream`` (the bytes from the offset to the
end, on stdin), ``probe`` (only the offset) or ``at:OFFSET`` (one range that starts where the last one ended,
for a connection that cannot stream: the prefix is then not read again, and the last range hashes the whole
file). Its answers are stdout lines that start with :data:`TAG`, a JSON object each.
``llamafleet.core.receive_stream`` in the library.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, BinaryIO, TextIO

TAG = "LLAMAFLEET-RECEIVE "
BLOCK = 8 << 20


def record_path(part: str) -> str:
    return part + ".json"


def read_record(part: str, size: int, sha256: str, piece: int) -> dict[str, Any] | None:
    """The record of ``part`` when it is of this file and piece size and the ``.part`` has the file's size;
    a record of the older form (``done``) as its gapless run of pieces from the first, their digests unknown."""
    try:
        with open(record_path(part), encoding="utf-8") as handle:
            record = json.load(handle)
        if (record.get("sha256") != sha256 or record.get("size") != size or record.get("piece") != piece
                or os.path.getsize(part) != size):
            return None
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(record.get("digests"), list):
        return record
    if isinstance(record.get("done"), list):
        done = set(record["done"])
        run = 0
        while run in done:
            run += 1
        return {"sha256": sha256, "size": size, "piece": piece, "digests": [None] * run}
    return None


def save_record(part: str, record: dict[str, Any]) -> None:
    tmp = record_path(part) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    os.replace(tmp, record_path(part))


def _hash_range(handle: BinaryIO, length: int, *hashers: Any) -> int:
    """Feed ``length`` bytes of ``handle`` from where it is to ``hashers``; the bytes read."""
    got = 0
    while got < length:
        block = handle.read(min(BLOCK, length - got))
        if not block:
            break
        for hasher in hashers:
            hasher.update(block)
        got += len(block)
    return got


def verified_prefix(part: str, size: int, sha256: str, piece: int) -> tuple[list[str], Any, bool]:
    """(the digests of the ``.part``'s pieces that still have their recorded bytes, the running sha256 of
    those pieces, whether any recorded piece failed)."""
    record = read_record(part, size, sha256, piece)
    whole = hashlib.sha256()
    digests: list[str] = []
    if record is None:
        return digests, whole, False
    with open(part, "rb") as handle:
        for index, want in enumerate(record["digests"]):
            length = min(piece, size - index * piece)
            if length <= 0:
                break
            kept = whole.copy()
            one = hashlib.sha256()
            if _hash_range(handle, length, whole, one) != length or (want is not None and one.hexdigest() != want):
                return digests, kept, True
            digests.append(one.hexdigest())
    return digests, whole, False


def _answer(out: TextIO, **fields: Any) -> None:
    out.write(TAG + json.dumps(fields) + "\n")
    out.flush()


def receive(part: str, size: int, sha256: str, piece: int, mode: str, source: BinaryIO, out: TextIO) -> dict[str, Any]:
    """Answer the resume offset, then write ``source``'s bytes into ``part`` from there (see the module's text);
    the last answer (also returned): ``offset`` reached, ``complete`` and, when complete, ``ok`` and ``sha256``."""
    whole: Any = None
    if mode.startswith("at:"):
        record = read_record(part, size, sha256, piece)
        digests = list(record["digests"]) if record else []
        offset = int(mode[3:])
        if min(len(digests) * piece, size) != offset:
            raise ValueError("%s holds %d bytes, not %d: start again" % (part, min(len(digests) * piece, size), offset))
        repaired = False
    else:
        digests, whole, repaired = verified_prefix(part, size, sha256, piece)
        offset = min(len(digests) * piece, size)
    if not os.path.exists(part) or os.path.getsize(part) != size:
        with open(part, "wb") as handle:
            handle.truncate(size)
    record = {"sha256": sha256, "size": size, "piece": piece, "digests": digests, "whole": None}
    if mode != "probe" or repaired:
        save_record(part, record)
    _answer(out, offset=offset, repaired=repaired)
    if mode == "probe":
        return {"offset": offset, "complete": False}
    one = hashlib.sha256()
    with open(part, "r+b") as handle:
        handle.seek(offset)
        while offset < size:
            block = source.read(min(BLOCK, size - offset, piece - offset % piece))
            if not block:
                break
            handle.write(block)
            one.update(block)
            if whole is not None:
                whole.update(block)
            offset += len(block)
            if offset % piece == 0 or offset == size:
                digests.append(one.hexdigest())
                one = hashlib.sha256()
                handle.flush()
                save_record(part, record)
        handle.flush()
        os.fsync(handle.fileno())
    if source.read(1):
        raise ValueError("more than %d bytes arrived for %s" % (size, part))
    result: dict[str, Any] = {"offset": offset, "complete": offset == size}
    if offset == size:
        if whole is None:
            whole = hashlib.sha256()
            with open(part, "rb") as handle:
                _hash_range(handle, size, whole)
        result.update(sha256=whole.hexdigest(), ok=whole.hexdigest() == sha256)
        if result["ok"]:
            st = os.stat(part)
            record.update(whole=sha256, stat=[st.st_size, st.st_mtime_ns, st.st_ino])
            save_record(part, record)
        else:
            os.unlink(part)
            os.unlink(record_path(part))
    _answer(out, **result)
    return result


def main(argv: list[str]) -> int:
    part, size, sha256, piece, mode = argv[1], int(argv[2]), argv[3], int(argv[4]), argv[5]
    try:
        receive(part, size, sha256, piece, mode, sys.stdin.buffer, sys.stdout)
    except (OSError, ValueError) as exc:
        where = getattr(exc, "filename", None) or part
        _answer(sys.stdout, error="%s: %s" % (where, getattr(exc, "strerror", None) or exc))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
