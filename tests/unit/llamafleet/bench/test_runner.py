"""The bench runner's pure parts and its promises: argv surgery, results, counters, the service restored."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from llamafleet.bench import runner
from llamafleet.bench.runner import (
    Measurement,
    deployed_argv,
    measurement,
    parse_exec_start,
    remove_flags,
    replace_flag,
    rx_towards,
    serving_paused,
    systemd_run_argv,
    worker_tx_bytes,
    write_results,
)
from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.facts import parse_counters, parse_route_device
from llamafleet.fleet import Fleet
from llamafleet.layout import orchestrator_layout, record_command

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ARGV = ["/opt/llamafleet/llama.cpp/current/bin/llama-server", "-m", "/m.gguf", "--rpc", "10.0.0.2:50052",
        "-ngl", "19", "-ts", "18,1", "--fit", "off"]
# The units the renamed_record fixture (conftest.py) names, and those of a host without a record.
RENAMED_UNITS = ("lf-llama-b.service", "lf-gate-b.service")
DEFAULT_UNITS = (constants.LLAMA_SERVER_UNIT, constants.GATE_UNIT)


@pytest.fixture
def record_of(renamed_record):
    """``record_of(renamed)``: the renamed record, or None (a host without a record), and its units."""
    return lambda renamed: (renamed_record, RENAMED_UNITS) if renamed else (None, DEFAULT_UNITS)


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("-ts", "1,1", ARGV[:7] + ["-ts", "1,1", "--fit", "off"]),
        ("-ts", None, ARGV[:7] + ["--fit", "off"]),
        ("-c", "2048", ARGV + ["-c", "2048"]),
        ("-c", None, ARGV),
    ],
)
def test_replace_flag(flag, value, expected):
    assert replace_flag(ARGV, flag, value) == expected


def test_remove_flags():
    assert remove_flags(ARGV, "-ts", "-ngl", "--fit") == ARGV[:5]


def test_parse_exec_start_of_systemd_252():
    text = ("{ path=/opt/llamafleet/llama.cpp/current/bin/llama-server ; argv[]=" + " ".join(ARGV) + " ; "
            "ignore_errors=no ; start_time=[Mon 2026-11-23 17:42:10 UTC] ; stop_time=[n/a] ; pid=4242 ; code=(null) ; "
            "status=0/0 }\n")
    assert parse_exec_start(text) == ARGV
    assert parse_exec_start("\n") == []  # the unit is not loaded


def fake_tools(tmp_path: Path, **scripts: str) -> dict[str, str]:
    """An environment whose PATH starts with shell scripts named after ``scripts``' keys."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def one_host_fleet(connector, answer, group=constants.GROUP_ORCHESTRATOR, hostvars=None) -> Fleet:
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["lab1"]}, constants.GROUP_WORKERS: {"hosts": ["lab2", "lab3"]},
            "_meta": {"hostvars": hostvars or {}}}
    return Fleet.from_inventory_json(data, connector(answer))


@pytest.mark.parametrize("renamed", [True, False])
def test_deployed_argv_is_the_running_processs_own(tmp_path, connector, local, recorded, record_of, running, renamed):
    """The main process's /proc cmdline: exact even with spaces and quotes, which ExecStart's text is not."""
    record, (unit, _) = record_of(renamed)
    proc, argv = running("--chat-template", "it's {{ x }}", "")
    env = fake_tools(tmp_path, systemctl=f'case "$*" in "show --property=MainPID --value -- {unit}") echo {proc.pid};; '
                                         '*) echo;; esac')
    assert deployed_argv(one_host_fleet(connector, recorded(record, local(env)))) == argv


