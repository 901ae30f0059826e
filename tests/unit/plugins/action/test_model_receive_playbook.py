"""model_receive through a real ansible-playbook run (connection local): a ``.part`` that an interrupted run left,
with a piece that changed on disk, resumed from where it is good and fixed; an older run's ``.part`` with a bad
piece refused by the whole file's sha256 and removed, then sent whole."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from llamafleet.core import receive_stream as rs

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[4]
MIB = 1 << 20
DATA = os.urandom(4 * MIB + 12345)
SHA = hashlib.sha256(DATA).hexdigest()

PLAYBOOK = """\
- name: Receive
  hosts: o
  gather_facts: false
  tasks:
    - name: Copy the model to the host
      llamafleet.cluster.model_receive:
        src: {src}
        dest: {dest}
        sha256: {sha}
        piece_mib: 1
        free_margin_mib: 0
      register: got

    - name: Save the result
      ansible.builtin.copy:
        content: "{{{{ got | to_json }}}}"
        dest: {tmp}/result.json
        mode: "0644"
"""


def _play(tmp: Path, ok: bool = True) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    (tmp / "result.json").unlink(missing_ok=True)
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", "o,", "-c", "local", "-e",
                           "ansible_python_interpreter=" + sys.executable, str(tmp / "play.yml")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode == 0) is ok, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc, json.loads((tmp / "result.json").read_text()) if ok else {}


def test_resume_a_corrupt_part_and_fail_closed(tmp_path: Path) -> None:
    src, dest = tmp_path / "controller.gguf", tmp_path / "host" / "m.gguf"
    part = Path(str(dest) + ".part")
    src.write_bytes(DATA)
    dest.parent.mkdir()
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(src=src, dest=dest, sha=SHA, tmp=tmp_path))
    # an interrupted run: three whole pieces recorded, then the third changed on the host's disk
    rs.receive(str(part), len(DATA), SHA, MIB, "stream", _Bytes(DATA[:3 * MIB + 100]), _Null())
    with open(part, "r+b") as handle:
        handle.seek(2 * MIB + 7)
        handle.write(bytes([DATA[2 * MIB + 7] ^ 1]))
    proc, got = _play(tmp_path)
    assert dest.read_bytes() == DATA and not part.exists()
    assert got["changed"] and got["sent_bytes"] == len(DATA) - 2 * MIB, got
    assert "is not what was sent from byte %d on" % (2 * MIB) in proc.stdout + proc.stderr
    assert "o: controller.gguf, " in proc.stdout and "MB/s" in proc.stdout

    # the piece-by-piece model_receive's .part: pieces 0 and 1 recorded without digests, one of them bad
    dest.unlink()
    part.write_bytes(DATA[:100] + b"?" + DATA[101:2 * MIB] + bytes(len(DATA) - 2 * MIB))
    Path(str(part) + ".json").write_text(json.dumps({"sha256": SHA, "size": len(DATA), "piece": MIB,
                                                     "done": [0, 1]}))
    refused = _play(tmp_path, ok=False)[0]
    assert "the pinned one is %s; it was removed" % SHA in refused.stdout
    assert not dest.exists() and not part.exists()
    _proc, got = _play(tmp_path)
    assert dest.read_bytes() == DATA and got["sent_bytes"] == len(DATA)


class _Bytes:
    """A source of bytes that stops early (a run cut off)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def read(self, size: int) -> bytes:
        block = self.data[self.at:self.at + size]
        self.at += len(block)
        return block


class _Null:
    def write(self, text: str) -> None:
        del text

    def flush(self) -> None:
        pass
