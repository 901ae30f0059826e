"""gpu_facts module: real probes on this machine, fake tools on PATH, overrides and strict mode."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_memory import unit_procs_files
from ansible_collections.llamafleet.cluster.plugins.modules import gpu_facts
from tests.unit.module_runner import run_main, warning_messages
from tests.unit.needs import needs
from tests.unit.plugins.module_utils.test_gpu_memory import holding_process

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gpu"


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(gpu_facts.main, args, capsys)


@pytest.fixture
def fake_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only fake tools (plus what the module itself needs: timeout)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", "%s:/usr/bin:/bin" % bindir)
    return bindir


def fake_tool(bindir: Path, name: str, stdout_file: Path | None = None, rc: int = 0, stderr: str = "") -> None:
    script = bindir / name
    body = "#!/bin/sh\n"
    if stdout_file is not None:
        body += "cat '%s'\n" % stdout_file
    if stderr:
        (bindir / (name + ".stderr")).write_text(stderr + "\n")
        body += "cat '%s' >&2\n" % (bindir / (name + ".stderr"))
    body += "exit %d\n" % rc
    script.write_text(body)
    script.chmod(0o755)


def test_cpu_probe_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"backends": ["cpu"], "_ansible_check_mode": True}, capsys)
    assert rc == 0 and result["changed"] is False
    (dev,) = result["devices"]
    assert (dev["backend"], dev["ggml_name"], dev["source"]) == ("cpu", "CPU", "/proc/meminfo")
    assert dev["reserve_mib"] == 1024
    assert 0 < dev["free_mib"] <= dev["total_mib"]
    assert result["rpc_devices"] == result["devices"]
    assert result["ansible_facts"]["llamafleet_devices"] == result["devices"]
    assert result["ansible_facts"]["llamafleet_gpu_backend"] == "cpu"


def test_cuda_host_with_cap_and_reserve(fake_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_tool(fake_path, "nvidia-smi", FIXTURES / "nvidia-smi_query_nounits_2gpu_reconstructed.txt")
    rc, result = run_module({"backends": ["cuda", "rocm", "cpu"],
                             "overrides": [{"match": "cuda:0", "reserve_mib": 1024},
                                           {"match": "*3060*", "max_mib": 8000}]}, capsys)
    assert rc == 0, result
    assert result["tools"] == {"nvidia-smi": "ok", "amd-smi": "missing", "rocm-smi": "missing"}
    assert result["backend"] == "cuda"
    assert [(d["ggml_name"], d.get("reserve_mib"), d.get("max_mib")) for d in result["rpc_devices"]] == [
        ("CUDA0", 1024, None), ("CUDA1", 0, 8000)]
    assert result["devices"][-1]["backend"] == "cpu"


def test_failing_tool_is_a_warning_or_with_strict_a_failure(fake_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    fake_tool(fake_path, "nvidia-smi", rc=9, stderr="NVIDIA-SMI has failed because it couldn't communicate with "
                                                    "the NVIDIA driver.")
    rc, result = run_module({"backends": ["cuda", "cpu"]}, capsys)
    assert rc == 0
    assert result["tools"]["nvidia-smi"] == "failed"
    assert "couldn't communicate with the NVIDIA driver" in result["errors"][0]
    # ansible-core 2.19 reports warnings as {"event": {"msg": ...}}, older releases as plain strings
    warnings = warning_messages(result)
    assert any("couldn't communicate" in w for w in warnings)
    rc, result = run_module({"backends": ["cuda", "cpu"], "strict": True}, capsys)
    assert rc == 1 and result["failed"]
    assert result["msg"].startswith("device probes failed: nvidia-smi")


def test_override_that_matches_nothing_fails(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"backends": ["cpu"], "overrides": [{"match": "cuda:3", "max_mib": 1}]}, capsys)
    assert rc == 1
    assert "overrides[0] match 'cuda:3' selects none of this host's devices: cpu:0" in result["msg"]


def test_unknown_backend_fails(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"backends": ["opencl"]}, capsys)
    assert rc == 1 and "unknown backends opencl" in result["msg"]


def test_rpc_server_must_be_executable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"rpc_server": str(tmp_path / "nope")}, capsys)
    assert rc == 1 and "is not an executable file" in result["msg"]


def test_memory_max_above_the_hosts_memory_fails_naming_host_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    names = {"host": "lab2", "memory_max_mib": "rpc_server_memory_max_mib", "overrides": "rpc_server_device_overrides"}
    rc, result = run_module({"backends": ["cpu"], "memory_max_mib": 1 << 30, "names": names}, capsys)
    assert rc == 1 and result["failed"]
    assert result["msg"].startswith("lab2: rpc_server_memory_max_mib is 1073741824 MiB, above this host's memory: ")
    rc, result = run_module({"backends": ["cpu"], "names": names,
                             "overrides": [{"match": "cpu", "total_mib": 1 << 30}]}, capsys)
    assert rc == 1 and "lab2: rpc_server_device_overrides[0].total_mib is 1073741824 MiB" in result["msg"]


def test_memory_max_auto_on_a_cpu_host(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"backends": ["cpu"], "memory_max_mib": "auto", "units": ["llamafleet-rpc-server.service"],
                             "overrides": [{"match": "cpu", "max_mib": 512}]}, capsys)
    assert rc == 0, result
    assert result["memory_max_mib"] == 512
    (dev,) = result["rpc_devices"]
    assert dev["limit_mib"] == 512 and dev["limit_source"] == "memory_max_mib (the unit's MemoryMax)"
    assert dev["free_source"].startswith(("/proc/meminfo MemAvailable", "cgroup "))
    rc, result = run_module({"backends": ["cpu"]}, capsys)
    assert rc == 0 and result["memory_max_mib"] == 0 and "limit_mib" not in result["rpc_devices"][0]


# A unit of our own for the test below: its cgroup where the module looks for PID 1's units, in a hierarchy without
# the memory controller where this machine has one (v1's name=systemd or a hybrid host's unified), as in a lab host.
TEST_UNIT = "llamafleet-test-rss-%d.service" % os.getpid()


def writable_procs_file() -> str | None:
    """The unit's cgroup.procs the module reads, in the first cgroup hierarchy here that root may write."""
    with open("/proc/1/cgroup", encoding="utf-8") as handle:
        candidates = unit_procs_files(handle.read(), TEST_UNIT)
    for path in sorted(candidates, key=lambda p: "/systemd/" not in p):
        top = Path(path).parents[2]  # the hierarchy's folder of PID 1's units (system.slice's parent)
        if (top / "cgroup.procs").is_file() and os.access(top, os.W_OK):
            return path
    return None


