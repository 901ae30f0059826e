"""deploy.yml end to end on real lab hosts: bare hosts -> one serving cluster.

The tests run in order against one lab: the first deploy, a completion through the edge (Debian's HAProxy, on by
default) and the gate behind it, layers on every RPC device as planned, idempotence (the edge included), check mode,
a change that restarts only the orchestrator, and bad input that fails before any change.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from llamafleet.cluster import Endpoint, read_plan, server_log
from llamafleet.layout import orchestrator_layout
from llamafleet.core import constants
from llamafleet.core.log_parse import (
    buffers_against_plan,
    buffers_by_device,
    compare_with_plan,
    layer_ranges,
    parse_load_log,
)
from llamafleet.lab.artifacts import LLAMA_CPP_ARCHIVE_SUBDIR
from llamafleet.lab.core import DEFAULT_MEMORY_MIB
from tests.e2e.bad_models import make_bad_models
from tests.e2e.conftest import main_pids, nothing_changes
from tests.e2e.quiet import after_batch, once, quiet
from tests.helpers import (EVERY_TASK, FIT_CHECK_TASK, INVENTORY, MODEL_PLAY, REPO, PlaybookRun, inventory_variant,
                           listeners, playbook)


def test_first_deploy_serves(deployed, fleet):
    assert deployed.failed == 0
    endpoint = Endpoint.of(fleet)
    # with no llamafleet_edge in the inventory, HAProxy serves the clients' port, the gate behind it on loopback
    assert [line.split()[0] for line in listeners(fleet, endpoint.port)] == ["haproxy"]
    gate = json.loads(fleet.run_one(f"cat {constants.GATE_CONFIG_PATH}", fleet.orchestrator))
    assert (gate["listen_host"], gate["listen_port"]) == ("127.0.0.1", constants.LLAMA_SERVER_GATE_PORT), gate
    endpoint.wait_healthy(timeout=120)
    answer = endpoint.complete("The capital of France is", n_predict=16)
    assert answer["content"].strip(), answer
    assert answer["timings"]["predicted_n"] == 16
    # OpenAI-compatible route too
    oai = endpoint.request("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert oai["choices"][0]["text"].strip(), oai


def test_llamacpp_compiled_once(deployed, fleet):
    """A 3-host CPU lab is one build group: one build id everywhere, built by exactly one host."""
    infos = fleet.run("cat /opt/llamafleet/llama.cpp/current/BUILDINFO.json")
    records = {h: json.loads(r.stdout) for h, r in infos.items() if r.ok}
    assert len(records) == 3, infos
    assert len({r["build_id"] for r in records.values()}) == 1
    assert len({r["builder"] for r in records.values()}) == 1
    # read from the built source: what the seeding must match (llama.cpp 0c1e570: 10 MiB, protocol 7)
    assert {(r["rpc_hash_threshold"], r["rpc_protocol"]) for r in records.values()} == {(10 * 1024 * 1024, 7)}


def test_layers_on_every_rpc_device_as_planned(deployed, fleet):
    plan = read_plan(fleet)
    parsed = parse_load_log(server_log(fleet))
    seen = layer_ranges(parsed)
    rpc_devices = [d for d in plan["devices"] if d["name"].startswith("RPC")]
    assert len(rpc_devices) == len(fleet.workers)
    for dev in rpc_devices:
        got = seen.get(dev["name"], [])
        assert got, f"{dev['name']} ({dev.get('endpoint')}) holds no layers; llama.cpp log: {parsed}"
    # exactly the planned devices, order and units per device, and the planned weights on each
    assert compare_with_plan(plan, parsed) == [], parsed
    loaded = buffers_by_device(parsed, "model")
    for dev in plan["devices"]:
        assert loaded.get(dev["name"], 0.0) == pytest.approx(dev["weights_mib"], abs=0.1), (dev, loaded)
    # the KV and compute buffers too, and the orchestrator's CPU layers when the plan gives it some
    assert buffers_against_plan(plan, parsed)[1] == [], parsed["buffers"]


def test_each_cpu_worker_runs_under_a_memory_limit_that_holds_its_plan(deployed, fleet):
    """rpc_server_memory_max_mib (auto): each CPU rpc-server unit carries MemoryMax= at most the host's own limit
    (the lab's per-host cgroup) and no swap, and the planner counted no more than that limit for the device."""
    plan = read_plan(fleet)
    command = "systemctl show --property=MemoryMax,MemorySwapMax --value -- " + constants.RPC_SERVER_UNIT
    limits = {}
    for name, res in fleet.run(command, fleet.workers).items():
        assert res.ok, (name, res.stderr)
        memory_max, swap_max = res.stdout.split()
        assert swap_max == "0", (name, res.stdout)
        assert memory_max.isdigit(), (name, res.stdout)  # a number of bytes, not "infinity"
        limits[name] = int(memory_max) // (1024 * 1024)
        assert 0 < limits[name] <= DEFAULT_MEMORY_MIB, (name, limits[name])
    for dev in (d for d in plan["devices"] if not d["local"]):
        assert dev["total_mib"] <= dev["usable_mib"] <= limits[dev["host"]], (dev, limits)


def _status(url: str, key: str = "", payload: dict | None = None) -> int:
    """The HTTP status of one request to ``url`` (with ``key`` as a bearer token when given)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(payload).encode() if payload else None,
                                 method="POST" if payload else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - the lab's endpoint
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_api_needs_the_generated_key_except_health(deployed, fleet):
    """The first deploy generated a key only the service user reads; /health stays open, the rest needs it (the
    edge refuses a missing or wrong key before the gate or llama-server sees the request)."""
    orch = fleet.orchestrator
    meta = fleet.run(f"stat -c '%a %U' {constants.API_KEY_PATH}", [orch])[orch.name]
    assert meta.ok and meta.stdout.split() == ["600", "llamafleet"], meta.stdout + meta.stderr
    endpoint = Endpoint.of(fleet)
    assert len(endpoint.api_key) >= 32
    unit = fleet.run(f"systemctl cat {constants.LLAMA_SERVER_UNIT}", [orch])[orch.name].stdout
    assert f"--api-key-file {constants.API_KEY_PATH}" in unit and endpoint.api_key not in unit
    ask = {"prompt": "Hello", "n_predict": 2}
    assert _status(endpoint.url + "/health") == 200
    assert _status(endpoint.url + "/completion", payload=ask) == 401
    assert _status(endpoint.url + "/completion", "not-the-key-0123456789", payload=ask) == 401
    assert _status(endpoint.url + "/metrics") == 401
    assert _status(endpoint.url + "/v1/models") == 401
    assert _status(endpoint.url + "/completion", endpoint.api_key, payload=ask) == 200
    assert _status(endpoint.url + "/metrics", endpoint.api_key) == 200


def test_a_deploy_with_nothing_to_change_skips_the_roles_and_one_with_drift_converges(deployed, fleet):
    """A whole deploy stamps every host. The next one finds every host in sync and leaves the preflight and the roles
    out, restarting nothing. A unit file edited on one worker, a unit stopped on the other and a changed variable (one
    no role reads) in the same deploy are all named, and it converges every host and puts both right. The next plain
    deploy converges again (its inputs changed back), the one after is in sync."""
    # before the quiet batch (whose runs on other inputs re-stamp), so this first deploy finds the first deploy's
    # stamps in sync and takes seconds; it stamps anyway whatever an earlier failure left
    first = playbook("deploy.yml")
    assert first.rc == 0 and first.changed == 0, first.output[-6000:]
    with nothing_changes(fleet):
        started = time.monotonic()
        run = playbook("deploy.yml")
        seconds = time.monotonic() - started
    assert run.rc == 0 and run.recap and run.changed == 0, run.output[-6000:]
    assert deploy_said(run).startswith(IN_SYNC), run.output[-4000:]
    assert "TASK [llamafleet.cluster." not in run.output, "a role ran on a fleet in sync"
    print(f"no-change deploy, the stamps' way: {seconds:.1f} s")

    edited, stopped = fleet.workers[0], fleet.workers[-1]
    fleet.run_one(f"echo '# edited by hand' >> {STAMPED_UNIT}", edited)
    fleet.run_one(f"systemctl stop {constants.RPC_GUARD_UNIT}", stopped)
    assert fleet.run_one(f"systemctl is-active {constants.RPC_GUARD_UNIT} || true", stopped).strip() == "inactive"
    # a variable no role reads still changes the inputs: the stamps' way errs on the side of converging
    run = playbook("deploy.yml", "-e", "e2e_stamp_marker=1")
    assert run.rc == 0 and run.changed > 0, run.output[-6000:]
    said = deploy_said(run)
    assert said.startswith("Converging every host. The deploy's inputs changed"), said
    assert f"{edited.name}: {STAMPED_UNIT} changed" in said, said
    assert f"{stopped.name}: {constants.RPC_GUARD_UNIT}: ActiveState inactive" in said, said
    assert "edited by hand" not in fleet.run_one(f"cat {STAMPED_UNIT}", edited)
    assert fleet.run_one(f"systemctl is-active {constants.RPC_GUARD_UNIT}", stopped).strip() == "active"

    run = playbook("deploy.yml")
    assert run.rc == 0 and deploy_said(run).startswith("Converging every host. The deploy's inputs changed")
    run = playbook("deploy.yml")
    assert run.rc == 0 and run.changed == 0 and deploy_said(run).startswith(IN_SYNC), run.output[-4000:]


# every task runs, whatever the stamps say: the roles' own idempotence (test_a_deploy_with_nothing_to_change_...
# takes the stamps' way)
@quiet("second-deploy")
def _second_deploy(work: Path) -> PlaybookRun:
    return playbook("deploy.yml", *EVERY_TASK)


@quiet("check-diff")
def _check_diff(work: Path) -> PlaybookRun:
    return playbook("deploy.yml", "--check", "--diff", *EVERY_TASK)


def test_second_run_changes_nothing_and_restarts_nothing(quiet_runs):
    """A second deploy.yml with every task (in the quiet batch, which asserts that no unit restarted and no unit file
    changed)."""
    run = quiet_runs["second-deploy"]
    assert run.rc == 0, run.output[-6000:]
    assert run.recap and run.changed == 0, run.output[-6000:]
    assert IN_SYNC not in run.output and "TASK [llamafleet.cluster.llama_server : " in run.output, run.output[-3000:]


IN_SYNC = "Every host is as the last deploy left it: nothing to converge"
STAMPED_UNIT = "/etc/systemd/system/" + constants.RPC_SERVER_UNIT


def deploy_said(run: PlaybookRun) -> str:
    """The first play's report: nothing to converge, or why every host converges."""
    found = re.search(r"TASK \[Say whether the roles run\].*?msg: (.*?)\n\n", run.output, re.S)
    assert found, run.output[-4000:]
    said = " ".join(found.group(1).split())
    return said[1:-1].replace("''", "'") if said[:1] == "'" else said


def test_check_diff_on_converged_fleet_reports_no_change(quiet_runs):
    run = quiet_runs["check-diff"]
    assert run.rc == 0, run.output[-6000:]
    assert run.recap and run.changed == 0, run.output[-6000:]


# Four generations at once from the orchestrator itself: each a prompt of about 200 tokens and 150 generated tokens
# (ignore_eos: none stops early), 4 x 350 = 1,400 tokens in all, more than a shared cache of 1,024 holds. Prints each
# answer's status and tokens_predicted (or its error) as JSON. The API key is read from its file on the host.
FOUR_AT_ONCE = """
import json, sys, threading, urllib.error, urllib.request
url, key_file = sys.argv[1], sys.argv[2]
key = open(key_file).read().strip()
body = json.dumps({"prompt": "one two three four " * 50, "n_predict": 150, "ignore_eos": True,
                   "cache_prompt": False, "temperature": 0}).encode()
out = []
def one():
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                         "Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            out.append([resp.status, json.loads(resp.read()).get("tokens_predicted")])
    except urllib.error.HTTPError as exc:
        out.append([exc.code, exc.read().decode("utf-8", "replace")[:300]])
threads = [threading.Thread(target=one) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(out))
"""


def four_at_once(fleet, url: str) -> list:
    key_file = orchestrator_layout(fleet).api_key_file
    command = "python3 - %s %s <<'EOF'\n%s\nEOF" % (url, key_file, FOUR_AT_ONCE)
    return json.loads(fleet.run_one(command, fleet.orchestrator, timeout=240).strip().splitlines()[-1])


def test_context_change_restarts_only_the_orchestrator(deployed, fleet):
    """A smaller context restarts llama-server alone. Its 8 automatic slots share 1,024 cells: four generations that
    together need more fail all at once when they go straight to llama-server (the hazard the gate exists for, so
    this test can fail), and all answer in full through the clients' port, where the gate admits them in turn."""
    before = main_pids(fleet)
    orch = fleet.orchestrator.name
    try:
        run = playbook("deploy.yml", "-e", "llama_server_ctx_size=1024")
        assert run.rc == 0, run.output[-6000:]
        after = main_pids(fleet)
        assert after[orch].split()[0:2] != before[orch].split()[0:2]
        for worker in fleet.workers:
            assert after[worker.name] == before[worker.name], worker.name
        endpoint = Endpoint.of(fleet)
        endpoint.wait_healthy(timeout=120)
        plan = read_plan(fleet)
        assert (plan["ctx_size"], plan["n_parallel"], plan["kv_budget"], plan["max_tokens"]) == (1024, 8, 1024, 256)
        backend = int(fleet.orchestrator.var("llama_server_backend_port", constants.LLAMA_SERVER_BACKEND_PORT))
        direct = four_at_once(fleet, "http://127.0.0.1:%d/completion" % backend)
        assert [status for status, _what in direct] == [500] * 4, direct
        assert all("Context size has been exceeded" in what for _status, what in direct), direct
        gated = four_at_once(fleet, endpoint.url + "/completion")
        assert gated == [[200, 150]] * 4, gated
    finally:
        restore = playbook("deploy.yml")
        assert restore.rc == 0, restore.output[-6000:]


BAD_INPUT = [
    pytest.param(["-e", "llamacpp_build_backend=tpu"], "llamacpp_build_backend", id="unknown-backend"),
    pytest.param(["-e", '{"model_files": [{"url": "http://10.77.0.1:8089/models/gemma-3-270m-q4_k_m.gguf", "sha256": "abc"}]}'],
                 "model_files", id="malformed-sha256"),
    pytest.param(["-e", "model_name=other", "-e",
                  '{"model_files": [{"url": "http://10.77.0.1:8089/models/gemma-3-270m-q4_k_m.gguf", "sha256": "'
                  + "0" * 64 + '"}]}'], "sha256 mismatch", id="wrong-sha256"),
    pytest.param(["-e", "llamacpp_build_archive_url=http://10.77.0.1:8089/src/missing.tar.gz"],
                 "llamacpp_build_archive_url", id="unreachable-source"),
    pytest.param(["-e", "model_name=other", "-e", "model_free_margin_mib=100000000"], "GiB free", id="too-little-disk"),
    pytest.param(["-e", "llama_server_port=22"], "llama_server_port 22 is already taken", id="port-taken"),
    # module_utils/backend_checks.py, before the Vulkan header check; the lab hosts have no GPU, driver or loader
    pytest.param(["-e", "llamacpp_build_backend=vulkan"], "llamacpp_build_backend=vulkan needs a Vulkan loader",
                 id="vulkan-without-loader"),
    pytest.param(["-e", "llamacpp_build_backend=cuda"], "llamacpp_build_backend=cuda needs the NVIDIA driver",
                 id="cuda-without-driver"),
    pytest.param(["-e", "llamacpp_build_backend=metal"],
                 "llamacpp_build_backend=metal builds for macOS: macOS hosts are not supported", id="metal-on-linux"),
    # a second inventory source gives lab2 alone another archive: preflight names both sources and their hosts
    pytest.param(["-i", str(REPO / "tests" / "e2e" / "mixed_build_lab2.yml")],
                 "archive sha256 " + "1" * 64 + " subdir " + LLAMA_CPP_ARCHIVE_SUBDIR + " on lab2", id="mixed-build"),
    # an upgrade (another build id: one more CMake argument) of lab1 and lab2 only: lab3 would keep the old build
    pytest.param(["--limit", "lab1,lab2", "-e", '{"llamacpp_build_cmake_args": ["-DLLAMAFLEET_LIMIT_TEST=1"]}'],
                 ("lab1, lab2 would switch to llama.cpp build ", "while --limit leaves lab3 of the cluster out"),
                 id="upgrade-under-limit"),
    # module_utils/fleet_checks.py, the first task of deploy.yml's preflight play
    pytest.param(["-i", str(REPO / "tests" / "e2e" / "two_orchestrators.yml")],
                 "the inventory group llamafleet_orchestrator has 2 hosts (lab1, lab2)", id="two-orchestrators"),
    # lab2 again as lab2b: the rpc_server role's preflight (which changes nothing on lab2) refuses the endpoint
    pytest.param(["-i", str(REPO / "tests" / "e2e" / "duplicate_worker.yml")],
                 "two inventory hosts offer the same rpc-server endpoint (10.77.0.12:50052 on lab2 and lab2b)",
                 id="duplicate-worker"),
    pytest.param(["-e", "rpc_server_port=70000"],
                 "lab2: rpc_server_port 70000 gives ports 70000-70000, outside 1-65535", id="port-out-of-range"),
    pytest.param(["-e", "llamafleet_cluster_address=10.77.0.99"],
                 "lab2: rpc_server_bind_address=10.77.0.99 is not an address of this host (its addresses: ",
                 id="address-not-on-host"),
    # the rpc_server role's preflight (module gpu_facts, module_utils/gpu_memory.py): the host's memory is the tighter
    # of MemTotal and the cgroup limits above the unit (the lab host's own limit, when lab up gave it one)
    pytest.param(["-e", "rpc_server_memory_max_mib=100000000"],
                 ("lab2: rpc_server_memory_max_mib is 100000000 MiB, above this host's memory: ",
                  "lab3: rpc_server_memory_max_mib is 100000000 MiB"),
                 id="memory-cap-above-host"),
    # an inventory figure that claims more than the host's cgroup (or MemTotal) allows
    pytest.param(["-e", '{"rpc_server_device_overrides": [{"match": "cpu", "free_mib": 100000000}]}'],
                 "lab2: rpc_server_device_overrides[0].free_mib is 100000000 MiB, more than this host can give a "
                 "service: ", id="memory-claim-above-cgroup"),
    # rpc_plan in deploy.yml's preflight (roles/llama_server/tasks/fit_check.yml, on the controller), from the model's
    # GGUF header, before the model role: each device with its memory (the orchestrator's CPU among them on the CPU
    # lab), and what to change; the play that fetches the model never starts
    pytest.param(["-e", "llama_server_ctx_size=100000000"],
                 ("lab1: the model at ctx_size 100000000 needs ",
                  "add hosts or lower ctx_size (llama_server_ctx_size); per device: ",
                  " host lab2 ", " host lab3 ", "llama_server_cache_type q8_0",
                  FIT_CHECK_TASK + "]", "fatal: [lab1 -> localhost]"),
                 INVENTORY, (MODEL_PLAY,),
                 id="context-too-large"),
    # the edge role's preflight (the edge is on by default): HAProxy needs 2 descriptors a connection, more than any
    # host's systemd can grant (fs.nr_open is at most 1048576): refused before anything changes, with the most
    # edge_maxconn this host allows
    pytest.param(["-e", "edge_maxconn=600000"],
                 ("lab1: edge_maxconn 600000 needs 1201024 file descriptors for HAProxy", "set edge_maxconn to "),
                 id="edge-maxconn-above-descriptor-limit"),
    pytest.param(["-e", "llama_server_cpu_layers=many"],
                 ("lab1: check llama_server_port", "llama_server_cpu_layers (many: auto or a number of layers)"),
                 id="cpu-layers-not-a-number"),
]


def _without_workers(folder: Path, missing: bool) -> Path:
    """The lab inventory with an empty (or no) workers group: only lab1 is left."""
    lines, in_workers = [], False
    for line in INVENTORY.read_text().splitlines():
        if line.strip().startswith("["):
            in_workers = line.strip() == "[llamafleet_workers]"
            if in_workers and missing:
                continue
        elif in_workers and line.strip() or missing and line.strip() == "llamafleet_workers":
            continue  # the workers' lines, and the group as a child of llamafleet
        lines.append(line)
    return inventory_variant(folder, lines)


def _api_key_file(folder: Path, mode: int | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / "llama-server.key"
    if mode is not None:
        key.write_text("a-key-given-by-the-user-0123456789\n")
        key.chmod(mode)
    return key


@dataclass
class BadRun:
    """One bad-input deploy.yml: its run and the strings it must print."""

    run: PlaybookRun
    expected: tuple[str, ...]
    absent: tuple[str, ...] = ()  # strings it must not print (a play that must not start)


def _bad_deploy(extra: list[str], expected, inventory: Path = INVENTORY, absent: tuple[str, ...] = ()) -> BadRun:
    run = playbook("deploy.yml", *extra, inventory=inventory)
    return BadRun(run, (expected,) if isinstance(expected, str) else tuple(expected), tuple(absent))


for _param in BAD_INPUT:
    quiet(f"bad-input-{_param.id}")(lambda work, _values=_param.values: _bad_deploy(*_values))

KEY_FILE_CASES = {"api-key-file-missing": (None, "does not exist"),
                  "api-key-file-world-readable": (0o644, "is readable by everyone (mode 0644): chmod o-rwx it")}
for _case, (_mode, _expected) in KEY_FILE_CASES.items():
    def _key_file_case(work: Path, _mode=_mode, _expected=_expected) -> BadRun:
        key = _api_key_file(work, _mode)
        return _bad_deploy(["-e", f"llama_server_api_key_file={key}"],
                           (f"llama_server_api_key_file={key}", _expected, "lab1"))
    quiet(_case)(_key_file_case)

NO_WORKERS_CASES = {"empty": False, "missing": True}
for _case, _missing in NO_WORKERS_CASES.items():
    quiet(f"no-workers-{_case}")(lambda work, _missing=_missing: _bad_deploy(
        [], "the inventory group llamafleet_workers is %s" % ("missing" if _missing else "empty"),
        _without_workers(work, _missing)))


def _make_bad_models():
    made, written = make_bad_models()
    after_batch(lambda: [path.unlink(missing_ok=True) for path in written])
    return made


_bad_models = once(_make_bad_models)
BAD_MODEL_CASES = ["html-page", "truncated-gguf", "unknown-architecture"]
for _case in BAD_MODEL_CASES:
    quiet(f"model-{_case}")(lambda work, _case=_case: _bad_deploy(_bad_models()[_case].extra_vars(),
                                                                  tuple(_bad_models()[_case].expected)))


def assert_failed_before_any_change(bad: BadRun) -> None:
    """The run failed printing every expected string, and its recap shows no change on any host."""
    run = bad.run
    assert run.rc != 0, run.output[-4000:]
    for text in bad.expected:
        assert text in run.output, run.output[-4000:]
    for text in bad.absent:
        assert text not in run.output, run.output[-4000:]
    assert run.recap, run.output[-4000:]  # the play ran (a recap), it did not die before it started
    assert run.changed == 0, run.output[-4000:]


def assert_fails_before_any_change(fleet, extra, expected, inventory=INVENTORY) -> None:
    """One bad-input deploy.yml on its own (for a case outside the quiet batch): it fails printing ``expected`` (one
    string or several) and changes and restarts nothing."""
    with nothing_changes(fleet):
        assert_failed_before_any_change(_bad_deploy(extra, expected, inventory))


@pytest.mark.parametrize("case", [p.id for p in BAD_INPUT])
def test_bad_input_fails_before_any_change(quiet_runs, case):
    assert_failed_before_any_change(quiet_runs[f"bad-input-{case}"])


@pytest.mark.parametrize("case", list(KEY_FILE_CASES))
def test_bad_api_key_file_fails_before_any_change(quiet_runs, case):
    assert_failed_before_any_change(quiet_runs[case])


@pytest.mark.parametrize("case", BAD_MODEL_CASES)
def test_bad_model_file_fails_before_any_change(quiet_runs, case):
    """The model role's preflight reads each file's GGUF header over HTTP ranges (module_utils/fetch.py)."""
    assert_failed_before_any_change(quiet_runs[f"model-{case}"])


@pytest.mark.parametrize("missing", [False, True], ids=["empty", "missing"])
def test_no_workers_fails_before_any_change(quiet_runs, missing):
    """The lab inventory with an empty (or no) workers group: only lab1 is left, and preflight refuses."""
    assert_failed_before_any_change(quiet_runs["no-workers-" + ("missing" if missing else "empty")])


@quiet("orchestrator-moved")
def _orchestrator_moved(work: Path) -> BadRun:
    """lab2 the orchestrator and lab1 a worker, against the lab's controller record (lab1 its orchestrator): lab1
    would go on serving the old plan, so the preflight stops before any change and names the teardown to run."""
    lines = INVENTORY.read_text().splitlines()
    hosts = {line.split()[0]: line for line in lines if line.startswith(("lab1 ", "lab2 "))}
    lines = [hosts["lab1"] if line == hosts["lab2"] else hosts["lab2"] if line == hosts["lab1"] else line
             for line in lines]
    record = INVENTORY.parent / ".llamafleet" / "deployment.json"
    return _bad_deploy(["-e", f"llamafleet_controller_record={record}"],
                       ("lab1 was the orchestrator of the last deploy and stays in the fleet as worker",
                        "playbooks/teardown.yml -l lab1 first"), inventory_variant(work, lines))


def test_an_orchestrator_moved_within_the_fleet_is_refused_before_any_change(quiet_runs):
    assert_failed_before_any_change(quiet_runs["orchestrator-moved"])


@quiet("limit-one-worker")
def _limit_one_worker(work: Path) -> PlaybookRun:
    return playbook("deploy.yml", "--check", "--limit", "lab3")


def test_a_deploy_limited_to_one_worker_leaves_the_others_in_the_fleet(quiet_runs):
    """--limit lab3: lab1 and lab2 are out of the run, not out of the fleet (nothing reported or torn down)."""
    run = quiet_runs["limit-one-worker"]
    assert run.rc == 0 and run.changed == 0, run.output[-6000:]
    # (the report's words; the plays' own names say "joined or left the fleet")
    assert "left the fleet (it was" not in run.output and "joined the fleet as" not in run.output, run.output[-6000:]
    assert "left the fleet but could not be reached" not in run.output, run.output[-6000:]


@quiet("election")
def _election(work: Path) -> PlaybookRun:
    """No llamafleet_orchestrator group: the deterministic election (most GPU memory, then name) picks one."""
    text = INVENTORY.read_text()
    lines, skip = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skip = line.strip() == "[llamafleet_orchestrator]"
        if skip or line.strip() == "llamafleet_orchestrator":
            continue
        lines.append(line)
    # the orchestrator becomes a plain worker candidate
    lines.insert(lines.index("[llamafleet_workers]") + 1, next(
        ln for ln in text.splitlines() if ln.startswith("lab1 ")))
    return playbook("deploy.yml", "--check", "--tags", "election_only", "-v", timeout=600,
                    inventory=inventory_variant(work, lines))


def test_orchestrator_is_elected_when_the_inventory_pins_none(quiet_runs):
    """No llamafleet_orchestrator group: the deterministic election (most GPU memory, then name) picks one."""
    run = quiet_runs["election"]
    assert run.rc == 0, run.output[-3000:]
    assert "host_name: lab1" in run.output, run.output[-3000:]
    assert "llamafleet_orchestrator" in run.output
    # the tag selects the election and nothing else: no preflight, no role task (facts and argument
    # validation are Ansible's own, tagged always)
    with (REPO / "playbooks" / "_preflight.yml").open(encoding="utf-8") as handle:
        election = next(p for p in yaml.safe_load(handle) if "election_only" in p.get("tags", []))
    ran = set(re.findall(r"^TASK \[(.+?)\]", run.output, re.MULTILINE))
    ran = {t for t in ran if t != "Gathering Facts" and " : Validating arguments against arg spec " not in t}
    assert ran == {t["name"] for t in election["tasks"]}, sorted(ran)
