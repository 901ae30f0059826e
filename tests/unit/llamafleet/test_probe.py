"""Link probes: the remote program on its own, its output read back, and probes over this machine's loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from llamafleet import linkprobe
from llamafleet.core import constants
from llamafleet.fleet import Fleet, RunResult
from llamafleet.probe import Link, link_result, probe_links, remote_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sink_counts_what_send_sent():
    port = free_port()
    counted = {}
    thread = threading.Thread(target=lambda: counted.update(n=linkprobe.sink("127.0.0.1", port, timeout=10)))
    thread.start()
    result = linkprobe.send("127.0.0.1", port, 3)
    thread.join(10)
    assert result["bytes"] == counted["n"] == 3 * linkprobe.CHUNK
    assert result["connect_ms"] >= 0 and result["seconds"] > 0


def test_send_gives_up_when_nothing_listens():
    with pytest.raises(OSError):
        linkprobe.send("127.0.0.1", free_port(), 1, wait=0.3)


def test_the_shipped_source_runs_without_llamafleet(tmp_path):
    """What the hosts run: python3 -c SOURCE, from a directory where llamafleet cannot be imported."""
    port = free_port()
    env = {"PATH": "/usr/bin:/bin"}
    python = sys.executable
    sink = subprocess.Popen(["sh", "-c", remote_command("sink", "127.0.0.1", port).replace("python3", python, 1)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    sent = subprocess.run(["sh", "-c", remote_command("send", "127.0.0.1", port, 2).replace("python3", python, 1)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True)
    out, _ = sink.communicate(timeout=30)
    link = link_result("a", "b", RunResult("a", True, sent.stdout), None)
    assert link.error is None and link.bytes == 2 * linkprobe.CHUNK
    assert out.strip() == f'{{"bytes": {2 * linkprobe.CHUNK}}}'


def test_usage_errors():
    assert linkprobe.main(["sink"]) == 2
    assert linkprobe.main(["send", "127.0.0.1", "1"]) == 2


@pytest.mark.parametrize(
    ("sent", "sunk", "error"),
    [
        (RunResult("o", True, 'noise\n{"connect_ms": 1.5, "bytes": 2000000, "seconds": 0.5}\n'), None, None),
        (RunResult("o", False, error="TimeoutError: timed out"), RunResult("w", False, stderr="Address in use"),
         "TimeoutError: timed out (sink: Address in use)"),
        (RunResult("o", False, stderr="ConnectionRefusedError\n", exit_code=1), RunResult("w", True),
         "ConnectionRefusedError"),
        (RunResult("o", True, "Traceback...\n"), None, "unreadable probe output"),
    ],
)
def test_link_result(sent, sunk, error):
    link = link_result("o", "w", sent, sunk)
    assert link.name == "o -> w"
    if error is None:
        assert (link.connect_ms, link.bytes, link.mb_per_s) == (1.5, 2_000_000, 4.0)
    else:
        assert link.error.startswith(error) and link.mb_per_s == 0.0


def test_probe_links_over_loopback(connector, local, tmp_path):
    """Orchestrator and workers are this machine: each link really carries the bytes, one after another."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["o"]}, constants.GROUP_WORKERS: {"hosts": ["w1", "w2", "o"]},
            "_meta": {"hostvars": {h: {"llamafleet_cluster_address": "127.0.0.1"} for h in ("o", "w1", "w2")}}}
    conn = connector(local({"PATH": f"{bin_dir}:/usr/bin:/bin"}))
    port = free_port()
    links = list(probe_links(Fleet.from_inventory_json(data, conn), megabytes=2, port=port))
    assert [link.name for link in links] == ["o -> w1", "o -> w2"]  # not to itself
    assert all(isinstance(link, Link) and link.error is None and link.bytes == 2 * linkprobe.CHUNK for link in links)
    ends = sorted((host, command.rsplit("' ", 1)[1]) for host, command in conn.calls)
    assert ends == [("o", f"send 127.0.0.1 {port} 2")] * 2 + [("w1", f"sink 127.0.0.1 {port}"),
                                                              ("w2", f"sink 127.0.0.1 {port}")]
