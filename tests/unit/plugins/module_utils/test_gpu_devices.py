"""gpu_devices: llama.cpp's device names, the devices an rpc-server serves, inventory overrides, usable memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llamafleet.core.gpu_devices import (
    ParseError,
    apply_overrides,
    ggml_device_name,
    preferred_backend,
    rpc_exposed_devices,
    select_backend_devices,
    unmatched_overrides,
    usable_mib,
)
from llamafleet.core.gpu_parsers import (
    parse_ggml_device_lines,
    parse_meminfo,
    parse_nvidia_smi_csv,
    parse_vulkaninfo_summary,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gpu"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_rpc_exposed_devices_follow_rpc_server_rule() -> None:
    listed = parse_ggml_device_lines("available devices:\n"
                                     "  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23604 MiB free)\n"
                                     "  BLAS: OpenBLAS (0 MiB, 0 MiB free)\n"
                                     "  CPU: AMD Ryzen 9 7950X (63927 MiB, 63927 MiB free)\n")
    assert [d["ggml_name"] for d in rpc_exposed_devices(listed)] == ["CUDA0"]
    cpu_only = [d for d in listed if d["ggml_name"] != "CUDA0"]
    assert [(d["ggml_name"], d["index"]) for d in rpc_exposed_devices(cpu_only)] == [("CPU", 0)]


# --- choosing and overriding -------------------------------------------------------------------

def test_backend_preference_and_selection() -> None:
    nvidia = parse_nvidia_smi_csv(fixture("nvidia-smi_query_nounits_2gpu_reconstructed.txt"))
    vulkan = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_radv_discrete_integrated_reconstructed.txt"))
    cpu = [parse_meminfo(fixture("proc_meminfo_debian12_real.txt"))]
    assert preferred_backend(vulkan + nvidia + cpu) == "cuda"
    assert preferred_backend(vulkan + cpu) == "vulkan"
    assert preferred_backend(cpu) == "cpu"
    assert [d["name"] for d in select_backend_devices(vulkan + nvidia + cpu, "cuda")] == [
        "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3060"]
    assert [d["backend"] for d in select_backend_devices(cpu, "cuda")] == ["cpu"]


@pytest.fixture
def host_devices() -> list[dict[str, Any]]:
    return (parse_nvidia_smi_csv(fixture("nvidia-smi_query_nounits_2gpu_reconstructed.txt"))
            + [parse_meminfo(fixture("proc_meminfo_debian12_real.txt"), name="AMD EPYC")])


@pytest.mark.parametrize("match, selected", [
    ("all", [("cuda", 0), ("cuda", 1), ("cpu", 0)]),
    ("*", [("cuda", 0), ("cuda", 1), ("cpu", 0)]),
    ("cuda", [("cuda", 0), ("cuda", 1)]),
    ("cpu", [("cpu", 0)]),
    ("cuda:1", [("cuda", 1)]),
    (1, [("cuda", 1)]),
    ("0", [("cuda", 0), ("cpu", 0)]),
    ("CUDA1", [("cuda", 1)]),
    ("*4090*", [("cuda", 0)]),
    ("nvidia geforce rtx 3060", [("cuda", 1)]),
])
def test_override_matching(host_devices: list[dict[str, Any]], match: Any, selected: list[tuple[str, int]]) -> None:
    out = apply_overrides(host_devices, [{"match": match, "max_mib": 1000}])
    assert [(d["backend"], d["index"]) for d in out if d.get("max_mib") == 1000] == selected


def test_overrides_win_and_later_ones_win(host_devices: list[dict[str, Any]]) -> None:
    out = apply_overrides(host_devices, [
        {"match": "cuda", "reserve_mib": 512},
        {"match": "cuda:0", "reserve_mib": 1024, "free_mib": 20000},
        {"match": "cpu", "total_mib": 2048},
    ], cpu_reserve_mib=256)
    gpu0, gpu1, cpu = out
    assert (gpu0["free_mib"], gpu0["reserve_mib"]) == (20000, 1024)
    assert sorted(gpu0["overridden"]) == ["free_mib", "reserve_mib"]
    assert (gpu1["reserve_mib"], usable_mib(gpu1)) == (512, 11874 - 512)
    # an inventory total below what the tool saw free bounds the free figure (a capped lab host)
    assert (cpu["total_mib"], cpu["free_mib"], cpu["reserve_mib"]) == (2048, 2048, 256)
    assert usable_mib(cpu) == 2048 - 256
    assert host_devices[0]["free_mib"] == 24108  # inputs untouched


@pytest.mark.parametrize("override, message", [
    ({"max_mib": 10}, "has no 'match'"),
    ({"match": "cpu", "maximum": 10}, "unknown keys maximum"),
    ({"match": "cpu", "max_mib": -1}, "non-negative integer"),
    ({"match": "cpu", "max_mib": "lots"}, "non-negative integer"),
    ({"match": "rocm", "max_mib": 10}, "selects none of the devices: cuda:0 NVIDIA GeForce RTX 4090"),
])
def test_override_errors(host_devices: list[dict[str, Any]], override: dict[str, Any], message: str) -> None:
    with pytest.raises(ParseError, match=message):
        apply_overrides(host_devices, [override])


def test_unmatched_overrides_across_lists(host_devices: list[dict[str, Any]]) -> None:
    assert unmatched_overrides([host_devices], [{"match": "cuda"}]) == []
    (message,) = unmatched_overrides([host_devices[:1], host_devices[2:]], [{"match": "cuda"}, {"match": "mtl0"}])
    assert message.startswith("overrides[1] match 'mtl0' selects none")


@pytest.mark.parametrize("dev, expected", [
    ({"free_mib": 1000}, 1000),
    ({"free_mib": None, "total_mib": 800}, 800),
    ({"free_mib": None, "total_mib": None}, 0),
    ({"free_mib": 1000, "reserve_mib": 1500}, 0),
    ({"free_mib": 1000, "reserve_mib": 100, "max_mib": 500}, 500),
])
def test_usable_mib(dev: dict[str, Any], expected: int) -> None:
    assert usable_mib(dev) == expected


def test_ggml_device_names() -> None:
    assert [ggml_device_name(b, 1) for b in ("cuda", "rocm", "vulkan", "metal", "cpu")] == [
        "CUDA1", "ROCm1", "Vulkan1", "MTL1", "CPU"]
    with pytest.raises(ParseError):
        ggml_device_name("other", 0)
