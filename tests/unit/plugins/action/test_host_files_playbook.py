"""host_files (action plugin and module) through real ansible-playbook runs on this machine (connection local), with
the roles' own use of it: the host package built by the host_package_files filter from real module_utils files.
A first run installs, a second changes nothing, a changed or re-moded file is put right alone, check mode and diff
report without writing, and a file whose directory is missing fails naming it."""

from __future__ import annotations

import grp
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
BIN = Path(sys.executable).parent
NAMES = ["rpc_proto.py", "systemd_show.py", "atomic_file.py"]

PLAYBOOK = """\
- name: Host files
  hosts: box
  gather_facts: false
  vars:
    helper: "#!/bin/sh\\nexec true\\n"
  tasks:
    - name: Install the package, a script and a unit
      llamafleet.cluster.host_files:
        directories:
          - {{path: "{tmp}/root/pkg", owner: {user}, group: {group}}}
          - {{path: "{tmp}/root/private", owner: {user}, group: {group}, mode: "0700"}}
        files: >-
          {{{{ {names} | llamafleet.cluster.host_package_files('{repo}/plugins/module_utils', '{tmp}/root/pkg')
             | map('combine', {{'owner': '{user}', 'group': '{group}'}}) | list
             + [{{'dest': '{tmp}/root/private/helper', 'mode': '0755', 'owner': '{user}', 'group': '{group}',
                  'content': helper}}] }}}}
      register: installed

    - name: Save the result
      ansible.builtin.copy:
        content: "{{{{ installed | to_json }}}}"
        dest: "{tmp}/result.json"
        mode: "0600"
      check_mode: false
"""

MISSING_DIR = """\
- name: Host files
  hosts: box
  gather_facts: false
  tasks:
    - name: A file whose directory is not there
      llamafleet.cluster.host_files:
        files:
          - {{dest: "{tmp}/nowhere/file.txt", content: "x", owner: {user}, group: {group}}}
"""


@pytest.fixture()
def box(tmp_path: Path) -> Path:
    (tmp_path / "hosts.ini").write_text("box ansible_connection=local ansible_python_interpreter=%s\n" % sys.executable)
    fmt = dict(tmp=tmp_path, repo=REPO, names=json.dumps(NAMES), user=pwd.getpwuid(os.getuid()).pw_name,
               group=grp.getgrgid(os.getgid()).gr_name)
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(**fmt))
    (tmp_path / "missing.yml").write_text(MISSING_DIR.format(**fmt))
    return tmp_path


def play(tmp: Path, *args: str, playbook: str = "play.yml", ok: bool = True) -> tuple[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    (tmp / "result.json").unlink(missing_ok=True)
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp / "hosts.ini"), str(tmp / playbook), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode == 0) == ok, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.loads((tmp / "result.json").read_text()) if (tmp / "result.json").exists() else {}
    return proc.stdout, result


def test_install_then_nothing_then_only_what_differs(box: Path) -> None:
    root = box / "root"
    first = play(box)[1]
    assert first["changed"] is True
    expected = [root / "pkg", root / "private", root / "pkg/__init__.py", *(root / "pkg" / n for n in NAMES),
                root / "private/helper"]
    assert first["changed_paths"] == [str(p) for p in expected]
    for name in NAMES:
        assert (root / "pkg" / name).read_bytes() == (REPO / "plugins/module_utils" / name).read_bytes()
        assert oct((root / "pkg" / name).stat().st_mode & 0o7777) == "0o644"
    assert (root / "pkg/__init__.py").read_bytes() == b""
    assert (root / "private/helper").read_text() == "#!/bin/sh\nexec true\n"
    assert oct((root / "private/helper").stat().st_mode & 0o7777) == "0o755"
    assert oct((root / "private").stat().st_mode & 0o7777) == "0o700"

    second = play(box)[1]
    assert second["changed"] is False and second["changed_paths"] == []

    # one file edited on the host, another re-moded: check mode and diff report both and write nothing
    edited = root / "pkg" / "atomic_file.py"
    edited.write_text("# edited by hand\n")
    os.chmod(root / "pkg" / "rpc_proto.py", 0o600)
    out, checked = play(box, "--check", "--diff")
    assert checked["changed_paths"] == [str(root / "pkg/rpc_proto.py"), str(edited)]
    assert "-# edited by hand" in out and "+# -*- coding: utf-8 -*-" in out
    assert edited.read_text() == "# edited by hand\n"
    assert oct((root / "pkg/rpc_proto.py").stat().st_mode & 0o7777) == "0o600"

    fixed = play(box)[1]
    assert fixed["changed_paths"] == [str(root / "pkg/rpc_proto.py"), str(edited)]
    assert edited.read_bytes() == (REPO / "plugins/module_utils/atomic_file.py").read_bytes()
    assert oct((root / "pkg/rpc_proto.py").stat().st_mode & 0o7777) == "0o644"
    assert not [p for p in (root / "pkg").iterdir() if p.name.startswith(".")], "a temporary file was left behind"


def test_check_mode_on_a_bare_host_writes_nothing(box: Path) -> None:
    checked = play(box, "--check")[1]
    assert checked["changed"] is True and len(checked["changed_paths"]) == len(NAMES) + 4
    assert not (box / "root").exists()


def test_missing_directory_is_named(box: Path) -> None:
    out = play(box, playbook="missing.yml", ok=False)[0]
    assert f"its directory {box}/nowhere does not exist" in out
