"""The README's Layout lists every file of the checkout, and nothing that is gone.

The Layout is the table under ``## Layout``; its first column names files and folders in backticks:

* ``folder/`` (ends in a slash): a folder, from the repository root. Later bare names are in it.
* ``name`` or ``sub/name``: a file in the last folder named (above it in the table), when that
  folder has it; else a path from the repository root (``README.md``, ``meta/runtime.yml``).

A folder stands for every file under it (fixtures, results, fragments: one line), unless the
Layout names some file whose nearest listed folder it is: then each of its files must be named
(``plugins/module_utils/``: every source file by name). The files are git's: tracked, and
untracked but not ignored, so a new file is listed before it is committed.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def layout_section(readme: str) -> str:
    """The README's text from ``## Layout`` to the next second-level heading."""
    before, found, rest = readme.partition("\n## Layout\n")
    assert found, "README.md has no '## Layout' section after %d characters" % len(before)
    return rest.split("\n## ", 1)[0]


def layout_entries(section: str, files: set[str]) -> list[str]:
    """The files and folders (ending in ``/``) the Layout table's first column names, resolved."""
    folders = {str(Path(f).parent) + "/" for f in files}
    folders |= {p + "/" for f in folders for p in _parents(f.rstrip("/"))}
    entries: list[str] = []
    base = ""
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if token.endswith("/"):
                base = token
                entries.append(token)
            elif base and base + token in files | folders:
                entries.append(base + token)
            else:
                entries.append(token)
    return entries


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:n]) for n in range(1, len(parts))]


def _nearest_folder(path: str, folders: list[str]) -> str | None:
    return max((f for f in folders if path.startswith(f)), key=len, default=None)


def unlisted(files: set[str], entries: list[str]) -> list[str]:
    """Files the Layout does not name, nor stand for with a folder of its own."""
    folders = [e for e in entries if e.endswith("/")]
    named = {e for e in entries if not e.endswith("/")}
    itemised = {_nearest_folder(n, folders) for n in named}
    return sorted(f for f in files if f not in named and _nearest_folder(f, folders) in itemised)


def gone(files: set[str], entries: list[str]) -> list[str]:
    """Layout entries that name no file (a folder: none under it)."""
    return [e for e in entries
            if (not any(f.startswith(e) for f in files) if e.endswith("/") else e not in files)]


def checkout_files() -> set[str]:
    """git's files: tracked, and untracked but not ignored; those deleted but not yet committed left out."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return {f for f in out.splitlines() if os.path.lexists(REPO / f)}


EXAMPLE = """
## Layout

| path | what |
| --- | --- |
| `README.md` | this |
| `lib/` | the library: `lib/a.py` is described here but not listed |
| `a.py`, `sub/b.py` | modules |
| `lib/data/` | recordings |
| `gone.py` | was here |

## Next
"""


def test_the_rules_on_an_example() -> None:
    files = {"README.md", "lib/a.py", "lib/sub/b.py", "lib/c.py", "lib/data/x.json", "lib/data/y/z.txt", "top.txt"}
    entries = layout_entries(layout_section(EXAMPLE), files)
    assert entries == ["README.md", "lib/", "lib/a.py", "lib/sub/b.py", "lib/data/", "gone.py"]
    assert unlisted(files, entries) == ["lib/c.py", "top.txt"]
    assert gone(files, entries) == ["gone.py"]


def test_a_folder_with_nothing_named_in_it_stands_for_its_files() -> None:
    files = {"README.md", "results/run1/a.json", "results/run2/b.json"}
    entries = layout_entries("| `README.md`, `results/` | x |", files)
    assert unlisted(files, entries) == []
    assert gone(files | {"new.py"}, entries + ["results/run3/"]) == ["results/run3/"]


def test_the_layout_lists_every_file() -> None:
    files = checkout_files()
    assert "plugins/module_utils/constants.py" in files
    entries = layout_entries(layout_section((REPO / "README.md").read_text(encoding="utf-8")), files)
    missing = unlisted(files, entries)
    assert not missing, "README.md's Layout does not list: %s" % ", ".join(missing)


def test_the_layout_names_only_files_that_exist() -> None:
    files = checkout_files()
    entries = layout_entries(layout_section((REPO / "README.md").read_text(encoding="utf-8")), files)
    stale = gone(files, entries)
    assert not stale, "README.md's Layout names what is not in the checkout: %s" % ", ".join(stale)
    doubles = sorted({e for e in entries if entries.count(e) > 1})
    assert not doubles, "README.md's Layout names these twice: %s" % ", ".join(doubles)
