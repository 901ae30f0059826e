"""checksum: sha256 verification remembered by a marker (used by model_fetch and the lab)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from llamafleet.core import checksum

BLOB = b"GGUF" + bytes(1000)
DIGEST = hashlib.sha256(BLOB).hexdigest()


@pytest.fixture()
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(BLOB)
    return path


@pytest.mark.parametrize(("limit", "expected"), [
    (None, DIGEST),
    (4, hashlib.sha256(b"GGUF").hexdigest()),
    (0, hashlib.sha256(b"").hexdigest()),
    (10**9, DIGEST),
])
def test_sha256_file_limit(blob: Path, limit: int | None, expected: str) -> None:
    assert checksum.sha256_file(blob, limit=limit).hexdigest() == expected


def test_sha256_file_continues_a_digest(blob: Path) -> None:
    start = hashlib.sha256(b"prefix")
    assert checksum.sha256_file(blob, start).hexdigest() == hashlib.sha256(b"prefix" + BLOB).hexdigest()
    assert checksum.sha256_hex(blob) == DIGEST


def test_verify_records_a_marker_and_trusts_it(blob: Path) -> None:
    marker = blob.parent / ".model.gguf.verified"
    assert checksum.marker_path(blob) == str(marker)
    assert not checksum.verify_in_place(blob, "0" * 64)
    assert not marker.exists()
    assert checksum.verify_in_place(blob, DIGEST)
    st = blob.stat()
    assert json.loads(marker.read_text()) == {"sha256": DIGEST, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    # the marker alone answers: a marker naming another digest for the same size and mtime is believed
    marker.write_text(json.dumps({"sha256": "f" * 64, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    assert checksum.verify_in_place(blob, "f" * 64)


def test_verify_without_record_leaves_no_marker(blob: Path) -> None:
    assert checksum.verify_in_place(blob, DIGEST, record=False)
    assert not Path(checksum.marker_path(blob)).exists()


@pytest.mark.parametrize("change", ["size", "mtime"])
def test_a_changed_file_is_hashed_again(blob: Path, change: str) -> None:
    assert checksum.verify_in_place(blob, DIGEST)
    if change == "size":
        blob.write_bytes(BLOB[:-1])
    else:
        st = blob.stat()
        os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        # same bytes, new mtime: hashed again, still right, and the marker follows the file
        assert checksum.verify_in_place(blob, DIGEST)
        assert checksum.marker_matches(blob, DIGEST)
        return
    assert not checksum.verify_in_place(blob, DIGEST)


@pytest.mark.parametrize("marker_text", ["not json", "[]", "{}"])
def test_unreadable_marker_means_hash_again(blob: Path, marker_text: str) -> None:
    Path(checksum.marker_path(blob)).write_text(marker_text)
    assert not checksum.marker_matches(blob, DIGEST)
    assert checksum.verify_in_place(blob, DIGEST)
    assert checksum.marker_matches(blob, DIGEST)


def test_missing_file_is_not_verified(tmp_path: Path) -> None:
    assert not checksum.verify_in_place(tmp_path / "missing", DIGEST)
    assert not checksum.marker_matches(tmp_path / "missing", DIGEST)
