"""backend_facts module: probes this machine (no GPU, no NVIDIA driver) and says what it cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import backend_facts
from tests.unit.module_runner import run_main

NO_DRIVER = not Path("/proc/driver/nvidia/version").exists()


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(backend_facts.main, args, capsys)


def test_cpu_passes_here(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"backend": "cpu", "groups": ["llamafleet_workers"], "_ansible_check_mode": True}, capsys)
    assert rc == 0 and result["changed"] is False and result["problem"] is None
    assert set(result["facts"]) == {"nvidia_driver", "nvidia_smi", "vulkan_loader", "kfd", "gpu_vendors"}
    assert result["facts"]["nvidia_driver"] is Path("/proc/driver/nvidia/version").exists()
    assert result["facts"]["kfd"] is Path("/dev/kfd").exists()


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has the NVIDIA driver")
def test_cuda_without_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    # nvidia-smi on the PATH is not enough: the kernel driver must be loaded
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", "%s:/usr/bin:/bin" % tmp_path)
    rc, result = run_module({"backend": "cuda"}, capsys)
    assert rc == 0 and result["facts"]["nvidia_smi"] == str(tmp_path / "nvidia-smi")
    assert result["problem"].startswith("llamacpp_build_backend=cuda needs the NVIDIA driver, and this host has no "
                                        "NVIDIA kernel driver (/proc/driver/nvidia/version is missing).")


def test_two_backend_groups(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"backend": "cpu", "groups": ["llamafleet_backend_cpu", "llamafleet_backend_vulkan"]},
                            capsys)
    assert rc == 0 and "llamacpp_build_backend is ambiguous" in result["problem"]
