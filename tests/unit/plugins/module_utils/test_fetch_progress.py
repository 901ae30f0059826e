"""fetch_progress: what model_fetch writes to its progress file as it downloads (bytes, total, recent rate, file),
at most once a second, read back as await_progress prints it."""

from __future__ import annotations

import json
from pathlib import Path

from llamafleet.core.await_progress import transfer_of
from llamafleet.core.fetch_progress import WINDOW, ProgressFile


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bytes_rate_and_files_across_two_files(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "p.json"
    prog = ProgressFile(str(path), [40 * 2**20, 60 * 2**20], clock=clock)
    prog.begin("a.gguf")
    rec = json.loads(path.read_text())
    assert rec == {"phase": "downloading", "done": 0, "total": 100 * 2**20, "rate": None, "file": "a.gguf",
                   "index": 1, "count": 2, "note": ""}
    for second in range(1, 5):  # 10 MiB a second
        clock.now += 0.5
        prog.update(second * 10 * 2**20 - 5 * 2**20)  # within the second: not written
        assert json.loads(path.read_text())["done"] == (second - 1) * 10 * 2**20
        clock.now += 0.5
        prog.update(second * 10 * 2**20)
    rec = json.loads(path.read_text())
    assert rec["done"] == 40 * 2**20 and abs(rec["rate"] - 10 * 2**20) < 1
    prog.end(40 * 2**20)
    prog.begin("b.gguf", have=20 * 2**20)  # a resume: its bytes count as done, not as speed
    assert transfer_of(path.read_text()) == "resuming, 60.0 MiB of 100.0 MiB (60%), 10 MB/s, file 2 of 2"
    clock.now += 1
    prog.update(21 * 2**20)
    assert transfer_of(path.read_text()).startswith("61.0 MiB of 100.0 MiB (61%), ")
    prog.waiting("retrying in 5 s")
    assert transfer_of(path.read_text()).endswith(", file 2 of 2, retrying in 5 s")
    prog.close()
    assert not path.exists()
    prog.close()  # twice is fine


def test_the_rate_follows_the_last_seconds(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "p.json"
    prog = ProgressFile(str(path), [None], clock=clock)
    prog.begin("a.gguf")
    done = 0
    for _second in range(30):  # 30 s at 10 MB/s, then a slow link
        clock.now += 1
        done += 10_000_000
        prog.update(done)
    for _second in range(int(WINDOW) + 2):
        clock.now += 1
        done += 1_000_000
        prog.update(done)
    rec = json.loads(path.read_text())
    assert rec["total"] is None and abs(rec["rate"] - 1_000_000) < 1e5, rec
    assert transfer_of(path.read_text()) == "%.1f MiB, 1.0 MB/s" % (done / 2**20)


def test_an_unwritable_place_does_not_stop_the_download(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    prog = ProgressFile(str(tmp_path / "file" / "p.json"), [10])
    prog.begin("a.gguf")
    prog.update(5)
    prog.close()
