"""bench.yml end to end on the lab: a small matrix, its report, and the fleet left as it was found.

Runs in order against the deployed lab: bad input that fails before the cluster is
touched, a non-lab inventory refused, then 2 worker counts × 2 latencies (1 repetition,
short generations), every report file written, tok/s lower at the higher latency, and a
deploy.yml re-run with changed=0 and the cluster serving.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from llamafleet.bench.report import PLOTS
from tests.e2e.quiet import quiet
from tests.helpers import INVENTORY, playbook

# auto: balanced told each link's round trip; a 200 Mbit/s cap on every link (the proxies pace it).
SMALL = {"bench_worker_counts": [1, 2], "bench_latencies_ms": [0, 20], "bench_repetitions": 1,
         "bench_n_predict": 16, "bench_sweep_n_predict": 8, "bench_concurrency": [1, 2],
         "bench_policies": ["auto"], "bench_bandwidths_mbit": [200]}

BAD_INPUT = [
    pytest.param({"bench_policies": ["fastest"]}, "bench_policies: unknown policy 'fastest'", id="unknown-policy"),
    pytest.param({"bench_latencies_ms": [0, -5]}, "bench_latencies_ms: -5 is below 0", id="negative-latency"),
    pytest.param({"bench_latencies_ms": ["soon"]}, "bench_latencies_ms: 'soon' is not a number", id="latency-nan"),
    pytest.param({"bench_worker_counts": [3]}, "bench_worker_counts: 3 workers asked, the inventory has 2",
                 id="too-many-workers"),
    pytest.param({"bench_results_dir": "/proc/llamafleet-bench"},
                 "bench_results_dir: /proc/llamafleet-bench cannot be written", id="unwritable-results"),
    pytest.param({"bench_proxy_port": 22}, "bench_proxy_port 22 is already taken", id="proxy-port-taken"),
]
for _param in BAD_INPUT:
    quiet(f"bench-{_param.id}")(lambda work, _extra=_param.values[0]: playbook("bench.yml", "-e", json.dumps(_extra),
                                                                                timeout=300))


@quiet("bench-not-the-lab")
def _not_the_lab(work: Path):
    inventory = work / "hosts.ini"
    shutil.copy(INVENTORY, inventory)  # without group_vars/all/lab.yml: llamafleet_lab is not set
    return playbook("bench.yml", timeout=300, inventory=inventory)


@pytest.mark.parametrize(("extra", "variable"), BAD_INPUT)
def test_bad_input_fails_before_the_cluster_is_touched(quiet_runs, request, extra: dict, variable: str) -> None:
    """In the quiet batch: it asserts that no unit restarted (llama-server's pid and start time among them)."""
    run = quiet_runs["bench-" + request.node.callspec.id]
    assert run.rc != 0, run.output[-3000:]
    assert variable in run.output, run.output[-3000:]
    assert "Elect the orchestrator" not in run.output  # deploy.yml's first play never ran


def test_an_inventory_that_is_not_the_lab_is_refused(quiet_runs) -> None:
    run = quiet_runs["bench-not-the-lab"]
    assert run.rc != 0 and "bench_confirm_disruption" in run.output, run.output[-3000:]


class CommandLines(threading.Thread):
    """Reads every process's command line on the controller (``/proc/*/cmdline``, what ``ps`` shows any local
    user) every 50 ms until stopped: ``hits`` holds those that contain ``secret``, ``seen`` how many lines
    held each of ``watch`` (to prove the watch saw the steps that use the key)."""

    def __init__(self, secret: str, watch: tuple[str, ...]):
        super().__init__(daemon=True)
        self.secret, self.watch = secret, watch
        self.hits: list[str] = []
        self.seen = dict.fromkeys(watch, 0)
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for path in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if self.secret in line:
                    self.hits.append(line.replace(self.secret, "<KEY>"))
                for word in self.watch:
                    self.seen[word] += word in line
            self.samples += 1
            time.sleep(0.05)  # a scan costs 3-8 ms of CPU: at 20 ms it took a third of a core from the bench


@pytest.fixture(scope="module")
def bench_run(deployed, fleet, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    key = fleet.run_one(f"cat {constants.API_KEY_PATH}", fleet.orchestrator).strip()
    assert len(key) >= 16
    watch = CommandLines(key, ("fleet_bench measure",))
    watch.start()
    try:
        run = playbook("bench.yml", "-e", json.dumps({**SMALL, "bench_results_dir": str(out)}), timeout=900)
    finally:
        watch.done.set()
        watch.join(5)
    assert run.rc == 0, run.output[-8000:]
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return run, folder, watch


def test_the_key_is_never_on_a_command_line_while_bench_runs(bench_run) -> None:
    """The controller's process table, read all along the run: the key in no command line, though the watch saw
    the measurements (which send it) run; and the controller's key file is gone at the end."""
    _run, _folder, watch = bench_run
    assert watch.seen["fleet_bench measure"] > 0 and watch.samples > 100, (watch.seen, watch.samples)
    assert watch.hits == [], watch.hits[:3]
    for folder in {Path(tempfile.gettempdir()), Path("/tmp")}:
        assert not list(folder.glob("llamafleet-bench-key.*")), folder


def test_every_report_file_is_written(bench_run) -> None:
    run, folder, _watch = bench_run
    for name in ("results.json", "points.csv", "sweep.csv", "report.md", *PLOTS):
        assert (folder / name).stat().st_size > 0, name
    points = json.loads((folder / "results.json").read_text())["points"]
    assert sorted((p["nodes"], p["latency_ms"]) for p in points) == [(1, 0), (1, 20), (2, 0), (2, 20)]
    assert all(p["status"] == "ok" for p in points), points
    for p in points:
        assert p["load_s"] and p["load_s"] > 0, p
        assert p["bandwidth_mbit"] == 200 and p["policy"] == "auto", p
        assert set(p["bytes_per_worker"]) == set(["lab2", "lab3"][:p["nodes"]]), p
        # a worker the plan gives no layers is left out of --rpc, so its proxy carries nothing
        assert sum(b > 0 for b in p["bytes_per_worker"].values()) == p["hops"], p
        assert [s["clients"] for s in p["sweep"]] == [1, 2] and all(s["errors"] == 0 for s in p["sweep"]), p
    assert "point 4/4 done" in run.output
    assert "| nodes" in (folder / "report.md").read_text()


def test_auto_uses_fewer_hops_only_where_the_round_trip_makes_it_pay(bench_run) -> None:
    _, folder, _watch = bench_run
    points = json.loads((folder / "results.json").read_text())["points"]
    chosen = {(p["nodes"], p["latency_ms"]): (p["plan_policy"], p["hops"]) for p in points}
    # the lab's own round trip (well under 1 ms) keeps the spread; 2 x 20 ms per hop does not pay on equal workers
    assert chosen[(2, 0)] == ("balanced", 2) and chosen[(2, 20)] == ("fewest_hops", 1), chosen
    assert "auto → fewest_hops" in (folder / "report.md").read_text()


def test_injected_latency_lowers_tok_s(bench_run) -> None:
    _, folder, _watch = bench_run
    points = json.loads((folder / "results.json").read_text())["points"]
    for nodes in (1, 2):
        by_latency = sorted((p["latency_ms"], p["repetitions"][0]["tok_s"]) for p in points if p["nodes"] == nodes)
        speeds = [tok_s for _, tok_s in by_latency]
        assert speeds == sorted(speeds, reverse=True) and speeds[0] > speeds[-1], (nodes, by_latency)


def test_deploy_afterwards_changes_nothing_and_serves(bench_run, fleet) -> None:
    run = playbook("deploy.yml", timeout=900)
    assert run.rc == 0 and run.changed == 0, run.output[-5000:]
    res = fleet.run("ls /run/llamafleet-bench 2>&1; systemctl list-units --all 'llamafleet-bench-proxy-*' --no-legend")
    assert all("No such file" in r.stdout and "llamafleet-bench-proxy" not in r.stdout for r in res.values()), res
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=120)
    answer = endpoint.complete("The capital of France is", n_predict=8)
    assert answer["timings"]["predicted_n"] == 8