@pytest.mark.parametrize("renamed", [True, False])
def test_deployed_argv_falls_back_to_exec_start(tmp_path, connector, local, recorded, record_of, renamed):
    record, (unit, _) = record_of(renamed)
    exec_start = f"{{ path={ARGV[0]} ; argv[]={' '.join(ARGV)} ; ignore_errors=no ; pid=0 ; code=(null) ; status=0/0 }}"
    env = fake_tools(tmp_path, systemctl=f'case "$*" in *MainPID*) echo 0;; "show --property=ExecStart --value -- {unit}") '
                                         f'echo "{exec_start}";; *) echo;; esac')
    assert deployed_argv(one_host_fleet(connector, recorded(record, local(env)))) == ARGV


@pytest.mark.parametrize("renamed", [True, False])
def test_deployed_argv_of_a_fleet_without_a_deploy(tmp_path, connector, local, recorded, record_of, renamed):
    record, (unit, _) = record_of(renamed)
    env = fake_tools(tmp_path, systemctl="echo")
    with pytest.raises(UserError, match=f"^lab1: {unit} has no command line"):
        deployed_argv(one_host_fleet(connector, recorded(record, local(env))))


def test_deployed_argv_with_the_layout_reads_no_record(tmp_path, connector, local, recorded, renamed_record):
    exec_start = f"{{ path={ARGV[0]} ; argv[]={' '.join(ARGV)} ; pid=0 ; code=(null) ; status=0/0 }}"
    env = fake_tools(tmp_path, systemctl=f'case "$*" in *MainPID*) echo 0;; *) echo "{exec_start}";; esac')
    fleet = one_host_fleet(connector, recorded(renamed_record, local(env)))
    layout = orchestrator_layout(fleet)
    fleet.connect.calls.clear()
    assert deployed_argv(fleet, layout) == ARGV
    assert len(fleet.connect.calls) == 1 and RENAMED_UNITS[0] in fleet.connect.calls[0][1]


def test_rx_towards_the_orchestrator(fixture_text):
    counters = parse_counters(fixture_text("sysfs_rx_bytes_grep_real.txt"))
    device = parse_route_device(fixture_text("ip-6.1_route_get_via_real.txt"))
    assert rx_towards(device, counters) == counters["eth0"]
    with pytest.raises(ValueError, match="no counters for interface host0"):
        rx_towards("host0", counters)


def test_worker_tx_bytes_sums_the_workers_route_interfaces(tmp_path, connector, local):
    route, counters = FIXTURES / "ip-6.1_route_get_via_real.txt", FIXTURES / "sysfs_rx_bytes_grep_real.txt"
    env = fake_tools(tmp_path, ip=f'echo "$*" >> {tmp_path}/ip.log; cat {route}', grep=f"cat {counters}")
    fleet = one_host_fleet(connector, local(env), hostvars={"lab1": {"llamafleet_cluster_address": "10.77.0.11"}})
    eth0 = parse_counters(counters.read_text())["eth0"]
    assert worker_tx_bytes(fleet) == 2 * eth0
    assert (tmp_path / "ip.log").read_text() == "-o route get 10.77.0.11\n" * 2
    assert sorted(h for h, _ in fleet.connect.calls) == ["lab2", "lab3"]


def test_measurement_takes_medians_of_the_recorded_answers(fixture_text):
    answers = json.loads(fixture_text("llama-server_completion_x3_reconstructed.json"))
    row = measurement("plan", 12.5, 1000, answers)
    speeds = sorted(a["timings"]["predicted_per_second"] for a in answers)
    prompts = sorted(a["timings"]["prompt_per_second"] for a in answers)
    assert (row.tok_s, row.prompt_tok_s) == (speeds[1], prompts[1])
    assert (row.name, row.load_s, row.bytes_to_workers, row.content) == ("plan", 12.5, 1000, answers[-1]["content"])
    with pytest.raises(ValueError, match="no completion"):
        measurement("plan", 1.0, 0, [])


def test_write_results(tmp_path):
    rows = [Measurement("plan", 1.5, 30.0, 90.0, 10, "Paris", {"model": "m"})]
    path = write_results(tmp_path / "out", "split", rows, "| table |")
    assert json.loads(path.read_text()) == [{"name": "plan", "load_s": 1.5, "tok_s": 30.0, "prompt_tok_s": 90.0,
                                             "bytes_to_workers": 10, "content": "Paris", "extra": {"model": "m"}}]
    assert (tmp_path / "out" / "split.md").read_text() == "| table |\n"


