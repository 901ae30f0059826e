"""gpu_probe: which tools a host probe runs and what it makes of them, on recorded tool runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamafleet.core.gpu_devices import ParseError
from llamafleet.core.gpu_probe import collect_devices

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gpu"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


class FakeHost:
    """Tools and files of a pretend host: tool name -> {argv tail: (rc, out, err)}."""

    def __init__(self, tools: dict[str, dict[tuple[str, ...], tuple[int, str, str]]], files: dict[str, str]) -> None:
        self.tools = tools
        self.files = files
        self.calls: list[list[str]] = []

    def which(self, name: str) -> str | None:
        return "/usr/bin/" + name if name in self.tools else None

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(argv)
        name = argv[0].rsplit("/", 1)[-1]
        return self.tools[name][tuple(argv[1:])]

    def read_text(self, path: str) -> str | None:
        return self.files.get(path)


NVIDIA_ARGS = ("--query-gpu=index,name,memory.total,memory.free,uuid", "--format=csv,noheader,nounits")


def test_collect_cuda_host() -> None:
    host = FakeHost(
        {"nvidia-smi": {NVIDIA_ARGS: (0, fixture("nvidia-smi_query_nounits_2gpu_reconstructed.txt"), "")},
         "vulkaninfo": {("--summary",): (0, fixture("vulkaninfo_summary_1.3.239_lavapipe_real.txt"), "")}},
        {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt"), "/proc/cpuinfo": "model name\t: AMD EPYC\n"})
    found = collect_devices(host.run, host.which, host.read_text)
    assert found["tools"] == {"nvidia-smi": "ok", "amd-smi": "missing", "rocm-smi": "missing", "vulkaninfo": "ok"}
    assert found["errors"] == []
    assert [(d["ggml_name"], d["name"]) for d in found["devices"]] == [
        ("CUDA0", "NVIDIA GeForce RTX 4090"), ("CUDA1", "NVIDIA GeForce RTX 3060"), ("CPU", "AMD EPYC")]
    assert found["backend"] == "cuda"
    assert [d["ggml_name"] for d in found["rpc_devices"]] == ["CUDA0", "CUDA1"]


def test_collect_real_h100_serves_llama_cpps_figures() -> None:
    """A real H100 (tests/device/cuda_rpc_check.sh): nvidia-smi and the CUDA rpc-server's own listing, as recorded.
    The worker offers what llama.cpp sees (81,079 MiB, 80,552 free), not nvidia-smi's 81,559 total: the planner
    must not count the 480 MiB the CUDA runtime keeps."""
    host = FakeHost(
        {"nvidia-smi": {NVIDIA_ARGS: (0, fixture("nvidia-smi_query_nounits_h100_real.txt"), "")},
         "ggml-rpc-server": {("-d", "__llamafleet_probe__"): (1, fixture("rpc-server_v7.0.0_cuda_h100_real.txt"), "")}},
        {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt"), "/proc/cpuinfo": "model name\t: Intel Xeon\n"})
    found = collect_devices(host.run, host.which, host.read_text, backends=["cuda", "cpu"],
                            rpc_server="/opt/llamafleet/llama.cpp/current/bin/ggml-rpc-server")
    assert found["errors"] == []
    assert found["tools"] == {"nvidia-smi": "ok", "rpc-server": "ok"}
    (gpu, _cpu) = found["devices"]
    assert (gpu["ggml_name"], gpu["total_mib"], gpu["free_mib"], gpu["uuid"]) == (
        "CUDA0", 81559, 81079, "GPU-6c92a1df-0c08-49d4-89d8-ba51d3efd917")
    assert found["backend"] == "cuda"
    assert [(d["ggml_name"], d["total_mib"], d["free_mib"], d["source"]) for d in found["rpc_devices"]] == [
        ("CUDA0", 81079, 80552, "rpc-server")]


NVIDIA_DRIVER_DOWN = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                      "Make sure that the latest NVIDIA driver is installed and running.\n")


def test_collect_reports_a_failing_tool() -> None:
    host = FakeHost(
        {"nvidia-smi": {NVIDIA_ARGS: (9, "", NVIDIA_DRIVER_DOWN)}},
        {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt")})
    found = collect_devices(host.run, host.which, host.read_text)
    assert found["tools"]["nvidia-smi"] == "failed"
    (error,) = found["errors"]
    assert error.startswith("nvidia-smi --query-gpu=") and "rc=9" in error and "couldn't communicate" in error
    assert [d["backend"] for d in found["rpc_devices"]] == ["cpu"]


def test_collect_unreadable_output_is_an_error() -> None:
    host = FakeHost({"rocm-smi": {("--showmeminfo", "vram", "--showproductname", "--json"): (0, "oops", "")}},
                    {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt")})
    found = collect_devices(host.run, host.which, host.read_text, backends=["rocm", "cpu"])
    assert found["tools"]["rocm-smi"] == "unparsed"
    assert found["errors"] == ["rocm-smi: rocm-smi printed no JSON document"]


def test_collect_amd_smi_wins_over_rocm_smi() -> None:
    host = FakeHost({"amd-smi": {("static", "--json"): (0, fixture("amd-smi_static_list_reconstructed.json"), ""),
                                 ("metric", "--json"): (0, fixture("amd-smi_metric_list_reconstructed.json"), "")},
                     "rocm-smi": {}},
                    {})
    found = collect_devices(host.run, host.which, host.read_text, backends=["rocm"])
    assert [d["ggml_name"] for d in found["devices"]] == ["ROCm0", "ROCm1"]
    assert all(call[0].endswith("amd-smi") for call in host.calls)


def test_metal_is_not_probed() -> None:
    """macOS hosts are refused in preflight, so there is no Metal probe (sysctl is never run)."""
    host = FakeHost({"sysctl": {}}, {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt")})
    with pytest.raises(ParseError, match="unknown backends metal"):
        collect_devices(host.run, host.which, host.read_text, backends=["metal"])
    found = collect_devices(host.run, host.which, host.read_text)
    assert [d["backend"] for d in found["devices"]] == ["cpu"] and host.calls == []


def test_collect_with_rpc_server_listing() -> None:
    listing = "available devices:\n" + fixture("rpc-server_v7.0.0_cpu_cache_real.txt").split("Devices:\n")[1]
    host = FakeHost({"ggml-rpc-server": {("-d", "__llamafleet_probe__"): (
        1, listing, "error: unknown device: __llamafleet_probe__\n")}},
        {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt")})
    found = collect_devices(host.run, host.which, host.read_text, backends=["cpu"],
                            rpc_server="/opt/llama/bin/ggml-rpc-server")
    (dev,) = found["rpc_devices"]
    # llama.cpp's CPU device reports MemTotal as free; the probe puts MemAvailable in its place
    assert (dev["ggml_name"], dev["total_mib"]) == ("CPU", 24105)
    assert dev["free_mib"] == found["devices"][0]["free_mib"] < 24105


def test_collect_the_labs_vulkan_host_with_the_environment_llamacpp_runs_with() -> None:
    """lab3 (Debian 13, lavapipe): vulkaninfo and rpc-server as recorded there. Without GGML_VK_VISIBLE_DEVICES
    llama.cpp skips the CPU-type device, and so does the probe; with it, both see Vulkan0 and serve it."""
    host = FakeHost(
        {"vulkaninfo": {("--summary",): (0, fixture("vulkaninfo_summary_1.4.304_lavapipe_debian13_real.txt"), ""),
                        (): (0, fixture("vulkaninfo_full_1.4.304_lavapipe_debian13_real.txt"), "")},
         "ggml-rpc-server": {("-d", "__llamafleet_probe__"): (
             1, fixture("rpc-server_v7.0.0_vulkan_lavapipe_debian13_real.txt"), "")}},
        {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt"), "/proc/cpuinfo": "model name\t: AMD EPYC\n"})
    bare = collect_devices(host.run, host.which, host.read_text, backends=["vulkan", "cpu"])
    assert [d["ggml_name"] for d in bare["devices"]] == ["CPU"] and bare["backend"] == "cpu"
    named = collect_devices(host.run, host.which, host.read_text, backends=["vulkan", "cpu"],
                            rpc_server="/opt/llama/bin/ggml-rpc-server", environ={"GGML_VK_VISIBLE_DEVICES": "0"})
    assert named["errors"] == []
    vulkan = named["devices"][0]
    assert (vulkan["ggml_name"], vulkan["name"]) == ("Vulkan0", "llvmpipe (LLVM 19.1.7, 256 bits)")
    assert vulkan["total_mib"] == 24683656 // 1024 == 24105  # lavapipe's heap is the host's RAM
    assert named["backend"] == "vulkan" and [d["ggml_name"] for d in named["rpc_devices"]] == ["Vulkan0"]
    bad = collect_devices(host.run, host.which, host.read_text, backends=["vulkan"],
                          environ={"GGML_VK_VISIBLE_DEVICES": "1"})
    assert bad["devices"] == [] and "names Vulkan device(s) 1" in bad["errors"][0]


def test_collect_old_rpc_server_without_device_flag() -> None:
    usage = "Usage: ./rpc-server [options]\n"
    host = FakeHost({"rpc-server": {("-d", "__llamafleet_probe__"): (0, "", "error: unknown argument: -d\n" + usage)}},
                    {"/proc/meminfo": fixture("proc_meminfo_debian12_real.txt")})
    found = collect_devices(host.run, host.which, host.read_text, backends=["cpu"], rpc_server="/x/rpc-server")
    assert found["tools"]["rpc-server"] == "failed"
    assert "listed no devices" in found["errors"][0]
    assert [d["backend"] for d in found["rpc_devices"]] == ["cpu"]


def test_collect_rejects_unknown_backend() -> None:
    with pytest.raises(ParseError, match="unknown backends opencl"):
        collect_devices(lambda a: (0, "", ""), lambda n: None, lambda p: None, backends=["opencl"])
