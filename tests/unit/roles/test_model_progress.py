"""The model role's download through a real ansible-playbook run on this machine (connection local, the route
controller), from a loopback HTTP server of this test that sends a GGUF of a few MiB slowly: progress lines with
bytes, total and rate while it runs and never a RETRYING line, the verified result registered as before, a converged
run that starts no job and waits for nothing, check mode that reports without downloading, and a download that fails
its sha256 naming the variable."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llamafleet.lab.mirror import MirrorHandler, MirrorServer
from tests.unit.gguf_testfile import write_gguf

REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
# bytes per second the server sends a whole file (the header check's ranges at full speed): the download takes about
# 4 s, in blocks of 4 MiB (fetch reads that much at a time), so the progress file changes every 0.7 s
RATE = 6 * 1024 * 1024
SIZE_MIB = 24

# One ansible-playbook run (each costs seconds): a download, the same again (converged), a small file with the route
# source (from the host), a small file whose sha256 is wrong.
PLAYBOOK = """\
- name: Download
  hosts: box
  gather_facts: false
  vars: &vars
    model_name: synth
    model_files: {files}
    model_dir: {tmp}/models
    model_controller_cache: {tmp}/cache
    model_free_margin_mib: 0
    model_download_progress_every: 1
  roles:
    - llamafleet.cluster.model
  post_tasks:
    - name: Keep the result
      ansible.builtin.set_fact:
        downloaded: {{controller: "{{{{ __model_controller }}}}", info: "{{{{ model_info }}}}"}}

- name: Converged
  hosts: box
  gather_facts: false
  vars: *vars
  roles:
    - llamafleet.cluster.model
  post_tasks:
    - name: Keep the result
      ansible.builtin.set_fact:
        converged: "{{{{ __model_controller }}}}"

- name: Each host from the source
  hosts: box
  gather_facts: false
  vars:
    <<: *vars
    model_name: small
    model_files: {small}
    model_fetch_route: source
  roles:
    - llamafleet.cluster.model
  post_tasks:
    - name: Save the results
      ansible.builtin.copy:
        content: "{{{{ {{'downloaded': downloaded, 'converged': converged, 'source': __model_fetch,
                      'source_info': model_info}} | to_json }}}}"
        dest: {tmp}/results.json
        mode: "0644"
      check_mode: false

- name: Wrong sha256
  hosts: box
  gather_facts: false
  vars:
    <<: *vars
    model_name: wrong
    model_files: {wrong}
  roles:
    - llamafleet.cluster.model
"""


# Check mode: reports, downloads nothing, starts no job.
CHECK = """\
- name: Check
  hosts: box
  gather_facts: false
  vars:
    model_name: synth
    model_files: {files}
    model_dir: {tmp}/models
    model_controller_cache: {tmp}/cache
    model_free_margin_mib: 0
  roles:
    - llamafleet.cluster.model
  post_tasks:
    - name: Save the result
      ansible.builtin.copy:
        content: "{{{{ __model_controller | to_json }}}}"
        dest: {tmp}/results.json
        mode: "0644"
      check_mode: false
