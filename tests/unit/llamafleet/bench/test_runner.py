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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ARGV = ["/opt/llamafleet/llama.cpp/current/bin/llama-server", "-m", "/m.gguf", "--rpc", "10.0.0.2:50052",
        "-ngl", "19", "-ts", "18,1", "--fit", "off"]


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


def test_deployed_argv_is_the_running_processs_own(tmp_path, connector, local, running):
    """The main process's /proc cmdline: exact even with spaces and quotes, which ExecStart's text is not."""
    proc, argv = running("--chat-template", "it's {{ x }}", "")
    env = fake_tools(tmp_path, systemctl=f'case "$*" in *MainPID*) echo {proc.pid};; *) echo;; esac')
    assert deployed_argv(one_host_fleet(connector, local(env))) == argv


def test_deployed_argv_falls_back_to_exec_start(tmp_path, connector, local):
    exec_start = f"{{ path={ARGV[0]} ; argv[]={' '.join(ARGV)} ; ignore_errors=no ; pid=0 ; code=(null) ; status=0/0 }}"
    env = fake_tools(tmp_path, systemctl=f'case "$*" in *MainPID*) echo 0;; *) echo "{exec_start}";; esac')
    assert deployed_argv(one_host_fleet(connector, local(env))) == ARGV


def test_deployed_argv_of_a_fleet_without_a_deploy(tmp_path, connector, local):
    env = fake_tools(tmp_path, systemctl="echo")
    with pytest.raises(UserError, match=f"lab1: {constants.LLAMA_SERVER_UNIT} has no command line"):
        deployed_argv(one_host_fleet(connector, local(env)))


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

@pytest.fixture
def restores(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(runner, "restore_service", lambda fleet: calls.append("restore"))
    return calls


def test_serving_paused_warns_first_and_restores(connector, restores):
    fleet = one_host_fleet(connector, None)
    out = io.StringIO()
    with serving_paused(fleet, out):
        restores.append("benchmark")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"warning: this benchmark stops {constants.LLAMA_SERVER_UNIT} on lab1")
    assert "started again at the end" in lines[0]
    assert restores == ["benchmark", "restore"]


def test_serving_paused_restores_when_the_benchmark_fails(connector, restores):
    fleet = one_host_fleet(connector, None)
    with pytest.raises(UserError, match="variant even failed"):
        with serving_paused(fleet, io.StringIO()):
            raise UserError("variant even failed")
    assert restores == ["restore"]


def test_a_failed_restore_does_not_hide_the_benchmarks_error(connector, monkeypatch):
    def broken(fleet):
        raise UserError("lab1: starting it again: unit not found")

    monkeypatch.setattr(runner, "restore_service", broken)
    fleet = one_host_fleet(connector, None)
    out = io.StringIO()
    with pytest.raises(UserError, match="variant even failed"):
        with serving_paused(fleet, out):
            raise UserError("variant even failed")
    assert "could not start" in out.getvalue() and "unit not found" in out.getvalue()
    with pytest.raises(UserError, match="unit not found"):  # after a success, the restore's error is the error
        with serving_paused(fleet, io.StringIO()):
            pass
