# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A file written whole or not at all (a temporary file in the same directory, then a rename): the gate's state
file and plan requests, the plan switch's drop-in, the workers' textfile metrics; and a file read whole, or None
where there is none (:func:`read_text`).

Stdlib only, runs on the hosts (the host package).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def read_text(path: str) -> str | None:
    """The text of the file at ``path`` (undecodable bytes replaced), None where there is none (other errors raise)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def write_json_atomic(path: str, data: dict[str, Any], mode: int = 0o644) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same directory and a rename."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n", mode)


def write_text_atomic(path: str, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` (``mode``, 0644 unless given) through a temporary file in the same directory and a
    rename."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=".llamafleet.", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
