"""Zero weight transfer on the deployed lab: workers' caches seeded from their own GGUF.

Runs after test_deploy.py (tests/e2e/conftest.ORDER) against the same deployed cluster.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from llamafleet.bench.runner import deployed_argv, restore_service, run_variant, stop_service
from llamafleet.bench.cache import CACHE_DIR, reset_workers
from llamafleet.core.rpc_cache import model_hashes
from llamafleet.lab.paths import LabPaths
from tests.helpers import INVENTORY, playbook

GROUP_VARS = INVENTORY.parent / "group_vars" / "all" / "lab.yml"


def _controller_model() -> Path:
    name = Path(yaml.safe_load(GROUP_VARS.read_text())["model_files"][0]["url"]).name
    found = list(LabPaths.default().root.rglob(name))
    assert found, f"the lab's copy of {name} is not under {LabPaths.default().root}"
    return found[0]


def _expected_names() -> set[str]:
    """FNV-1a 64 names of the model's tensors over 10 MiB, computed here from the controller's copy."""
    return {entry.name for entry in model_hashes(str(_controller_model()), threshold=10 * 1024 * 1024).entries}


def _cache_listing(fleet) -> dict[str, list[str]]:
    out = {}
    for name, res in fleet.run(f"ls {CACHE_DIR}", fleet.workers).items():
        assert res.ok, res.stderr
        out[name] = sorted(f for f in res.stdout.split() if len(f) == 16)
    return out


def test_worker_caches_hold_every_large_tensor_under_llamacpp_names(deployed, fleet):
    expected = _expected_names()
    assert expected, "the model should have at least one tensor over 10 MiB"
    for host, files in _cache_listing(fleet).items():
        assert set(files) == expected, (host, files, expected)


def test_corrupt_cache_file_is_replaced_not_used(deployed, fleet):
    worker = fleet.workers[0]
    name = sorted(_expected_names())[0]
    path = f"{CACHE_DIR}/{name}"
    # same size, wrong content: llama.cpp itself would load it without a check
    res = fleet.run(f"size=$(stat -c %s {path}) && head -c $size /dev/urandom > {path}.x && mv {path}.x {path} "
                    f"&& chown llamafleet-rpc: {path} && sha256sum {path}", [worker])[worker.name]
    assert res.ok, res.stderr
    corrupt = res.stdout.split()[0]
    run = playbook("deploy.yml", "--limit", worker.name, "-v")
    assert run.rc == 0, run.output[-4000:]
    assert "replaced_files" in run.output and name in run.output, run.output[-4000:]
    after = fleet.run(f"sha256sum {path} && /opt/llamafleet/llama.cpp/current/bin/llamafleet-fnv1a64 {path} 0:$(stat -c %s {path})",
                      [worker])[worker.name]
    assert after.ok, after.stderr
    lines = after.stdout.split("\n")
    assert lines[0].split()[0] != corrupt
    assert lines[1].strip() == name


def test_seeded_load_sends_only_small_tensors_and_answers_the_same(deployed, fleet):
    argv = deployed_argv(fleet)
    model = argv[argv.index("-m") + 1]
    hasher = str(Path(argv[0]).parent / "llamafleet-fnv1a64")
    size = int(fleet.run(f"stat -c %s {model}", [fleet.orchestrator])[fleet.orchestrator.name].stdout)
    try:
        stop_service(fleet)
        reset_workers(fleet, INVENTORY, None, hasher)
        cold = run_variant(fleet, "unseeded", argv, runs=1, n_predict=24)
        stop_service(fleet)
        reset_workers(fleet, INVENTORY, model, hasher)
        seeded = run_variant(fleet, "seeded", argv, runs=1, n_predict=24)
    finally:
        stop_service(fleet)
        reset_workers(fleet, INVENTORY, model, hasher)
        restore_service(fleet)
    assert cold.bytes_to_workers > 0.9 * size, cold
    # gemma-3-270m: every tensor but token_embd (178 MB) is under 10 MiB and is always sent
    assert seeded.bytes_to_workers < 0.35 * size, seeded
    assert seeded.content == cold.content