@contextlib.contextmanager
def unit_cgroup(procs_file: str) -> Iterator[None]:
    """The unit's cgroup (and system.slice where there is none), removed afterwards."""
    made = [d for d in (Path(procs_file).parents[1], Path(procs_file).parent) if not d.is_dir()]
    for folder in made:
        folder.mkdir()
    try:
        yield
    finally:
        for folder in reversed(made):
            folder.rmdir()


PROCS_FILE = writable_procs_file() if os.geteuid() == 0 else None


@needs(PROCS_FILE, "root and a writable cgroup hierarchy holding PID 1's units")
def test_a_units_processes_count_as_its_own_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """The module on this machine's /proc and /sys, for a unit whose process (ours, holding 64 MiB) is in its cgroup:
    what it holds is the unit's own (by RSS where its cgroup has no memory controller, as in a lab host)."""
    assert PROCS_FILE is not None
    with unit_cgroup(PROCS_FILE):
        with holding_process(64, PROCS_FILE) as pid:
            rc, result = run_module({"backends": ["cpu"], "units": [TEST_UNIT]}, capsys)
        rc_after, after = run_module({"backends": ["cpu"], "units": [TEST_UNIT]}, capsys)
    assert rc == 0 and rc_after == 0, (result, after)
    (dev,) = result["rpc_devices"]
    (entry,) = dev["memory"]["units"]
    assert entry["unit"] == TEST_UNIT and entry["own_mib"] >= 64 and dev["memory"]["own_mib"] == entry["own_mib"]
    if entry["source"] == "unit RSS":
        assert entry["pids"] == [pid]
        assert "%d MiB the service holds by unit RSS" % entry["own_mib"] in dev["free_source"] or (
            "(%d MiB of it by unit RSS)" % entry["own_mib"] in dev["free_source"]), dev["free_source"]
    else:  # a v2 host whose system.slice has the memory controller: the unit's own charge
        assert entry["source"].startswith("cgroup /") and entry["source"].endswith("/" + TEST_UNIT), entry
    # the process gone, the unit holds nothing
    assert after["rpc_devices"][0]["memory"]["units"][0]["own_mib"] == 0
