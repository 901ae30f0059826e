"""model_receive's host side on real files: the stream written into the ``.part`` from where it is good, a resume
after a stop, a corrupt ``.part`` found and sent again, the whole file's sha256 failing closed, and the module's
publishing of what the receiver checked."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamafleet.core import cache_share as cs
from llamafleet.core import receive_stream as rs
from llamafleet.core.checksum import verify_in_place
from llamafleet.core.rpc_cache import CacheError

PIECE = 3000
DATA = os.urandom(10_000)
SHA = hashlib.sha256(DATA).hexdigest()


def _receive(part: Path, mode: str = "stream", data: bytes = DATA, start: int | None = None,
             sha: str = SHA) -> tuple[dict, list[dict]]:
    """(the receiver's last answer, all its answers) after it is sent ``data`` from the offset it answers first
    (from ``start`` when given)."""

    class Source(io.RawIOBase):
        """Bytes from the offset the receiver answered, as the controller sends them."""

        def __init__(self) -> None:
            super().__init__()
            self.stream: io.BytesIO | None = None

        def read(self, size: int = -1) -> bytes:
            if self.stream is None:
                first = json.loads(out.getvalue().splitlines()[0][len(rs.TAG):])
                self.stream = io.BytesIO(data[first["offset"] if start is None else start:])
            return self.stream.read(size)

    out = io.StringIO()
    last = rs.receive(str(part), len(DATA), sha, PIECE, mode, Source(), out)
    return last, [json.loads(line[len(rs.TAG):]) for line in out.getvalue().splitlines()]


def test_stream_resume_and_publish(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m.gguf"
    part = Path(str(target) + ".part")
    state = cs.receive_state(str(target), len(DATA), SHA, PIECE)
    assert (state["verified"], state["offset"], state["missing_bytes"]) == (False, 0, len(DATA))
    assert state["python"] == sys.executable
    # a run that stops after 7000 bytes: the two whole pieces are kept, the third is sent again
    last = _receive(part, data=DATA[:7000])[0]
    assert last == {"offset": 7000, "complete": False}
    assert cs.receive_state(str(target), len(DATA), SHA, PIECE)["offset"] == 6000
    with pytest.raises(CacheError, match="not whole"):
        cs.publish_received(str(target), len(DATA), SHA, PIECE)
    last, answers = _receive(part)
    assert answers[0] == {"offset": 6000, "repaired": False}
    assert last["ok"] and last["sha256"] == SHA and part.read_bytes() == DATA
    assert cs.publish_received(str(target), len(DATA), SHA, PIECE)["published"]
    assert target.read_bytes() == DATA and not part.exists() and not Path(str(part) + ".json").exists()
    assert verify_in_place(str(target), SHA) and cs.receive_state(str(target), len(DATA), SHA, PIECE)["verified"]


def test_a_corrupt_part_is_found_and_sent_again(tmp_path: Path) -> None:
    part = tmp_path / "m.gguf.part"
    _receive(part, data=DATA[:9000])
    with open(part, "r+b") as handle:  # a byte of the second piece changes on the host's disk
        handle.seek(4000)
        handle.write(bytes([DATA[4000] ^ 0xFF]))
    last, answers = _receive(part)
    assert answers[0] == {"offset": 3000, "repaired": True}
    assert last["ok"] and part.read_bytes() == DATA


def test_an_older_runs_part_resumes_and_the_whole_check_fails_closed(tmp_path: Path) -> None:
    target = tmp_path / "m.gguf"
    part = tmp_path / "m.gguf.part"
    bad = bytearray(DATA)
    bad[100] ^= 0xFF
    part.write_bytes(bytes(bad[:6000]) + bytes(len(DATA) - 6000))
    # the record the piece-by-piece model_receive left: pieces 0, 1 and 3 (a gap at 2)
    older = {"sha256": SHA, "size": len(DATA), "piece": PIECE, "done": [0, 1, 3]}
    Path(str(part) + ".json").write_text(json.dumps(older))
    assert cs.receive_state(str(target), len(DATA), SHA, PIECE)["offset"] == 6000
    last, answers = _receive(part)
    # its pieces have no recorded digest: kept, and the whole file's sha256 refuses the result
    assert answers[0]["offset"] == 6000
    assert not last["ok"] and last["sha256"] == hashlib.sha256(bytes(bad)).hexdigest()
    assert not part.exists() and not Path(str(part) + ".json").exists()
    with pytest.raises(CacheError, match="not whole"):
        cs.publish_received(str(target), len(DATA), SHA, PIECE)
    assert not target.exists()
    last, answers = _receive(part)
    assert answers[0]["offset"] == 0 and last["ok"]


def test_a_changed_part_is_not_published(tmp_path: Path) -> None:
    target = tmp_path / "m.gguf"
    part = tmp_path / "m.gguf.part"
    assert _receive(part)[0]["ok"]
    with open(part, "r+b") as handle:
        handle.write(b"x")
    with pytest.raises(CacheError, match="changed since"):
        cs.publish_received(str(target), len(DATA), SHA, PIECE)
    assert not target.exists()


def test_ranges_for_a_connection_that_cannot_stream(tmp_path: Path) -> None:
    part = tmp_path / "m.gguf.part"
    _receive(part, data=DATA[:3500])
    probe, answers = _receive(part, mode="probe")
    assert answers == [{"offset": 3000, "repaired": False}] and probe == {"offset": 3000, "complete": False}
    last = _receive(part, mode="at:3000", data=DATA[:6000], start=3000)[0]
    assert last == {"offset": 6000, "complete": False}
    with pytest.raises(ValueError, match="start again"):
        _receive(part, mode="at:3000", start=3000)
    last = _receive(part, mode="at:6000", start=6000)[0]
    assert last["ok"] and part.read_bytes() == DATA


def test_the_source_runs_alone_and_reports_errors(tmp_path: Path) -> None:
    """As the action plugin runs it: ``python -c SOURCE`` (no package), the bytes on stdin."""
    source = Path(rs.__file__).read_text(encoding="utf-8")
    part = tmp_path / "m.gguf.part"
    done = subprocess.run([sys.executable, "-c", source, str(part), str(len(DATA)), SHA, str(PIECE), "stream"],
                          input=DATA, capture_output=True, check=True)
    lines = [json.loads(line[len(rs.TAG):]) for line in done.stdout.decode().splitlines()]
    assert lines[0] == {"offset": 0, "repaired": False} and lines[-1]["ok"]
    too_much = subprocess.run([sys.executable, "-c", source, str(tmp_path / "n.part"), str(len(DATA)), SHA,
                               str(PIECE), "stream"], input=DATA + b"!", capture_output=True, check=False)
    assert too_much.returncode == 1 and b"more than 10000 bytes" in too_much.stdout
