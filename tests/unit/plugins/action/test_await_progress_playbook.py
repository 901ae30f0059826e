"""The action plugin await_progress through a real ansible-playbook run on this machine (connection local): async
jobs that finish, fail and overrun, a URL (a loopback HTTP server of this test) that answers 503 then 200, one that
never does, and check mode. What a user sees: progress lines, never a RETRYING line, errors that name the host and
the variable of the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
BIN = Path(sys.executable).parent

PLAYBOOK = """\
- name: Waits
  hosts: box
  gather_facts: false
  vars:
    log: {tmp}/build.log
  tasks:
    - name: A build that writes its phase and cmake's percentage
      ansible.builtin.shell: >-
        echo "==> build things 2026-11-26T10:00:00Z" > {{{{ log }}}};
        for i in 1 2 3 4 5 6; do echo "[ ${{i}}0%] Building CXX" >> {{{{ log }}}}; sleep 1; done
      async: 60
      poll: 0
      changed_when: true
      register: ok_job
      tags: [job]

    - name: Wait for the build
      llamafleet.cluster.await_progress:
        what: building things
        jid: "{{{{ ok_job.ansible_job_id }}}}"
        timeout: 60
        timeout_var: things_timeout
        poll: 1
        every: 2
        phase_log: "{{{{ log }}}}"
        history: {tmp}/records/*/BUILDINFO.json
        history_match: {{backend: cpu}}
      register: ok_wait
      tags: [job]

    - name: A build that fails
      ansible.builtin.shell: 'echo "error: no compiler" >&2; sleep 2; exit 3'
      async: 60
      poll: 0
      changed_when: true
      register: bad_job
      tags: [job]

    - name: Wait for the failing build
      llamafleet.cluster.await_progress:
        what: building broken things
        jid: "{{{{ bad_job.ansible_job_id }}}}"
        timeout: 60
        timeout_var: things_timeout
        poll: 1
        diagnose: [echo, the end of the log]
        hint: Nothing was changed.
      register: bad_wait
      ignore_errors: true
      tags: [job]

    - name: A build that overruns its time
      ansible.builtin.command: sleep 30
      async: 3
      poll: 0
      changed_when: true
      register: slow_job
      tags: [job]

    - name: Wait for the slow build
      llamafleet.cluster.await_progress:
        what: building slow things
        jid: "{{{{ slow_job.ansible_job_id }}}}"
        timeout: 3
        timeout_var: things_timeout
        poll: 1
      register: slow_wait
      ignore_errors: true
      tags: [job]

    - name: Wait for a server that comes up
      llamafleet.cluster.await_progress:
        what: the server loading
        url: http://127.0.0.1:{port}/later
        timeout: 60
        timeout_var: server_timeout
        poll: 1
        every: 2
      register: url_wait
      tags: [url]

    - name: Wait for a server that never comes up
      llamafleet.cluster.await_progress:
        what: the stuck server loading
        url: http://127.0.0.1:{port}/never
        timeout: 3
        timeout_var: server_timeout
        poll: 1
        diagnose: [echo, journal lines]
      register: stuck_wait
      ignore_errors: true
      tags: [url]

    - name: Save the results
      ansible.builtin.copy:
        content: "{{{{ {{'ok': ok_wait | default(none), 'bad': bad_wait | default(none),
                      'slow': slow_wait | default(none), 'url': url_wait | default(none),
                      'stuck': stuck_wait | default(none)}} | to_json }}}}"
        dest: {tmp}/results.json
        mode: "0644"
      check_mode: false
      changed_when: false
      tags: [always]
"""


class _Handler(BaseHTTPRequestHandler):
    """``/later`` answers 503 for its first 4 s (from its first request), then 200; ``/never`` always 503."""

    first: dict[str, float] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        first = self.first.setdefault(self.path, time.monotonic())
        ready = self.path == "/later" and time.monotonic() - first >= 4
        body = b'{"status": "ok"}' if ready else b'{"error": {"code": 503, "message": "loading model"}}'
        self.send_response(200 if ready else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        del args


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("await")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    (tmp / "hosts.ini").write_text("box ansible_connection=local ansible_python_interpreter=%s\n" % sys.executable)
    (tmp / "play.yml").write_text(PLAYBOOK.format(tmp=tmp, port=server.server_address[1]))
    for name, record in {"old": {"backend": "cpu", "built_at": "2026-11-01T10:00:00Z", "build_seconds": 700},
                         "new": {"backend": "cpu", "built_at": "2026-11-20T10:00:00Z", "build_seconds": 460},
                         "gpu": {"backend": "vulkan", "built_at": "2026-11-25T10:00:00Z", "build_seconds": 90}}.items():
        (tmp / "records" / name).mkdir(parents=True)
        (tmp / "records" / name / "BUILDINFO.json").write_text(json.dumps(record, indent=1))
    yield tmp
    server.shutdown()
    server.server_close()


def play(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    (tmp / "results.json").unlink(missing_ok=True)
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp / "hosts.ini"), str(tmp / "play.yml"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc, json.loads((tmp / "results.json").read_text())


def test_jobs_progress_failure_and_timeout(setup: Path) -> None:
    proc, res = play(setup, "--tags", "job")
    out = proc.stdout
    assert "RETRYING" not in out and "retries left" not in out
    # progress lines with the phase and cmake's percentage, and the estimate of the newest cpu record (7m40s)
    assert "box: building things: waiting up to 1m00s (things_timeout), the last run took 7m40s" in out, out
    lines = [line for line in out.splitlines() if line.startswith("box: building things: build things ")]
    assert lines and all("% " in line or "%," in line for line in lines), out
    assert "elapsed, about 7m" in lines[0] and "left (the last run took 7m40s)" in lines[0]
    assert "box: building things: done in " in out
    assert res["ok"]["rc"] == 0 and res["ok"]["estimate"] == 460.0 and res["ok"]["elapsed"] >= 5
    assert res["ok"]["changed"] is True and not res["ok"].get("failed")
    # a failed job: the host, the work, its return code, its stderr, the hint and the diagnosis
    assert res["bad"]["failed"] is True and res["bad"]["rc"] == 3
    assert res["bad"]["msg"].startswith("box: building broken things failed after "), res["bad"]["msg"]
    assert "(rc 3)" in res["bad"]["msg"] and "error: no compiler" in res["bad"]["msg"]
    assert "Nothing was changed." in res["bad"]["msg"] and "the end of the log" in res["bad"]["msg"]
    # a job Ansible stopped at its async time: a timeout that names the variable
    assert res["slow"]["failed"] is True
    assert res["slow"]["msg"].startswith("box: building slow things did not finish within things_timeout (3 s)")
    assert "Raise things_timeout if it needs longer." in res["slow"]["msg"]


# a progress line must show while /later answers 503 (its first 4 s): starved beside make check's other workers, the
# first poll came after (make check runs this alone, before its parallel workers)
@pytest.mark.timing
def test_url_progress_timeout_and_check_mode(setup: Path) -> None:
    proc, res = play(setup, "--tags", "url")
    out = proc.stdout
    assert "RETRYING" not in out and "retries left" not in out
    assert "box: the server loading: waiting up to 1m00s (server_timeout)" in out, out
    assert "box: the server loading: HTTP 503 (loading model), " in out and "box: the server loading: done in " in out
    assert res["url"]["status"] == 200 and res["url"]["elapsed"] >= 3 and res["url"]["changed"] is False
    stuck = res["stuck"]
    assert stuck["failed"] is True
    assert stuck["msg"].startswith("box: the stuck server loading did not finish within server_timeout (3 s); last "
                                   "seen: HTTP 503 (loading model). Raise server_timeout if it needs longer."), \
        stuck["msg"]
    assert "journal lines" in stuck["msg"]
    assert "box: the stuck server loading did not finish within server_timeout" in out

    start = time.monotonic()
    checked, res = play(setup, "--tags", "url", "--check")
    assert time.monotonic() - start < 30
    assert res["url"]["skipped"] is True and res["stuck"]["skipped"] is True
    assert "check mode: the stuck server loading would be awaited" in res["stuck"]["msg"]
    assert "waiting up to" not in checked.stdout and "failed=0" in checked.stdout