def test_systemd_run_uses_the_service_user_and_home(connector):
    fleet = one_host_fleet(connector, None, hostvars={"lab1": {"llama_server_user": "llm",
                                                               "llama_server_home": "/srv/llm"}})
    assert systemd_run_argv(fleet, ["/bin/llama-server", "-m", "x"]) == [
        "systemd-run", f"--unit={runner.BENCH_UNIT}", "--uid=llm", "--gid=llm", "--property=WorkingDirectory=/srv/llm",
        "--collect", "/bin/llama-server", "-m", "x"]
    default = one_host_fleet(connector, None)
    assert f"--uid={constants.LLAMA_SERVER_USER}" in systemd_run_argv(default, [])


# The deployed service comes back, and the user is told first

BENCH = runner.BENCH_UNIT


def nothing_else(host, command):
    """What a host answers to commands the test does not expect."""
    return 1, "", "not asked"


@pytest.mark.parametrize("renamed", [True, False])
def test_stop_and_restore_the_recorded_units(connector, recorded, record_of, server, renamed):
    record, units = record_of(renamed)
    srv = server()
    fleet = one_host_fleet(connector, recorded(record, lambda host, command: (0, "", "")),
                           hostvars={"lab1": {"llamafleet_cluster_address": "127.0.0.1",
                                              "llama_server_port": srv.port}})
    # the edge in front (HAProxy, where the deploy enabled it) is stopped too, and started again after
    edge = "systemctl is-enabled -q haproxy.service 2>/dev/null && test -d /etc/haproxy/llamafleet"
    stop = (f"systemctl stop {' '.join(units)} {BENCH}; systemctl reset-failed {BENCH}; "
            f"if {edge}; then systemctl stop haproxy.service; fi")
    start = (f"systemctl stop {BENCH}; systemctl reset-failed {BENCH}; systemctl start {' '.join(units)} && "
             f"if {edge}; then systemctl start haproxy.service; fi")
    runner.stop_service(fleet)
    runner.restore_service(fleet)
    assert fleet.connect.calls == [("lab1", record_command()), ("lab1", stop), ("lab1", record_command()),
                                   ("lab1", start)]
    fleet.connect.calls.clear()
    layout = orchestrator_layout(fleet)
    runner.stop_service(fleet, layout)
    runner.restore_service(fleet, layout)
    assert fleet.connect.calls == [("lab1", record_command()), ("lab1", stop), ("lab1", start)]
    assert srv.seen[-1][:2] == ("GET", "/health")


def test_run_variant_uses_the_layouts_units_and_key_file(connector, recorded, renamed_record, server, monkeypatch):
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    monkeypatch.setattr(runner, "measurement", lambda name, load_s, sent, answers: answers)
    srv = server(api_key="k3y")
    key = renamed_record["sections"]["llama_server"]["api_key_file"]

    def answer(host, command):
        return (0, "k3y\n", "") if command == f"cat {key}" else (0, "", "")

    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["lab1"]},
            "_meta": {"hostvars": {"lab1": {"llamafleet_cluster_address": "127.0.0.1", "llama_server_port": srv.port}}}}
    fleet = Fleet.from_inventory_json(data, connector(recorded(renamed_record, answer)))
    layout = orchestrator_layout(fleet)
    fleet.connect.calls.clear()
    answers = runner.run_variant(fleet, "plan", ["/bin/llama-server", "-m", "/m.gguf"], runs=2, layout=layout)
    assert [a["content"] for a in answers] == [runner.PROMPT[::-1]] * 2  # the key from the recorded file
    commands = [c for _, c in fleet.connect.calls]
    assert commands[:2] == [f"cat {key}", f"systemctl stop {' '.join(RENAMED_UNITS)} {BENCH}; "
                                          f"systemctl reset-failed {BENCH}; if {runner._IF_EDGE}; then "
                                          "systemctl stop haproxy.service; fi"]
    assert record_command() not in commands and commands[2].startswith(f"systemd-run --unit={BENCH} ")


