"""No file in plugins/ or llamafleet/ is over MAX_LINES lines: a bigger one is split by concern."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 600
EXCEPTIONS: set[str] = set()


def source_files() -> list[Path]:
    """Every file under plugins/ and llamafleet/, links not followed (llamafleet/core is plugins/module_utils)."""
    found = []
    for top in ("plugins", "llamafleet"):
        for folder, dirs, files in os.walk(REPO / top):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not (Path(folder) / d).is_symlink()]
            found += [Path(folder) / name for name in files if not name.endswith(".pyc")]
    return found


def test_no_file_is_over_the_limit() -> None:
    files = source_files()
    assert len(files) > 50 and REPO / "plugins/module_utils/gguf.py" in files
    lines = {path.relative_to(REPO).as_posix(): len(path.read_bytes().splitlines()) for path in files}
    over = {name: count for name, count in lines.items() if count > MAX_LINES and name not in EXCEPTIONS}
    assert not over, "over %d lines (split by concern): %s" % (MAX_LINES, over)
    assert set(EXCEPTIONS) <= set(lines), "an exception that is no longer there: drop it from EXCEPTIONS"
