"""rpc_metrics: the workers' textfile metrics, from recorded ss output and journal lines, and run as installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from llamafleet.core import rpc_metrics as rm
from llamafleet.core.constants import GATE_SCRIPTS, HOST_PACKAGE, RPC_METRICS_MODULE
from llamafleet.core.rpc_cache import CACHE_NAME as CACHE_NAME_OF_RPC_CACHE

MODULE_UTILS = Path(rm.__file__).resolve().parent
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "monitoring"
# the fixtures' rpc-server: ggml-rpc-server -H 127.0.0.1 -p 50391, llama-server connected (see the fixtures' README)
SERVER = rm.Server("llamafleet-rpc-server.service", "127.0.0.1", 50391)
INVOCATION = "7f3e9a1c5b2d4e6f8a0b1c2d3e4f5a6b"
ACCEPTED_AT = 1795498676.930330  # the journal's last "Accepted client connection" while llama-server was connected
CLOSED_AT = 1795498700.118038


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def ss_state(state: str) -> tuple[dict[int, tuple[int, int]], list]:
    """The listeners and established connections of one recorded state (serving, client_waiting, idle)."""
    return (rm.parse_listeners(fixture("ss_ltnH_rpc-server_%s_real.txt" % state)),
            rm.parse_ss(fixture("ss_tnH_established_rpc-server_%s_real.txt" % state)))


def fake_runner(state: str, active: bool = True, journal: str | None = "connected",
                fail: tuple[str, ...] = ()):
    """A command runner answering from the fixtures: ss for ``state``, systemctl for an active or inactive unit,
    journalctl with the ``journal`` fixture (None: no matching line); commands named in ``fail`` fail."""
    calls = []

    def run(argv: list[str]) -> str | None:
        calls.append(argv)
        if argv[0] in fail:
            return None
        if argv[:2] == ["ss", "-ltnH"]:
            return fixture("ss_ltnH_rpc-server_%s_real.txt" % state)
        if argv[:2] == ["ss", "-tnH"]:
            return fixture("ss_tnH_established_rpc-server_%s_real.txt" % state)
        if argv[0] == "systemctl":
            return ("ActiveState=active\nInvocationID=%s\n" % INVOCATION) if active else \
                "ActiveState=inactive\nInvocationID=\n"
        if argv[0] == "journalctl":
            return fixture("journalctl_252_json_rpc-server_%s_reconstructed.txt" % journal) if journal else ""
        raise AssertionError("unexpected command %r" % argv)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def values(samples: list, name: str) -> list[float]:
    return [value for metric, _labels, value in samples if metric == name]


@pytest.mark.parametrize(("text", "expected"), [
    ("10.77.0.12:50052=llamafleet-rpc-server.service", rm.Server("llamafleet-rpc-server.service", "10.77.0.12", 50052)),
    ("10.77.0.12:50053=llamafleet-rpc-server-cuda1.service",
     rm.Server("llamafleet-rpc-server-cuda1.service", "10.77.0.12", 50053)),
])
def test_parse_server(text: str, expected: rm.Server) -> None:
    assert rm.parse_server(text) == expected
    assert expected.endpoint == text.partition("=")[0]


@pytest.mark.parametrize("text", ["10.77.0.12:50052", "10.77.0.12=unit", ":50052=unit", "10.77.0.12:0=unit",
                                  "10.77.0.12:65536=unit", "10.77.0.12:port=unit", "10.77.0.12:50052="])
def test_parse_server_refuses(text: str) -> None:
    with pytest.raises(rm.MetricsError, match="ADDRESS:PORT=UNIT"):
        rm.parse_server(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("ActiveState=active\nInvocationID=%s\n" % INVOCATION, (True, INVOCATION)),
    ("InvocationID=%s\nActiveState=active\n" % INVOCATION, (True, INVOCATION)),
    ("ActiveState=activating\nInvocationID=%s\n" % INVOCATION, (False, INVOCATION)),
    ("ActiveState=inactive\nInvocationID=\n", (False, "")),
    ("", (False, "")),
])
def test_unit_run(text: str, expected: tuple[bool, str]) -> None:
    assert rm.unit_run(text) == expected


def test_unit_run_asks_for_what_it_reads() -> None:
    argv = rm.unit_run_argv("u.service")
    assert argv == ["systemctl", "show", "--property=ActiveState,InvocationID", "--", "u.service"]


def test_the_journal_query_is_the_units_run_and_the_two_lines() -> None:
    argv = rm.journal_argv(INVOCATION)
    # same field twice: either line; the invocation applies to both (journalctl(1)); the newest one
    assert argv[-3:] == ["_SYSTEMD_INVOCATION_ID=" + INVOCATION, "MESSAGE=Accepted client connection",
                         "MESSAGE=Client connection closed"]
    assert ["-r", "-n", "1"] == argv[argv.index("-r"):argv.index("-r") + 3] and "json" in argv


def test_the_lines_are_the_ones_rpc_server_prints() -> None:
    printed = {line.split(" ", 1)[1].rstrip("\n") for line in
               fixture("ggml-rpc-server_0c1e570_stdout_usec_real.txt").splitlines(keepends=True)}
    assert {rm.ACCEPTED, rm.CLOSED} <= printed


@pytest.mark.parametrize(("text", "expected"), [
    (fixture("journalctl_252_json_rpc-server_connected_reconstructed.txt"), (True, ACCEPTED_AT)),
    (fixture("journalctl_252_json_rpc-server_closed_reconstructed.txt"), (False, CLOSED_AT)),
    ("", None),
    ("not json\n", None),
    ('{"MESSAGE": "Accepted client connection"}\n', None),  # no timestamp
    ('{"MESSAGE": "Starting RPC server v7.0.0", "__REALTIME_TIMESTAMP": "1"}\n', None),
    # a message that was not valid UTF-8 comes as a list of bytes
    ('{"MESSAGE": [67, 108, 105, 101, 110, 116, 32, 99, 111, 110, 110, 101, 99, 116, 105, 111, 110, 32, 99, 108, 111,'
     ' 115, 101, 100], "__REALTIME_TIMESTAMP": "2000000"}\n', (False, 2.0)),
])
def test_last_client_event(text: str, expected) -> None:
    assert rm.last_client_event(text) == (pytest.approx(expected) if expected else None)


@pytest.mark.parametrize(("established", "queued", "served"), [(0, 0, 0), (1, 0, 1), (2, 1, 1), (1, 1, 0), (0, 1, 0)])
def test_served_clients(established: int, queued: int, served: int) -> None:
    assert rm.served_clients(established, queued) == served


@pytest.mark.parametrize(("entries", "expected"), [
    ([], (0, 0)),
    ([("f42cfb619b3cade9", 178257920), ("0123456789abcdef", 10)], (2, 178257930)),
    # the seeder's temporary files and its index are not cache files, nor are upper-case or short names
    ([(".llamafleet-tmp-f42cfb619b3cade9", 5), (".llamafleet-index.json", 7), ("F42CFB619B3CADE9", 1),
      ("f42cfb619b3cade", 1), ("f42cfb619b3cade9", 3)], (1, 3)),
])
def test_cache_usage(entries, expected) -> None:
    assert rm.cache_usage(entries) == expected


def test_cache_names_are_rpc_caches() -> None:
    assert rm.CACHE_NAME.pattern == CACHE_NAME_OF_RPC_CACHE.pattern


def test_read_cache_dir(tmp_path: Path) -> None:
    (tmp_path / "f42cfb619b3cade9").write_bytes(b"x" * 7)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "f42cfb619b3cade9")
    assert rm.read_cache_dir(str(tmp_path)) == [("f42cfb619b3cade9", 7)]
    with pytest.raises(OSError):
        rm.read_cache_dir(str(tmp_path / "missing"))


@pytest.mark.parametrize(("state", "active", "event", "up", "connected", "waiting", "since"), [
    # llama-server holds the one connection rpc-server accepted
    ("serving", True, (True, ACCEPTED_AT), 1, 1, 0, [ACCEPTED_AT]),
    # and a second client waits in the accept queue behind it (established twice, queued once)
    ("client_waiting", True, (True, ACCEPTED_AT), 1, 1, 1, [ACCEPTED_AT]),
    # llama-server gone: nothing served, and no "since" even if the journal's last line were an accept
    ("idle", True, (True, ACCEPTED_AT), 1, 0, 0, []),
    # the journal's last line is a close: connected, but when is not known
    ("serving", True, (False, CLOSED_AT), 1, 1, 0, []),
    ("serving", True, None, 1, 1, 0, []),
    # the port listens but the unit is not active (another process): not up, serving no one
    ("serving", False, (True, ACCEPTED_AT), 0, 0, 0, []),
])
def test_server_samples(state, active, event, up, connected, waiting, since) -> None:
    listeners, conns = ss_state(state)
    samples = rm.server_samples(SERVER, active, listeners, conns, event)
    assert values(samples, "llamafleet_rpc_server_up") == [up]
    assert values(samples, "llamafleet_rpc_server_client_connected") == [connected]
    assert values(samples, "llamafleet_rpc_server_clients_waiting") == [waiting]
    assert values(samples, "llamafleet_rpc_server_client_connected_since_seconds") == pytest.approx(since)
    assert all(labels == {"unit": SERVER.unit, "endpoint": "127.0.0.1:50391"} for _m, labels, _v in samples)


def test_a_port_nobody_listens_on_is_down() -> None:
    listeners, conns = ss_state("serving")
    other = rm.Server("llamafleet-rpc-server-cuda1.service", "127.0.0.1", 50392)
    samples = rm.server_samples(other, True, listeners, conns, None)
    assert values(samples, "llamafleet_rpc_server_up") == [0]


def test_without_ss_the_server_counts_as_down() -> None:
    samples = rm.server_samples(SERVER, True, None, None, (True, ACCEPTED_AT))
    assert values(samples, "llamafleet_rpc_server_up") == [0]
    assert values(samples, "llamafleet_rpc_server_client_connected") == [0]


def test_collect_reads_each_fact_once(tmp_path: Path) -> None:
    (tmp_path / "f42cfb619b3cade9").write_bytes(b"\0" * 4096)
    run = fake_runner("serving")
    samples = rm.collect([SERVER], str(tmp_path), run)
    assert values(samples, "llamafleet_rpc_server_up") == [1]
    assert values(samples, "llamafleet_rpc_server_client_connected_since_seconds") == pytest.approx([ACCEPTED_AT])
    assert (values(samples, "llamafleet_rpc_cache_files"), values(samples, "llamafleet_rpc_cache_bytes")) == ([1], [4096])
    assert values(samples, "llamafleet_rpc_metrics_errors") == [0]
    assert [argv[0] for argv in run.calls] == ["ss", "ss", "systemctl", "journalctl"]
    assert run.calls[3] == rm.journal_argv(INVOCATION)


def test_collect_asks_no_journal_for_an_inactive_unit() -> None:
    run = fake_runner("idle", active=False)
    samples = rm.collect([SERVER], None, run)
    assert [argv[0] for argv in run.calls] == ["ss", "ss", "systemctl"]
    assert values(samples, "llamafleet_rpc_server_up") == [0]
    assert values(samples, "llamafleet_rpc_cache_files") == []  # no cache directory given


@pytest.mark.parametrize(("fail", "errors", "up", "since"), [
    (("journalctl",), 1, 1, []),
    (("systemctl",), 1, 0, []),
    (("ss",), 2, 0, []),
])
def test_collect_counts_what_failed(tmp_path: Path, fail, errors, up, since) -> None:
    samples = rm.collect([SERVER], str(tmp_path / "missing"), fake_runner("serving", fail=fail))
    # the cache directory that cannot be listed is one more error, and no cache sample
    assert values(samples, "llamafleet_rpc_metrics_errors") == [errors + 1]
    assert values(samples, "llamafleet_rpc_cache_files") == []
    assert values(samples, "llamafleet_rpc_server_up") == [up]
    assert values(samples, "llamafleet_rpc_server_client_connected_since_seconds") == since


def test_render_groups_each_metric_with_its_help_and_type() -> None:
    text = rm.render([
        ("llamafleet_rpc_cache_bytes", {}, 12),
        ("llamafleet_rpc_server_up", {"unit": "b.service", "endpoint": "10.0.0.1:2"}, 0),
        ("llamafleet_rpc_server_up", {"unit": "a.service", "endpoint": "10.0.0.1:1"}, 1),
    ])
    assert text.splitlines() == [
        "# HELP llamafleet_rpc_server_up " + rm.METRICS["llamafleet_rpc_server_up"][1],
        "# TYPE llamafleet_rpc_server_up gauge",
        'llamafleet_rpc_server_up{endpoint="10.0.0.1:1",unit="a.service"} 1',
        'llamafleet_rpc_server_up{endpoint="10.0.0.1:2",unit="b.service"} 0',
        "# HELP llamafleet_rpc_cache_bytes " + rm.METRICS["llamafleet_rpc_cache_bytes"][1],
        "# TYPE llamafleet_rpc_cache_bytes gauge",
        "llamafleet_rpc_cache_bytes 12",
    ]


def test_render_escapes_label_values() -> None:
    text = rm.render([("llamafleet_rpc_server_up", {"unit": 'a"b\\c\nd'}, 1)])
    assert 'llamafleet_rpc_server_up{unit="a\\"b\\\\c\\nd"} 1' in text.splitlines()


def test_render_refuses_unknown_metrics() -> None:
    with pytest.raises(rm.MetricsError, match="llamafleet_rpc_load_seconds"):
        rm.render([("llamafleet_rpc_load_seconds", {}, 1)])


def _samples_of(text: str) -> dict[str, float]:
    """``{series: value}`` of the llamafleet samples in exposition text (node_exporter rewrites the numbers)."""
    found = {}
    for line in text.splitlines():
        if line.startswith("llamafleet_"):
            series, _sep, value = line.rpartition(" ")
            found[series] = float(value)
    return found


def test_node_exporter_serves_what_was_written() -> None:
    """The recorded node_exporter 1.5.0 (Debian 12) read the file rendered from the same fixtures (a client waiting,
    a second unit inactive, one 170 MiB cache file) without a scrape error, and served the same samples."""
    served = fixture("prometheus-node-exporter_1.5.0_types_and_textfile_real.txt")
    assert "node_textfile_scrape_error 0" in served.splitlines()
    servers = [SERVER, rm.Server("llamafleet-rpc-server-cuda1.service", "127.0.0.1", 50392)]

    def run(argv: list[str]) -> str | None:
        if argv[0] == "systemctl" and argv[-1] != SERVER.unit:
            return "ActiveState=inactive\nInvocationID=\n"
        return fake_runner("client_waiting")(argv)

    text = rm.render(rm.collect(servers, "/cache", run, list_dir=lambda _path: [("f42cfb619b3cade9", 178257920)]))
    assert _samples_of(text) == pytest.approx(_samples_of(served))
    for name, (kind, _help) in rm.METRICS.items():
        assert "# TYPE %s %s" % (name, kind) in served.splitlines()


def test_main_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "llamafleet_rpc.prom"
    assert rm.main(["--output", str(out), "127.0.0.1:50391=llamafleet-rpc-server.service"],
                   run=fake_runner("serving")) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert 'llamafleet_rpc_server_up{endpoint="127.0.0.1:50391",unit="llamafleet-rpc-server.service"} 1' in \
        out.read_text().splitlines()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary file left


@pytest.mark.parametrize("argv", [
    ["--output", "relative.prom", "127.0.0.1:1=u.service"],
    ["--output", "/tmp/x.txt", "127.0.0.1:1=u.service"],
    ["--output", "/tmp/x.prom", "127.0.0.1=u.service"],
    ["--output", "/tmp/x.prom"],
])
def test_main_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        rm.main(argv, run=fake_runner("serving"))
    assert exc.value.code == 2


def test_main_reports_an_unwritable_output(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "llamafleet_rpc.prom"
    assert rm.main(["--output", str(out), "127.0.0.1:50391=u.service"], run=fake_runner("idle")) == 1
    assert "cannot write %s" % out in capsys.readouterr().err


def test_runs_as_installed_beside_the_gate(tmp_path: Path) -> None:
    """Copied alone with the gate's modules and systemd_show.py into the host package (as the rpc_server role installs them) and run by
    python3 as a module, with ss, systemctl and journalctl that answer as recorded, it writes the file."""
    libexec, bin_dir = tmp_path / "libexec", tmp_path / "bin"
    (libexec / HOST_PACKAGE).mkdir(parents=True)
    bin_dir.mkdir()
    (libexec / HOST_PACKAGE / "__init__.py").write_text("")
    for name in ("rpc_metrics.py", *GATE_SCRIPTS, "systemd_show.py"):
        shutil.copy(MODULE_UTILS / name, libexec / HOST_PACKAGE / name)
    answers = {
        "ss": 'case "$*" in -ltnH) cat %s;; *) cat %s;; esac' % (
            FIXTURES / "ss_ltnH_rpc-server_serving_real.txt", FIXTURES / "ss_tnH_established_rpc-server_serving_real.txt"),
        "systemctl": "printf 'ActiveState=active\\nInvocationID=%s\\n'" % INVOCATION,
        "journalctl": "cat %s" % (FIXTURES / "journalctl_252_json_rpc-server_connected_reconstructed.txt"),
    }
    for name, body in answers.items():
        (bin_dir / name).write_text("#!/bin/sh\n%s\n" % body)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "textfile" / "llamafleet_rpc.prom"
    env = dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ.get("PATH", "")), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=str(libexec))
    proc = subprocess.run([sys.executable, "-s", "-m", RPC_METRICS_MODULE, "--output", str(out),
                           "127.0.0.1:50391=llamafleet-rpc-server.service"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    samples = _samples_of(out.read_text())
    labels = '{endpoint="127.0.0.1:50391",unit="llamafleet-rpc-server.service"}'
    assert samples["llamafleet_rpc_server_up" + labels] == 1
    assert samples["llamafleet_rpc_server_client_connected_since_seconds" + labels] == pytest.approx(ACCEPTED_AT)
    assert samples["llamafleet_rpc_metrics_errors"] == 0
