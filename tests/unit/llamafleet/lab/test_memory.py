"""The lab's per-host memory limits: reading and writing limit files, finding a host's cgroup, on this machine's kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamafleet.lab import memory
from llamafleet.lab.system import LabError
from tests.unit.needs import needs

V1 = """12:memory:/process_api/abc
4:cpu,cpuacct:/
1:name=systemd:/user.slice
0::/user.slice/session-1.scope
"""


def test_limit_text_and_parse_round_trip() -> None:
    assert memory.limit_text(4096) == str(4096 * 1024 * 1024)
    assert memory.limit_text(0) == memory.limit_text(None) == memory.limit_text(0, 2) == "max"
    # cgroup v1 (this project's CI machines): memory.limit_in_bytes takes -1, and refuses "max" (EINVAL)
    assert memory.limit_text(0, 1) == memory.limit_text(None, 1) == "-1"
    assert memory.limit_text(4096, 1) == str(4096 * 1024 * 1024)
    assert memory.parse_limit(memory.limit_text(4096) + "\n") == 4096
    assert memory.parse_limit("max\n") is None
    assert memory.parse_limit("9223372036854771712") is None  # v1's "no limit"
    with pytest.raises(ValueError):
        memory.parse_limit("lots")


def test_own_cgroup_reads_the_named_controller_only() -> None:
    assert memory._own_cgroup("memory", V1) == "/process_api/abc"
    assert memory._own_cgroup("cpu", V1) == "/"
    assert memory._own_cgroup("pids", V1) == ""


def test_too_small_a_limit_is_refused() -> None:
    memory.check_memory_mib(0)
    memory.check_memory_mib(memory.MIN_MEMORY_MIB)
    with pytest.raises(LabError, match="at least 512 MiB"):
        memory.check_memory_mib(100)


@needs(os.geteuid() == 0, "root (writes cgroups)")
@needs(memory.memory_hierarchy() is not None, "a memory cgroup controller")
def test_a_limit_is_enforced_and_found_again(tmp_path: Path) -> None:
    name = f"unit-{os.getpid()}"
    directory = memory.prepare_host_cgroup(name, 600)
    assert directory is not None and directory.name == name
    try:
        # a stand-in "host": a process that joins the cgroup, as a container's nspawn does, then sleeps
        sleeper = subprocess.Popen(["sh", "-c", f"echo $$ > {directory}/cgroup.procs; exec sleep 60"])
        try:
            for _ in range(50):
                if memory.running_host_cgroup(sleeper.pid) == directory:
                    break
                subprocess.run(["sleep", "0.1"], check=True)
            assert memory.host_limit_mib(sleeper.pid) == 600
            memory.set_host_limit(name, sleeper.pid, 700)
            assert memory.host_limit_mib(sleeper.pid) == 700
        finally:
            sleeper.kill()
            sleeper.wait()
        hog = subprocess.run(["sh", "-c", f"echo $$ > {directory}/cgroup.procs; exec {sys.executable} -c "
                              "'b = bytearray(900 * 1024 * 1024); print(len(b))'"], capture_output=True, text=True,
                             check=False)
        assert hog.returncode == -9 or hog.returncode == 137, hog
        assert memory.host_limit_mib(os.getpid()) is False  # this process is in no lab memory cgroup
    finally:
        memory.remove_memory_cgroups(name)
    assert memory.memory_hierarchy().version == 2 or not directory.exists()
