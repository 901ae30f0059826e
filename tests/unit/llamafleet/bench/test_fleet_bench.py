# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""bench.yml's controller driver: the checks that run before the cluster is touched, a point, the report."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from ansible_collections.llamafleet.cluster.plugins.filter.host_files import host_package_files
from llamafleet.bench import fleet_bench
from llamafleet.bench.report import PLOTS

REPO = Path(__file__).resolve().parents[4]

SSE = Path(__file__).resolve().parents[2] / "fixtures" / "sse"
COMPLETION = "completion_stream_0c1e570_gemma270m_real.txt"
WORKERS = ["lab2", "lab3"]


def settings(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    base = {"workers": WORKERS, "run_id": "run1", "bench_worker_counts": [], "bench_latencies_ms": [0, 5, 10, 20],
            "bench_policies": ["balanced"], "bench_proxy_mode": "compute", "bench_repetitions": 3,
            "bench_n_predict": 32, "bench_sweep_n_predict": 16, "bench_concurrency": [1, 4, 16],
            "bench_proxy_port": 50300, "bench_results_dir": str(tmp_path / "results")}
    base.update(changes)
    return base


def test_defaults_make_every_count_times_every_latency(tmp_path: Path) -> None:
    out = fleet_bench.validate(settings(tmp_path))
    assert out["errors"] == []
    assert [(p["index"], p["nodes"], p["latency_ms"], p["workers"]) for p in out["points"]] == [
        (1, 1, 0, ["lab2"]), (2, 1, 5, ["lab2"]), (3, 1, 10, ["lab2"]), (4, 1, 20, ["lab2"]),
        (5, 2, 0, WORKERS), (6, 2, 5, WORKERS), (7, 2, 10, WORKERS), (8, 2, 20, WORKERS)]
    assert out["groups"] == [{"group": "llamafleet_bench_workers_1", "workers": ["lab2"]},
                             {"group": "llamafleet_bench_workers_2", "workers": WORKERS}]
    assert {p["group"] for p in out["points"] if p["nodes"] == 2} == {"llamafleet_bench_workers_2"}
    run_dir = Path(out["run_dir"])
    assert run_dir == (tmp_path / "results" / "run1").resolve() and (run_dir / "points").is_dir()


def test_policies_multiply_the_points(tmp_path: Path) -> None:
    out = fleet_bench.validate(settings(tmp_path, bench_worker_counts=["2"], bench_latencies_ms=["0", 7.5],
                                        bench_policies=["balanced", "fewest_hops"]))
    assert [(p["policy"], p["latency_ms"]) for p in out["points"]] == [
        ("balanced", 0.0), ("balanced", 7.5), ("fewest_hops", 0.0), ("fewest_hops", 7.5)]


def test_bandwidth_caps_and_the_auto_policy_multiply_the_points(tmp_path: Path) -> None:
    out = fleet_bench.validate(settings(tmp_path, bench_worker_counts=[2], bench_latencies_ms=[0, 5],
                                        bench_policies=["auto"], bench_bandwidths_mbit=[100, "12.5"]))
    assert out["errors"] == []
    assert [(p["policy"], p["bandwidth_mbit"], p["latency_ms"]) for p in out["points"]] == [
        ("auto", 100, 0), ("auto", 100, 5), ("auto", 12.5, 0), ("auto", 12.5, 5)]
    # no caps asked: one uncapped set of points
    out = fleet_bench.validate(settings(tmp_path, bench_worker_counts=[1], bench_latencies_ms=[0]))
    assert [p["bandwidth_mbit"] for p in out["points"]] == [0.0]


def test_builds_repeat_the_matrix_and_name_the_settings_they_change(tmp_path: Path) -> None:
    builds = [{"name": "native", "vars": {}},
              {"name": "portable", "vars": {"llamacpp_build_native": False, "llamacpp_build_cmake_args": ["-DX=1"]}}]
    out = fleet_bench.validate(settings(tmp_path, bench_worker_counts=[2], bench_latencies_ms=[0, 5],
                                        bench_builds=builds))
    assert out["errors"] == []
    assert [(p["index"], p["build"], p["latency_ms"]) for p in out["points"]] == [
        (1, "native", 0), (2, "native", 5), (3, "portable", 0), (4, "portable", 5)]
    assert out["builds"] == builds
    assert out["build_keys"] == ["llamacpp_build_cmake_args", "llamacpp_build_native"]
    # without builds: the deployed build, unnamed
    out = fleet_bench.validate(settings(tmp_path, bench_worker_counts=[1], bench_latencies_ms=[0]))
    assert [p["build"] for p in out["points"]] == [""] and out["builds"] == [] and out["build_keys"] == []


@pytest.mark.parametrize(("builds", "message"), [
    ("b6000", "bench_builds must be a list of {name, vars}"),
    ([{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}], "bench_builds: 4 builds asked, bench.yml compares "
                                                                   "at most 3"),
    ([{"name": "a", "flags": []}], "bench_builds[0] must be a mapping with name and vars"),
    ([{"name": "has space"}], "bench_builds[0].name 'has space': 1-40 letters"),
    ([{"name": "a"}, {"name": "a"}], "bench_builds[1].name 'a' is used twice"),
    ([{"name": "a", "vars": ["x"]}], "bench_builds[0].vars must be a mapping of llamacpp_build variables"),
    ([{"name": "a", "vars": {"llama_server_port": 1}}], "bench_builds[0].vars: 'llama_server_port' is not a build "
                                                        "setting (use llamacpp_build_source_type"),
])
def test_bad_builds_name_the_variable(tmp_path: Path, builds: Any, message: str) -> None:
    out = fleet_bench.validate(settings(tmp_path, bench_builds=builds))
    assert any(message in e for e in out["errors"]), out["errors"]
    assert "points" not in out


@pytest.mark.parametrize(("changes", "message"), [
    ({"bench_policies": ["balanced", "fastest"]}, "bench_policies: unknown policy 'fastest' (use balanced, even, "
                                                  "fewest_hops, fit, auto)"),
    ({"bench_bandwidths_mbit": [100, -1]}, "bench_bandwidths_mbit: -1 is below 0"),
    ({"bench_sweep_seconds": "a minute"}, "bench_sweep_seconds: 'a minute' is not a number"),
    ({"bench_sweep_seconds": -60}, "bench_sweep_seconds: -60 is below 0"),
    ({"bench_bandwidths_mbit": ["fast"]}, "bench_bandwidths_mbit: 'fast' is not a number"),
    ({"bench_policies": "balanced"}, "bench_policies must be a non-empty list"),
    ({"bench_latencies_ms": [0, -5]}, "bench_latencies_ms: -5 is below 0"),
    ({"bench_latencies_ms": [0, "ten"]}, "bench_latencies_ms: 'ten' is not a number"),
    ({"bench_latencies_ms": [True]}, "bench_latencies_ms: True is not a number"),
    ({"bench_latencies_ms": [float("nan")]}, "bench_latencies_ms: nan is not a number"),
    ({"bench_latencies_ms": [5000]}, "bench_latencies_ms: 5000 is above 1000 ms"),
    ({"bench_latencies_ms": []}, "bench_latencies_ms must be a non-empty list"),
    ({"bench_worker_counts": [1, 3]}, "bench_worker_counts: 3 workers asked, the inventory has 2 (lab2, lab3)"),
    ({"bench_worker_counts": [0]}, "bench_worker_counts: 0 is below 1"),
    ({"bench_worker_counts": [1.5]}, "bench_worker_counts: 1.5 is not a whole number"),
    ({"bench_proxy_mode": "slow"}, "bench_proxy_mode: unknown mode 'slow'"),
    ({"bench_repetitions": 0}, "bench_repetitions: 0 is below 1"),
    ({"bench_n_predict": 1}, "bench_n_predict: 1 is below 2"),
    ({"bench_concurrency": [1, 300]}, "bench_concurrency: 300 is above 256 clients"),
    ({"bench_proxy_port": 65535}, "bench_proxy_port: 65535 + 2 workers runs past port 65535"),
    ({"bench_results_dir": ""}, "bench_results_dir must name a folder"),
    ({"workers": []}, "the inventory has no workers"),
])
def test_bad_input_names_the_variable(tmp_path: Path, changes: dict, message: str) -> None:
    out = fleet_bench.validate(settings(tmp_path, **changes))
    assert any(message in e for e in out["errors"]), out["errors"]
    assert "points" not in out and not (tmp_path / "results" / "run1").exists()


def test_unwritable_results_dir_is_refused(tmp_path: Path) -> None:
    """/proc takes no new folders, not even from root."""
    out = fleet_bench.validate(settings(tmp_path, bench_results_dir="/proc/llamafleet-bench"))
    assert len(out["errors"]) == 1 and out["errors"][0].startswith("bench_results_dir: /proc/llamafleet-bench cannot")


def test_results_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    out = fleet_bench.validate(settings(tmp_path, bench_results_dir=str(tmp_path / "file")))
    assert len(out["errors"]) == 1 and out["errors"][0].startswith("bench_results_dir: %s cannot be written"
                                                                     % (tmp_path / "file"))


@pytest.mark.parametrize(("index", "total", "elapsed", "line"), [
    (1, 8, 50, "point 1/8 done, 50s elapsed, about 5m50s left"),
    (4, 8, 240, "point 4/8 done, 4m00s elapsed, about 4m00s left"),
    (8, 8, 605, "point 8/8 done, 10m05s elapsed, about 0s left"),
])
def test_progress_line(index: int, total: int, elapsed: float, line: str) -> None:
    assert fleet_bench.progress_line(index, total, elapsed) == line


@pytest.mark.parametrize(("start", "line", "seconds"), [
    ("1000000000", "[ 1004.250000] lab1 llama-server[123]: main: model loaded", 4.25),
    ("  1000500000\n", "[1002.000000] lab1 llama-server[9]: main: model loaded", 1.5),
    ("1000000000", "", None),
    ("", "[ 1004.250000] x: main: model loaded", None),
    ("0", "[ 1004.250000] x: main: model loaded", None),
])
def test_load_seconds_from_the_journal(start: str, line: str, seconds: float | None) -> None:
    assert fleet_bench.load_seconds(start, line) == seconds


def _dev(name: str, count: int, local: bool = False) -> dict:
    return {"name": name, "local": local, "layers": {"count": count, "range": "0-%d" % count}}


@pytest.mark.parametrize(("plan", "hops"), [
    ({"devices": [_dev("RPC0", 18), _dev("RPC1", 1)], "excluded": []}, 2),
    ({"devices": [_dev("RPC0", 19), _dev("RPC1", 0)]}, 1),
    ({"devices": [_dev("RPC0", 9), _dev("RPC1", 9)], "excluded": [{"name": "RPC1"}]}, 1),
    ({"devices": [_dev("RPC0", 9), _dev("CUDA0", 10, local=True)]}, 1),
    ({}, None),
])
def test_rpc_hops(plan: dict, hops: int | None) -> None:
    assert fleet_bench.rpc_hops(plan) == hops


def test_bytes_per_worker_adds_a_workers_endpoints() -> None:
    got = fleet_bench.bytes_per_worker(["lab2", "lab2", "lab3"], [{"bytes_to_upstream": 10},
                                                                  {"bytes_to_upstream": 5}, {}])
    assert got == {"lab2": 15, "lab3": 0}


def test_weights_per_worker_adds_a_hosts_devices_and_leaves_local_ones_out() -> None:
    plan = {"devices": [{"name": "RPC0", "host": "lab2", "local": False, "weights_mib": 1024},
                        {"name": "RPC1", "host": "lab2", "local": False, "weights_mib": 512},
                        {"name": "RPC2", "host": "lab3", "local": False, "weights_mib": 0.5},
                        {"name": "CPU", "host": "lab1", "local": True, "weights_mib": 900},
                        {"name": "RPC3", "host": "lab4", "local": False, "weights_mib": None}]}
    assert fleet_bench.weights_per_worker(plan) == {"lab2": 1536 << 20, "lab3": 512 << 10}
    assert fleet_bench.weights_per_worker({}) == {}


def _run(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    return fleet_bench.validate(settings(tmp_path, bench_worker_counts=[1, 2], bench_latencies_ms=[0, 10], **changes))


def test_a_point_is_measured_against_a_streaming_server_and_reported(tmp_path: Path, sse_server) -> None:
    run = _run(tmp_path)
    server = sse_server(body=(SSE / COMPLETION).read_text(encoding="utf-8"), gap=0.001)
    summary = fleet_bench.run_measure({
        "run_dir": run["run_dir"], "total": 4, "point": run["points"][0], "url": server.url,
        "repetitions": 2, "n_predict": 8, "sweep_n_predict": 4, "concurrency": [1, 2],
        "plan": {"devices": [_dev("RPC0", 19)], "policy": "fewest_hops"},
        "start_usec": "5000000", "loaded_line": "[ 7.500000] lab1 llama-server[1]: main: model loaded",
        "proxy_hosts": ["lab2"], "proxy_stats": [{"bytes_to_upstream": 123456, "armed": True}],
        "build_id": "0c1e57098bba-cpu-cc8d0a3f18"})
    assert summary["status"] == "ok" and summary["tok_s"] > 0
    assert summary["load_s"] == 2.5 and summary["bytes_per_worker"] == {"lab2": 123456} and summary["hops"] == 1
    assert summary["plan_policy"] == "fewest_hops"
    assert summary["progress"].startswith("point 1/4 done, ")
    written = json.loads(Path(run["run_dir"], "points", "001.json").read_text())
    assert len(written["repetitions"]) == 2 and [s["clients"] for s in written["sweep"]] == [1, 2]
    assert written["build_id"] == "0c1e57098bba-cpu-cc8d0a3f18"
    assert len(server.requests) == 2 + 1 + 2
    # the other points did not run: each says why
    for point, status in zip(run["points"][1:], ["does not fit: plan", "failed: boom", "timeout"]):
        out = fleet_bench.run_record({"run_dir": run["run_dir"], "total": 4, "point": point, "status": status})
        assert out["status"] == (status if status != "timeout" else "failed: timeout")
    report = fleet_bench.run_report({"run_dir": run["run_dir"]})
    for name in ("results.json", "points.csv", "sweep.csv", "report.md", *PLOTS):
        assert Path(report["files"][name]).stat().st_size > 0, name
    table = "\n".join(report["table"])
    assert "does not fit: plan" in table and "failed: boom" in table


def test_a_timed_sweep_keeps_every_client_busy_for_its_seconds(tmp_path: Path, sse_server) -> None:
    run = _run(tmp_path)
    server = sse_server(body=(SSE / COMPLETION).read_text(encoding="utf-8"), gap=0.01)
    fleet_bench.run_measure({"run_dir": run["run_dir"], "total": 4, "point": run["points"][0], "url": server.url,
                             "repetitions": 1, "n_predict": 4, "sweep_n_predict": 4, "concurrency": [1, 3],
                             "sweep_seconds": 1.0})
    sweep = json.loads(Path(run["run_dir"], "points", "001.json").read_text())["sweep"]
    assert [s["clients"] for s in sweep] == [1, 3]
    for step in sweep:
        # each client sends one request after another for the second: many more requests than clients
        assert step["requests"] > 2 * step["clients"] and step["errors"] == 0 and step["wall_s"] >= 1.0, step


def test_a_point_whose_completions_fail_is_written_as_failed(tmp_path: Path) -> None:
    run = _run(tmp_path)
    summary = fleet_bench.run_measure({"run_dir": run["run_dir"], "total": 4, "point": run["points"][1],
                                       "url": "http://127.0.0.1:9", "repetitions": 1, "n_predict": 4,
                                       "concurrency": [], "timeout": 5})
    assert summary["status"].startswith("failed: ") and summary["tok_s"] is None
    assert json.loads(Path(run["run_dir"], "points", "002.json").read_text())["status"] == summary["status"]


def test_main_reads_json_and_prints_json(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(settings(tmp_path, bench_policies=["x"]))))
    assert fleet_bench.main(["validate"]) == 0
    assert json.loads(capsys.readouterr().out)["errors"][0].startswith("bench_policies: unknown policy")


def test_cli_runs_the_playbook_with_the_results_folder(tmp_path: Path) -> None:
    from llamafleet.bench import cli

    cmd = cli.fleet_command("inv/hosts.ini", str(tmp_path / "out"), ['{"bench_policies": ["even"]}'])
    assert Path(cmd[0]).name == "ansible-playbook" and cmd[1:3] == ["-i", "inv/hosts.ini"]
    # the collection's playbook by name, which resolves to this checkout's playbooks/bench.yml
    namespace, name, playbook = cli.PLAYBOOK.split(".")
    assert (namespace, name) == ("llamafleet", "cluster") and (REPO / "playbooks" / f"{playbook}.yml").is_file()
    assert cmd[3] == cli.PLAYBOOK
    assert json.loads(cmd[5]) == {"bench_results_dir": str(tmp_path / "out")}
    assert cmd[6:] == ["-e", '{"bench_policies": ["even"]}']


def test_cli_passes_no_inventory_when_none_is_given_and_the_vault_files(tmp_path: Path) -> None:
    from llamafleet.bench import cli

    cmd = cli.fleet_command(None, str(tmp_path), [], ["/secret/vault-pass"])
    assert "-i" not in cmd and cmd[1:3] == ["--vault-password-file=/secret/vault-pass", cli.PLAYBOOK]


# What bench.yml checks on the controller first, and the key it measures with (from a file, never an argument)

def test_the_bench_extra_is_read_from_the_package_metadata() -> None:
    names = [r.split(">")[0].split("=")[0].split("<")[0].strip() for r in fleet_bench.extra_requirements()]
    assert "matplotlib" in names
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert all(f'"{name}' in pyproject.split("[project.optional-dependencies]")[1].split("\n\n")[0] for name in names)


def test_the_controller_needs_name_what_is_missing_and_the_pip_extra() -> None:
    assert fleet_bench.controller_needs() == {"missing": [], "message": ""}  # this environment has the extra
    found = fleet_bench.controller_needs(["matplotlib>=3.8", "llamafleet-no-such-dist>=1", "numpy>=999"])
    assert found["missing"][0] == "llamafleet-no-such-dist>=1 (not installed)"
    assert found["missing"][1].startswith("numpy>=999 (") and found["missing"][1].endswith(" installed)")
    assert len(found["missing"]) == 2
    assert "pip install 'llamafleet[bench]'" in found["message"] and "nothing on the cluster" in found["message"]


def test_a_point_sends_the_key_read_from_its_key_file(tmp_path: Path, sse_server, monkeypatch) -> None:
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    run = _run(tmp_path)
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-the-file-0123456789\n")
    key_file.chmod(0o600)
    server = sse_server(body=(SSE / COMPLETION).read_text(encoding="utf-8"), gap=0.001,
                        api_key="sk-from-the-file-0123456789")
    summary = fleet_bench.run_measure({"run_dir": run["run_dir"], "total": 4, "point": run["points"][0],
                                       "url": server.url, "repetitions": 1, "n_predict": 4, "concurrency": [],
                                       "api_key_file": str(key_file)})
    assert summary["status"] == "ok"
    assert server.requests[0][1]["Authorization"] == "Bearer sk-from-the-file-0123456789"


def test_the_bench_role_ships_a_proxy_that_imports_on_a_bare_python(tmp_path: Path) -> None:
    """The bench role's host_files task, its expression evaluated with the library folder validate reports: the files
    it installs, laid out under a run folder, import llamafleet.bench.rpcproxy on a python3 that sees no site
    packages (so no installed llamafleet), as python3 -m runs it on the orchestrator."""
    out = fleet_bench.validate(settings(tmp_path))
    assert Path(out["library_dir"], "bench", "rpcproxy.py").is_file()
    tasks = yaml.safe_load((REPO / "roles" / "bench" / "tasks" / "main.yml").read_text(encoding="utf-8"))
    (task,) = [t["llamafleet.cluster.host_files"] for t in tasks if "llamafleet.cluster.host_files" in t]
    assert "pipe" not in json.dumps(tasks)
    env = jinja2.Environment()
    env.filters["llamafleet.cluster.host_package_files"] = host_package_files
    run_dir = tmp_path / "run"
    names = {"bench_run": out, "_bench_run_dir": str(run_dir), "role_path": str(REPO / "roles" / "bench")}
    for directory in task["directories"]:
        Path(env.from_string(directory["path"]).render(names)).mkdir(parents=True, exist_ok=True)
    files = env.compile_expression(task["files"].strip()[2:-2])(names)
    for item in files:
        dest = Path(item["dest"])
        assert dest.parent.is_dir() and run_dir in dest.parents, dest
        dest.write_text(Path(item["src"]).read_text(encoding="utf-8") if "src" in item else item["content"],
                        encoding="utf-8")
    proc = subprocess.run([sys.executable, "-S", "-c", "import llamafleet.bench.rpcproxy as m; print(m.__file__)"],
                          cwd=tmp_path, env={"PYTHONPATH": str(run_dir)}, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run_dir / "llamafleet" / "bench" / "rpcproxy.py")
