"""edge_reload: HAProxy 2.6's ``show proc`` as its master CLI prints it, and main() against a stand-in systemctl and
journalctl on PATH and a stand-in master CLI on a Unix socket whose counters move when systemctl reloads (this
machine runs no systemd to reload a HAProxy unit with; the lab's real one is tests/e2e/test_edge_lab.py's)."""

from __future__ import annotations

import os
import socket
import stat
import sys
import threading
from pathlib import Path

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import edge_reload
from tests.unit.module_runner import run_main, warning_messages

# HAProxy 2.6.12 (Debian 12), after one reload that failed to bind a port.
SHOW_PROC_FAILED = """#<PID>          <type>          <reloads>       <uptime>        <version>
18047           master          1 [failed: 1]   0d00h00m07s     2.6.12-1+deb12u3
# workers
18053           worker          1               0d00h00m07s     2.6.12-1+deb12u3
# programs

"""
SHOW_PROC_FRESH = """#<PID>          <type>          <reloads>       <uptime>        <version>
19770           master          0 [failed: 0]   0d00h00m02s     2.6.12-1+deb12u3
# workers
19773           worker          0               0d00h00m01s     2.6.12-1+deb12u3
# programs

"""


def test_show_proc_gives_the_masters_reloads_and_failures() -> None:
    assert edge_reload.parse_show_proc(SHOW_PROC_FAILED) == (1, 1)
    assert edge_reload.parse_show_proc(SHOW_PROC_FRESH) == (0, 0)
    with pytest.raises(ValueError, match="no master line"):
        edge_reload.parse_show_proc("Unknown command: 'show proc'\n")


@pytest.mark.parametrize("before, after, outcome", [
    ((0, 0), (0, 0), None),    # the master has not re-executed yet
    ((0, 0), (1, 0), True),    # loaded
    ((0, 0), (1, 1), False),   # Loading failure!
    ((4, 2), (5, 2), True),
    ((4, 2), (5, 3), False),
    ((1, 1), (2, 0), True),    # measured on 2.6.12: a reload that loads after a failed one sets the count to 0
])
def test_the_outcome_waits_for_the_count_to_move(before, after, outcome) -> None:
    assert edge_reload.reload_outcome(before, after) is outcome


FAKE = """#!{python}
import sys
here = {here!r}
with open(here + "/calls.log", "a") as log:
    log.write(" ".join(sys.argv) + "\\n")
if sys.argv[0].endswith("journalctl"):
    print("[ALERT]    (1) : Binding [haproxy.cfg:9] for frontend f: cannot bind socket (Address already in use)")
    print("[WARNING]  (1) : Loading failure!")
elif sys.argv[1:2] == ["reload"]:
    open(here + "/reloaded", "w").close()
"""


class Master:
    """A master CLI on a Unix socket: ``0 [failed: 0]`` until the stand-in systemctl reloads, then ``after``; it
    refuses its first connections after the reload, as HAProxy's master does while it re-executes."""

    def __init__(self, where: Path, after: tuple[int, int]) -> None:
        self.where, self.after, self.refused = where, after, 0
        self.path = str(where / "master.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(8)
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn = self.server.accept()[0]
            except OSError:
                return
            with conn:
                reloaded = (self.where / "reloaded").exists()
                if reloaded and self.refused < 2:
                    self.refused += 1
                    continue
                conn.recv(100)
                counts = self.after if reloaded else (0, 0)
                conn.sendall(("#<PID> <type> <reloads> <uptime> <version>\n"
                              "7 master %d [failed: %d] 0d00h00m01s 2.6.12\n# workers\n" % counts).encode())

    def close(self) -> None:
        self.server.close()


@pytest.fixture()
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("systemctl", "journalctl"):
        script = tmp_path / name
        script.write_text(FAKE.format(python=sys.executable, here=str(tmp_path)))
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", "%s%s%s" % (tmp_path, os.pathsep, os.environ["PATH"]))
    return tmp_path


def reload_against(host: Path, after: tuple[int, int], timeout: int,
                   capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    """edge_reload's main() against a stand-in master whose counters read ``after`` once systemctl has reloaded."""
    master = Master(host, after)
    try:
        return run_main(edge_reload.main, {"master_socket": master.path, "timeout": timeout}, capsys)
    finally:
        master.close()


def calls(where: Path) -> list[str]:
    return [Path(line.split()[0]).name + " " + " ".join(line.split()[1:])
            for line in (where / "calls.log").read_text().splitlines()]


def test_a_reload_that_loads_reports_the_counts(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = reload_against(host, (1, 0), 10, capsys)
    assert rc == 0 and out["changed"] is True, out
    assert (out["reloads"], out["failed_reloads"]) == (1, 0)
    assert calls(host) == ["systemctl reload -- haproxy.service"]


def test_a_reload_haproxy_could_not_load_fails_with_its_journal(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = reload_against(host, (1, 1), 10, capsys)
    assert rc == 1 and out["failed"] is True, out
    assert out["msg"].startswith("haproxy.service: HAProxy could not load the new configuration (Loading failure!) "
                                 "and keeps serving the previous one"), out["msg"]
    assert "cannot bind socket (Address already in use)" in out["msg"]
    assert (out["reloads"], out["failed_reloads"]) == (1, 1)


def test_a_reload_that_never_finishes_times_out(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = reload_against(host, (0, 0), 1, capsys)
    assert rc == 1 and "did not finish the reload within 1 s (timeout)" in out["msg"], out


def test_without_a_master_cli_it_reloads_and_warns(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(edge_reload.main, {"master_socket": str(host / "absent.sock")}, capsys)
    assert rc == 0 and out["changed"] is True and out["reloads"] is None, out
    assert any("could not be read: no master CLI" in warning for warning in warning_messages(out)), out
    assert calls(host) == ["systemctl reload -- haproxy.service"]


def test_check_mode_reloads_nothing(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(edge_reload.main, {"_ansible_check_mode": True}, capsys)
    assert rc == 0 and out["changed"] is True
    assert not (host / "calls.log").exists()
