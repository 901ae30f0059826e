"""Each worker keeps only its share of the model: on the deployed lab, its rpc-server cache holds exactly the tensors
over 10 MiB that the plan gives it (sent from the controller's copy, verified), no worker holds a GGUF, a corrupted
cache file is sent again, a re-plan moves only the difference, and a load sends only the small tensors.

Runs after test_deploy.py (tests/e2e/conftest.ORDER) against the same deployed cluster.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from llamafleet.bench.cache import CACHE_DIR, reset_workers
from llamafleet.bench.runner import deployed_argv, restore_service, run_variant, stop_service
from llamafleet.core import constants
from llamafleet.core import model_share as ms
from llamafleet.core.checksum import sha256_hex
from llamafleet.lab.paths import cache_root
from tests.helpers import INVENTORY, playbook

GROUP_VARS = INVENTORY.parent / "group_vars" / "all" / "lab.yml"
THRESHOLD = 10 * 1024 * 1024


def _lab_vars() -> dict:
    return yaml.safe_load(GROUP_VARS.read_text())


def _controller_model() -> Path:
    """The verified copy the deploy fetched into the controller's cache (model_fetch_route controller)."""
    lab = _lab_vars()
    name = Path(lab["model_files"][0]["url"]).name
    path = cache_root() / "models" / lab["model_name"] / name
    assert path.is_file(), f"the deploy left no copy of {name} in the controller's cache ({path})"
    return path


def _manifest() -> dict:
    path = _controller_model()
    return ms.load_or_build_manifest([str(path)], [sha256_hex(path)], THRESHOLD, write=False)[0]


def _plan(fleet) -> dict:
    res = fleet.run(f"cat {constants.PLAN_PATH}", [fleet.orchestrator])[fleet.orchestrator.name]
    assert res.ok, res.stderr
    return json.loads(res.stdout)


def _expected(fleet) -> dict[str, set[str]]:
    """Each worker's share, computed here from the recorded plan and the controller's copy of the model."""
    plan = _plan(fleet)
    workers: dict[str, dict] = {}
    for dev in plan["devices"]:
        if dev.get("endpoint"):
            address, port = dev["endpoint"].rsplit(":", 1)
            entry = workers.setdefault(dev["endpoint"], {"host": dev["host"], "address": address, "port": int(port),
                                                         "devices": []})
            entry["devices"].append({})
    for worker in fleet.workers:  # a worker out of --rpc has an empty share
        if worker.name not in {w["host"] for w in workers.values()}:
            workers["-" + worker.name] = {"host": worker.name, "address": "0.0.0.%d" % len(workers), "port": 1,
                                          "devices": [{}]}
    manifest = _manifest()
    shares = ms.plan_shares(manifest, plan, list(workers.values()))
    return {host: {e["name"] for e in ms.share_entries(manifest, names)} for host, names in shares.items()}


def _cache_listing(fleet) -> dict[str, set[str]]:
    out = {}
    for name, res in fleet.run(f"ls -A {CACHE_DIR}", fleet.workers).items():
        assert res.ok, res.stderr
        out[name] = {f for f in res.stdout.split() if re.fullmatch(r"[0-9a-f]{16}", f)}
    return out


def _stamps(fleet) -> dict[str, dict[str, str]]:
    """Each worker's cache files with their inode and mtime: a file sent again gets new ones."""
    out = {}
    for name, res in fleet.run(f"cd {CACHE_DIR} && stat -c '%n %i %Y.%y' ????????????????", fleet.workers).items():
        out[name] = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in res.stdout.splitlines()
                     if re.match(r"^[0-9a-f]{16} ", line)}
    return out


def test_workers_hold_exactly_their_share_and_no_gguf(deployed, fleet):
    expected = _expected(fleet)
    assert any(expected.values()), "the model should have a tensor over 10 MiB on some worker"
    assert _cache_listing(fleet) == expected
    models = _lab_vars().get("model_dir", "/var/lib/llamafleet/models")
    for name, res in fleet.run(f"find {models} -name '*.gguf*' 2>/dev/null; true", fleet.workers).items():
        assert res.stdout.strip() == "", (name, res.stdout)


def test_corrupt_cache_file_is_sent_again(deployed, fleet):
    expected = _expected(fleet)
    host = next(h for h, names in sorted(expected.items()) if names)
    worker = next(w for w in fleet.workers if w.name == host)
    name = sorted(expected[host])[0]
    path = f"{CACHE_DIR}/{name}"
    # same size, wrong content: llama.cpp itself would load it without a check
    res = fleet.run(f"size=$(stat -c %s {path}) && head -c $size /dev/urandom > {path}.x && mv {path}.x {path} "
                    f"&& chown llamafleet-rpc: {path} && sha256sum {path}", [worker])[worker.name]
    assert res.ok, res.stderr
    corrupt = res.stdout.split()[0]
    run = playbook("deploy.yml")
    assert run.rc == 0, run.output[-4000:]
    after = fleet.run(f"sha256sum {path} && /opt/llamafleet/llama.cpp/current/bin/llamafleet-fnv1a64 {path} "
                      f"0:$(stat -c %s {path})", [worker])[worker.name]
    assert after.ok, after.stderr
    lines = after.stdout.split("\n")
    assert lines[0].split()[0] != corrupt
    assert lines[1].strip() == name


def test_shared_load_sends_only_small_tensors_and_answers_the_same(deployed, fleet):
    argv = deployed_argv(fleet)
    model = argv[argv.index("-m") + 1]
    hasher = str(Path(argv[0]).parent / "llamafleet-fnv1a64")
    size = int(fleet.run(f"stat -c %s {model}", [fleet.orchestrator])[fleet.orchestrator.name].stdout)
    try:
        stop_service(fleet)
        reset_workers(fleet, INVENTORY, None, hasher)
        cold = run_variant(fleet, "unseeded", argv, runs=1, n_predict=24)
        stop_service(fleet)
        reset_workers(fleet, INVENTORY, None, hasher)
        # the deploy sends each worker its share again
        run = playbook("deploy.yml")
        assert run.rc == 0, run.output[-4000:]
        stop_service(fleet)
        shared = run_variant(fleet, "shared", argv, runs=1, n_predict=24)
    finally:
        stop_service(fleet)
        restore_service(fleet)
    assert cold.bytes_to_workers > 0.9 * size, cold
    # gemma-3-270m: every tensor but token_embd (178 MB) is under 10 MiB and is always sent
    assert shared.bytes_to_workers < 0.35 * size, shared
    assert shared.content == cold.content
