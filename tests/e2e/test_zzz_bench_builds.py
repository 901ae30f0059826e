"""bench.yml with two llama.cpp builds side by side on the lab, and every host back on its own build afterwards.

The second build is the same source compiled without -march=native (llamacpp_build_native=false): a real
second build (its own build id, compiled once and then taken from the controller's artifact cache), the
comparison ops teams make before they trust a portable binary. deploy.yml switches all hosts to it and back.
"""

from __future__ import annotations

import json

import pytest

from llamafleet.cluster import Endpoint
from tests.helpers import playbook

BUILDS = {"bench_worker_counts": [2], "bench_latencies_ms": [0], "bench_repetitions": 2, "bench_n_predict": 16,
          "bench_concurrency": [],
          "bench_builds": [{"name": "native", "vars": {}},
                           {"name": "portable", "vars": {"llamacpp_build_native": False}}]}


def current_builds(fleet) -> dict[str, str]:
    """The build each host's /opt/llamafleet/llama.cpp/current points at."""
    res = fleet.run("readlink /opt/llamafleet/llama.cpp/current")
    return {host: r.stdout.strip() for host, r in res.items()}


@pytest.fixture(scope="module")
def builds_run(deployed, fleet, tmp_path_factory):
    before = current_builds(fleet)
    out = tmp_path_factory.mktemp("bench-builds")
    # a cold second build compiles llama.cpp once on the lab (about 12 minutes on 2 cores)
    run = playbook("bench.yml", "-e", json.dumps({**BUILDS, "bench_results_dir": str(out)}), timeout=2400)
    assert run.rc == 0, run.output[-8000:]
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return run, folder, before


def test_each_build_is_measured_on_its_own_binaries(builds_run) -> None:
    run, folder, before = builds_run
    points = json.loads((folder / "results.json").read_text())["points"]
    by_build = {p["build"]: p for p in points}
    assert sorted(by_build) == ["native", "portable"] and all(p["status"] == "ok" for p in points), points
    native, portable = by_build["native"]["build_id"], by_build["portable"]["build_id"]
    assert native and portable and native != portable
    assert set(before.values()) == {native}  # the deployed build is the native one
    assert "build 2/2: portable" in run.output
    table = (folder / "report.md").read_text()
    assert "| nodes | build | latency |" in table and "| 2 | native | 0 ms |" in table
    assert "| 2 | portable | 0 ms |" in table


def test_every_host_is_back_on_its_build_and_deploy_changes_nothing(builds_run, fleet) -> None:
    _, _, before = builds_run
    assert current_builds(fleet) == before
    run = playbook("deploy.yml", timeout=900)
    assert run.rc == 0 and run.changed == 0, run.output[-5000:]
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=120)
    assert endpoint.complete("The capital of France is", n_predict=8)["timings"]["predicted_n"] == 8
