"""host_files' main() in-process on files under tmp_path (the action plugin and the roles' use of it:
tests/unit/plugins/action/test_host_files_playbook.py): per-file ``validate`` and ``force``, ``purge`` and
``absent``, each removal in ``changed_paths``, check mode and diff."""

from __future__ import annotations

import grp
import json
import os
import pwd
import sys
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import host_files
from tests.unit.module_runner import run_main

OWNER = dict(owner=pwd.getpwuid(os.getuid()).pw_name, group=grp.getgrgid(os.getgid()).gr_name)


def args(root: Path, config: str = '{"port": 1}', kept: str = "first", **extra: Any) -> dict[str, Any]:
    return dict(
        directories=[dict(path=str(root / "plans"), **OWNER)],
        files=[dict(dest=str(root / "config.json"), content=config, validate=f"{sys.executable} -m json.tool %s",
                    **OWNER),
               dict(dest=str(root / "kept"), content=kept, force=False, **OWNER),
               dict(dest=str(root / "plans/a.conf"), content="a", **OWNER)],
        purge=[dict(path=str(root / "plans"), pattern="*.conf")],
        absent=[str(root / "old-file"), str(root / "old-dir")],
        **extra)


def test_validate_force_purge_and_absent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path
    (root / "old-dir/inner").mkdir(parents=True)
    (root / "old-dir/inner/x").write_text("x")
    (root / "old-file").write_text("old")
    rc, first = run_main(host_files.main, args(root), capsys)
    expected = [str(root / p) for p in ("plans", "config.json", "kept", "plans/a.conf", "old-file", "old-dir")]
    assert rc == 0 and first["changed_paths"] == expected
    assert not (root / "old-file").exists() and not (root / "old-dir").exists()
    assert json.loads((root / "config.json").read_text()) == {"port": 1}
    rc, again = run_main(host_files.main, args(root), capsys)
    assert rc == 0 and again["changed"] is False and again["changed_paths"] == []

    # a file kept once written is not replaced; plans no longer listed go (other names stay); check mode and diff
    # report the removals and remove nothing
    (root / "plans/b.conf").write_text("b")
    (root / "plans/notes.txt").write_text("n")
    (root / "old-file").write_text("back")
    removals = [str(root / "plans/b.conf"), str(root / "old-file")]
    rc, checked = run_main(host_files.main, args(root, kept="second", _ansible_check_mode=True, _ansible_diff=True),
                           capsys)
    assert rc == 0 and checked["changed_paths"] == removals
    assert [d["after"] for d in checked["diff"]] == [{"state": "absent"}] * 2
    assert (root / "plans/b.conf").exists() and (root / "old-file").exists()
    rc, second = run_main(host_files.main, args(root, kept="second"), capsys)
    assert rc == 0 and second["changed_paths"] == removals
    assert (root / "kept").read_text() == "first"
    assert sorted(p.name for p in (root / "plans").iterdir()) == ["a.conf", "notes.txt"]

    # content that fails validation fails, names the file and leaves it as it was, with no temporary file behind
    rc, bad = run_main(host_files.main, args(root, config="not-json"), capsys)
    assert rc == 1 and f"{root}/config.json: the new content failed validation" in bad["msg"]
    assert json.loads((root / "config.json").read_text()) == {"port": 1}
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "a temporary file was left behind"

    # a missing file kept with force false is written
    (root / "kept").unlink()
    rc, rewritten = run_main(host_files.main, args(root, kept="third"), capsys)
    assert rc == 0 and rewritten["changed_paths"] == [str(root / "kept")] and (root / "kept").read_text() == "third"