"""


class _Slow:
    """The connection of a request, sending file bodies at RATE."""

    def __init__(self, sock, handler: MirrorHandler) -> None:
        self._sock, self._handler = sock, handler

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def sendfile(self, handle, offset: int = 0, count: int | None = None) -> int:
        if self._handler.headers.get("Range"):
            return self._sock.sendfile(handle, offset, count)
        handle.seek(offset)
        sent, block = 0, RATE // 10
        while count is None or sent < count:
            data = handle.read(block if count is None else min(block, count - sent))
            if not data:
                break
            self._sock.sendall(data)
            sent += len(data)
            time.sleep(0.1)
        return sent


class _SlowHandler(MirrorHandler):
    def setup(self) -> None:
        super().setup()
        self.connection = _Slow(self.connection, self)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory):
    """(base URL, the served folder, synth.gguf's sha256) of a server that sends whole files slowly."""
    root = tmp_path_factory.mktemp("source")
    write_gguf(root / "synth.gguf", {"general.architecture": "llama", "llama.block_count": 1,
                                     "llama.embedding_length": 64},
               [("blk.0.w", (1024, SIZE_MIB * 1024 // 4), 0)])
    write_gguf(root / "small.gguf", {"general.architecture": "llama", "llama.block_count": 1,
                                     "llama.embedding_length": 64}, [("blk.0.w", (64, 64), 0)])
    server = MirrorServer(("127.0.0.1", 0), root)
    server.RequestHandlerClass = _SlowHandler
    server.handle_error = lambda *args: None
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield ("http://127.0.0.1:%d" % server.server_address[1], root,
           hashlib.sha256((root / "synth.gguf").read_bytes()).hexdigest())
    server.shutdown()
    server.server_close()


def play(tmp: Path, playbook: str, *args: str) -> tuple[str, dict | None]:
    (tmp / "hosts.ini").write_text("box ansible_connection=local ansible_python_interpreter=%s\n" % sys.executable)
    (tmp / "play.yml").write_text(playbook)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp / "hosts.ini"), str(tmp / "play.yml"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    results = tmp / "results.json"
    assert results.exists(), proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(results.read_text())


def plays(out: str) -> dict[str, str]:
    """The output of each play, by its name."""
    return {part.split(" ", 1)[0].rstrip("]"): part for part in out.split("PLAY [")[1:]}


# progress lines must show while a 4-second download runs: starved by the other workers, the wait's first poll came
# after it (make check runs this alone, before its parallel workers)
@pytest.mark.timing
def test_a_download_shows_progress_a_converged_run_waits_for_nothing_and_a_bad_file_names_the_variable(
        source, tmp_path: Path) -> None:
    base, root, sha = source
    files = [{"url": base + "/synth.gguf", "sha256": sha}]
    small = [{"url": base + "/small.gguf", "sha256": hashlib.sha256((root / "small.gguf").read_bytes()).hexdigest()}]
    wrong = [dict(small[0], sha256="0" * 64)]
    out, res = play(tmp_path, PLAYBOOK.format(tmp=tmp_path, files=json.dumps(files), small=json.dumps(small),
                                              wrong=json.dumps(wrong)))
    assert "RETRYING" not in out and "retries left" not in out
    by_play = plays(out)
    first = by_play["Download"]
    assert "controller: model synth: waiting up to 24h00m (model_download_timeout)" in first, out
    lines = re.findall(r"^controller: model synth: (\d+\.\d) MiB of 24\.0 MiB \((\d+)%\), ([\d.]+) MB/s, \d+s elapsed$",
                       first, re.M)
    assert lines, out
    # the bytes grow, at about the server's rate
    assert [float(line[0]) for line in lines] == sorted(float(line[0]) for line in lines)
    assert all(3 < float(line[2]) < 9 for line in lines if float(line[0]) > 4), lines
    assert "controller: model synth: done in " in first
    got = res["downloaded"]["controller"]
    assert got["changed"] is True and got["fetched"] == ["synth.gguf"] and not got.get("failed")
    assert got["paths"] == [str(tmp_path / "cache" / "synth" / "synth.gguf")]
    assert got["bytes_needed"] == (root / "synth.gguf").stat().st_size and got["retried"] == []
    assert res["downloaded"]["info"]["paths"] == [str(tmp_path / "models" / "synth" / "synth.gguf")]
    assert (tmp_path / "models" / "synth" / "synth.gguf").read_bytes() == (root / "synth.gguf").read_bytes()
    assert sorted(os.listdir(tmp_path / "cache" / "synth")) == [".synth.gguf.verified", "synth.gguf"]

    # converged: the plain task, no job, no wait (the include is skipped), the same result
    again = by_play["Converged"]
    assert "waiting up to" not in again and "model download into the controller's cache] " not in again, again
    got = res["converged"]
    assert got["changed"] is False and got["fetched"] == [] and "ansible_job_id" not in got
    assert got["paths"] == [str(tmp_path / "cache" / "synth" / "synth.gguf")]

    # the route source: the host's own job, registered as __model_fetch
    got = res["source"]
    assert got["changed"] is True and got["fetched"] == ["small.gguf"] and not got.get("failed")
    assert got["paths"] == res["source_info"]["paths"] == [str(tmp_path / "models" / "small" / "small.gguf")]
    assert "Wait for the model download] " in by_play["Each"], by_play["Each"]

    # a download that fails: the host, the work, the module's message naming the variable; no progress file left
    bad = by_play["Wrong"]
    assert re.search(r"controller: model wrong failed after \d+s: model_files\[0\]\.url http://127\.0\.0\.1:\d+/small"
                     r"\.gguf: sha256 mismatch: expected 0{64}, got %s; the pinned sha256 or the source is wrong"
                     % small[0]["sha256"], bad), bad
    assert "failed=1" in out
    assert sorted(os.listdir(tmp_path / "cache" / "wrong")) == []
    # starting the job changed nothing: a bad download leaves a run that changed nothing (deploy's preflight promise)
    assert re.search(r"Fetch and verify the model files into the controller's cache\] \*+\nok: ", bad), bad


def test_check_mode_reports_without_downloading(source, tmp_path: Path) -> None:
    base, _root, sha = source
    files = [{"url": base + "/synth.gguf", "sha256": sha}]
    out, got = play(tmp_path, CHECK.format(tmp=tmp_path, files=json.dumps(files)), "--check", "--diff")
    assert "waiting up to" not in out and "synth.gguf: missing" in out, out
    assert got["changed"] is True and got["fetched"] == ["synth.gguf"] and "ansible_job_id" not in got
    assert not (tmp_path / "cache" / "synth").exists()
