# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The progress file of a model download (``model_fetch`` with ``progress``, run as an async job): bytes done of
the total to fetch, the recent rate, which file of how many, and what it waits for (a retry), rewritten whole at
most once a second; the ``await_progress`` action plugin reads it on the controller (``progress_file``) and prints
it (``await_progress.transfer_of``). No URL and no credential goes into it.

Stdlib only, runs on the hosts.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Callable

from .atomic_file import write_json_atomic

# Bytes per second over about the last WINDOW seconds (a download's speed changes; the average since the start
# would hide a link that slowed down).
WINDOW = 10.0


class ProgressFile:
    """Writes ``{"phase", "done", "total", "rate", "file", "index", "count", "note"}`` to ``path``.

    ``total`` is the size of the files to fetch (None when a server gives no length); ``done`` counts their bytes
    on disk, those of a resumed ``.part`` included, so the percentage says how far the files are.
    """

    def __init__(self, path: str, sizes: list[int | None], every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.every, self.clock = path, every, clock
        self.total = None if any(size is None for size in sizes) else sum(sizes)  # type: ignore[arg-type]
        self.count = len(sizes)
        self.finished = 0  # bytes of the files already done
        self.current = 0  # bytes of the file in hand
        self.moved = 0  # bytes fetched by this run (a resumed .part's are done, but were not fetched now)
        self.index, self.name, self.phase, self.note = 0, "", "checking", ""
        self.samples: collections.deque[tuple[float, int]] = collections.deque()
        self.written = None  # type: float | None

    def begin(self, name: str, have: int = 0) -> None:
        """The next file, with ``have`` bytes of it already in its ``.part``."""
        self.index += 1
        self.name, self.current, self.note = name, have, ""
        self.phase = "resuming" if have else "downloading"  # a resume hashes the bytes it has first
        self.write(force=True)
        self.phase = "downloading"

    def update(self, size: int) -> None:
        """The file in hand has ``size`` bytes on disk now."""
        self.moved += max(size - self.current, 0)
        self.current, self.note = size, ""
        self.write()

    def end(self, size: int) -> None:
        """The file in hand is complete and verified, ``size`` bytes."""
        self.finished += size
        self.current = 0

    def waiting(self, note: str) -> None:
        """A pause before a retry, in words (without the URL)."""
        self.note = note
        self.write(force=True)

    def rate(self, now: float) -> float | None:
        """Bytes per second fetched over about the last WINDOW seconds; None over less than half a second."""
        self.samples.append((now, self.moved))
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW:
            self.samples.popleft()
        first_time, first_moved = self.samples[0]
        if now - first_time < 0.5:
            return None
        return (self.moved - first_moved) / (now - first_time)

    def record(self, now: float) -> dict[str, object]:
        return {"phase": self.phase, "done": self.finished + self.current, "total": self.total,
                "rate": self.rate(now), "file": self.name, "index": self.index, "count": self.count,
                "note": self.note}

    def write(self, force: bool = False) -> None:
        now = self.clock()
        if not force and self.written is not None and now - self.written < self.every:
            return
        self.written = now
        try:
            write_json_atomic(self.path, self.record(now))
        except OSError:
            pass  # progress is a courtesy: a full or read-only disk fails the download itself, with its own message

    def close(self) -> None:
        """Remove the file (the job's result says the rest)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