def test_the_benchmark_talks_to_the_recorded_endpoint_not_the_inventorys(connector, recorded, renamed_record,
                                                                          server, monkeypatch):
    """The inventory names a port nothing listens on (changed since the deploy): waiting for the restored
    service, the warning and the variant all use the address and port the deployment record holds."""
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    monkeypatch.setattr(runner, "measurement", lambda name, load_s, sent, answers: answers)
    srv = server(api_key="k3y")
    renamed_record["sections"]["llama_server"].update(
        bind_address="127.0.0.1", port=srv.port, api_endpoint=f"http://127.0.0.1:{srv.port}")
    key = renamed_record["sections"]["llama_server"]["api_key_file"]

    def answer(host, command):
        return (0, "k3y\n", "") if command == f"cat {key}" else (0, "", "")

    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["lab1"]},
            "_meta": {"hostvars": {"lab1": {"llamafleet_cluster_address": "127.0.0.1", "llama_server_port": 9}}}}
    fleet = Fleet.from_inventory_json(data, connector(recorded(renamed_record, answer)))
    layout = orchestrator_layout(fleet)
    assert layout.endpoint == ("127.0.0.1", srv.port, False)
    assert f"(http://127.0.0.1:{srv.port})" in runner.pause_warning(fleet, layout)
    runner.restore_service(fleet, layout)
    assert srv.seen[-1][:2] == ("GET", "/health")
    answers = runner.run_variant(fleet, "plan", ["/bin/llama-server", "--port", "8080"], runs=1, layout=layout)
    assert [a["content"] for a in answers] == [runner.PROMPT[::-1]]
    run = next(c for _, c in fleet.connect.calls if c.startswith("systemd-run "))
    assert run.endswith(f"/bin/llama-server --port {srv.port} --host 127.0.0.1")


@pytest.fixture
def restores(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(runner, "restore_service", lambda fleet, layout: calls.append(f"restore {layout.llama_unit}"))
    return calls


@pytest.mark.parametrize("renamed", [True, False])
def test_serving_paused_warns_first_and_restores(connector, recorded, record_of, restores, renamed):
    record, (unit, _) = record_of(renamed)
    fleet = one_host_fleet(connector, recorded(record, nothing_else))
    out = io.StringIO()
    with serving_paused(fleet, out):
        restores.append("benchmark")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"warning: this benchmark stops {unit} on lab1")
    assert "started again at the end" in lines[0]
    assert lines[1] == f"==> {unit} is serving again"
    assert restores == ["benchmark", f"restore {unit}"]
    assert fleet.connect.calls == [("lab1", record_command())]


def test_serving_paused_restores_when_the_benchmark_fails(connector, recorded, restores):
    fleet = one_host_fleet(connector, recorded(None, nothing_else))
    with pytest.raises(UserError, match="variant even failed"):
        with serving_paused(fleet, io.StringIO()):
            raise UserError("variant even failed")
    assert restores == [f"restore {constants.LLAMA_SERVER_UNIT}"]


def test_a_failed_restore_does_not_hide_the_benchmarks_error(connector, recorded, monkeypatch):
    def broken(fleet, layout):
        raise UserError("lab1: starting it again: unit not found")

    monkeypatch.setattr(runner, "restore_service", broken)
    fleet = one_host_fleet(connector, recorded(None, nothing_else))
    out = io.StringIO()
    with pytest.raises(UserError, match="variant even failed"):
        with serving_paused(fleet, out):
            raise UserError("variant even failed")
    assert "could not start" in out.getvalue() and "unit not found" in out.getvalue()
    with pytest.raises(UserError, match="unit not found"):  # after a success, the restore's error is the error
        with serving_paused(fleet, io.StringIO()):
            pass
