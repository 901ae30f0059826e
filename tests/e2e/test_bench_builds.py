"""bench.yml with two llama.cpp builds side by side on the lab, and every host back on its own build afterwards.

The second build is the llama.cpp release before the lab's (llama-cpp-python 0.3.35's 4df29be against 0.3.36's
0c1e570, RPC protocol 5 against 7): a real second build of another source (its own build id, compiled once, by
this test or test_upgrade.py, then taken from the controller's artifact cache), the comparison ops teams make
before they move the fleet to a new release. deploy.yml switches all hosts to it and back.
"""

from __future__ import annotations

import json

import pytest

from llamafleet.cluster import Endpoint
from tests.helpers import current_builds, playbook

MATRIX = {"bench_worker_counts": [2], "bench_latencies_ms": [0], "bench_repetitions": 2, "bench_n_predict": 16,
          "bench_concurrency": []}


@pytest.fixture(scope="module")
def builds_run(deployed, fleet, tmp_path_factory, other_llamacpp_source):
    before = current_builds(fleet)
    out = tmp_path_factory.mktemp("bench-builds")
    builds = [{"name": "b0c1e570", "vars": {}}, {"name": "b4df29be", "vars": other_llamacpp_source}]
    # a cold second build compiles llama.cpp once on the lab (about 10 minutes on 2 cores)
    run = playbook("bench.yml", "-e", json.dumps({**MATRIX, "bench_builds": builds, "bench_results_dir": str(out)}),
                   timeout=2400)
    assert run.rc == 0, run.output[-8000:]
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return run, folder, before


def test_each_build_is_measured_on_its_own_binaries(builds_run) -> None:
    run, folder, before = builds_run
    points = json.loads((folder / "results.json").read_text())["points"]
    by_build = {p["build"]: p for p in points}
    assert sorted(by_build) == ["b0c1e570", "b4df29be"] and all(p["status"] == "ok" for p in points), points
    lab, other = by_build["b0c1e570"]["build_id"], by_build["b4df29be"]["build_id"]
    assert lab and other and lab != other and other.startswith("4df29be4f-")
    assert set(before.values()) == {lab}  # the deployed build is the lab's own
    assert "build 2/2: b4df29be" in run.output
    table = (folder / "report.md").read_text()
    assert "| nodes | build | latency |" in table and "| 2 | b0c1e570 | 0 ms |" in table
    assert "| 2 | b4df29be | 0 ms |" in table


def test_every_host_is_back_on_its_build_and_deploy_changes_nothing(builds_run, fleet) -> None:
    _, _, before = builds_run
    assert current_builds(fleet) == before
    run = playbook("deploy.yml", timeout=900)
    assert run.rc == 0 and run.changed == 0, run.output[-5000:]
    endpoint = Endpoint.of(fleet)
    endpoint.wait_healthy(timeout=120)
    assert endpoint.complete("The capital of France is", n_predict=8)["timings"]["predicted_n"] == 8
