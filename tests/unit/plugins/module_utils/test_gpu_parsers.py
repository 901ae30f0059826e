"""gpu_parsers: device tools' outputs (recorded real ones where this machine has the tool) -> device dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llamafleet.core.gpu_devices import ParseError
from llamafleet.core.gpu_parsers import (
    merge_vulkan,
    parse_amd_smi_json,
    parse_ggml_device_lines,
    parse_meminfo,
    parse_nvidia_smi_csv,
    parse_rocm_smi_json,
    parse_vk_visible_devices,
    parse_vulkaninfo_heaps,
    parse_vulkaninfo_summary,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gpu"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def brief(devices: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(d["backend"], d["index"], d["name"], d["total_mib"], d["free_mib"], d["integrated"]) for d in devices]


# --- nvidia-smi -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    # gpu_probe's own query on a real H100 (driver 580.159.04): see fixtures/gpu/README.md
    ("nvidia-smi_query_nounits_h100_real.txt", [
        ("cuda", 0, "NVIDIA H100 80GB HBM3", 81559, 81079, False),
    ]),
    # and on a real H200 (driver 580.159.04)
    ("nvidia-smi_query_nounits_h200_real.txt", [
        ("cuda", 0, "NVIDIA H200", 143771, 143156, False),
    ]),
    ("nvidia-smi_query_nounits_2gpu_reconstructed.txt", [
        ("cuda", 0, "NVIDIA GeForce RTX 4090", 24564, 24108, False),
        ("cuda", 1, "NVIDIA GeForce RTX 3060", 12288, 11874, False),
    ]),
    ("nvidia-smi_query_units_header_reconstructed.txt", [
        ("cuda", 0, "NVIDIA A100-SXM4-80GB", 81920, 81050, False),
        ("cuda", 1, "NVIDIA A100-SXM4-80GB", 81920, 1203, False),
    ]),
    ("nvidia-smi_query_unified_memory_reconstructed.txt", [
        ("cuda", 0, "NVIDIA GB10", None, None, True),
    ]),
])
def test_nvidia_smi(name: str, expected: list[tuple[Any, ...]]) -> None:
    devices = parse_nvidia_smi_csv(fixture(name))
    assert brief(devices) == expected
    assert all(d["uuid"].startswith("GPU-") for d in devices)


@pytest.mark.parametrize("text, message", [
    ("0, NVIDIA X, 1024\n", "expected at least 4"),
    ("zero, NVIDIA X, 1024, 1000\n", "not an integer"),
    ("0, NVIDIA X, lots, 1000\n", "not a memory figure"),
    ("0, NVIDIA X, 10 PiB, 1000\n", "unknown memory unit"),
])
def test_nvidia_smi_rejects(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        parse_nvidia_smi_csv(text)


def test_nvidia_smi_empty_output_is_no_gpu() -> None:
    assert parse_nvidia_smi_csv("") == []


# --- AMD ----------------------------------------------------------------------------------------

def test_rocm_smi_with_warning_preamble() -> None:
    assert brief(parse_rocm_smi_json(fixture("rocm-smi_showmeminfo_vram_productname_reconstructed.json"))) == [
        ("rocm", 0, "Radeon RX 7900 XTX", 24560, 23536, False),
        ("rocm", 1, "Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]", 16368, 16352, False),
    ]


@pytest.mark.parametrize("text, message", [
    ("no json here", "no JSON"),
    ("[1, 2]", "not an object"),
    ('{"card0": {"VRAM Total Memory (B)": "many"}}', "not byte counts"),
])
def test_rocm_smi_rejects(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        parse_rocm_smi_json(text)


def test_amd_smi_static_and_metric_merge() -> None:
    devices = parse_amd_smi_json(fixture("amd-smi_static_list_reconstructed.json"),
                                 fixture("amd-smi_metric_list_reconstructed.json"))
    assert brief(devices) == [
        ("rocm", 0, "AMD Instinct MI300X", 196592, 196309, False),
        ("rocm", 1, "AMD Instinct MI300X", 196592, 98009, False),
    ]


def test_amd_smi_static_only_has_no_free_figure() -> None:
    devices = parse_amd_smi_json(fixture("amd-smi_static_list_reconstructed.json"))
    assert [(d["total_mib"], d["free_mib"]) for d in devices] == [(196592, None), (196592, None)]


def test_amd_smi_gpu_data_layout_with_string_values() -> None:
    devices = parse_amd_smi_json(metric_text=fixture("amd-smi_metric_gpu_data_strings_reconstructed.json"))
    assert brief(devices) == [("rocm", 0, "AMD GPU 0", 24560, 23536, False)]


def test_amd_smi_needs_some_output() -> None:
    with pytest.raises(ParseError, match="static or the metric"):
        parse_amd_smi_json()


# --- Vulkan -------------------------------------------------------------------------------------

# Real lavapipe outputs: Debian 12 (vulkan-tools 1.3.239, Mesa 22.3) and Debian 13 (vulkan-tools 1.4.304, Mesa 25.0.7).
LAVAPIPE_DEBIAN13 = "llvmpipe (LLVM 19.1.7, 256 bits)"
LAVAPIPE_DEBIAN13_UUID = "6d657361-3235-2e30-2e37-2d322b646500"


def as_integrated(text: str) -> str:
    """A lavapipe recording with its CPU-type device retyped as an integrated GPU (one ggml-vulkan keeps)."""
    assert "PHYSICAL_DEVICE_TYPE_CPU" in text
    return text.replace("PHYSICAL_DEVICE_TYPE_CPU", "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU")


@pytest.mark.parametrize("name", [
    "vulkaninfo_summary_1.3.239_lavapipe_real.txt",
    "vulkaninfo_summary_1.4.304_lavapipe_debian13_real.txt",
    "vulkaninfo_summary_1.4.304_lavapipe_two_icds_debian13_real.txt",
])
def test_vulkaninfo_lavapipe_is_not_a_llamacpp_device(name: str) -> None:
    # Mesa's llvmpipe is PHYSICAL_DEVICE_TYPE_CPU, which ggml-vulkan skips unless GGML_VK_VISIBLE_DEVICES lists it.
    assert "deviceType         = PHYSICAL_DEVICE_TYPE_CPU" in fixture(name)
    assert parse_vulkaninfo_summary(fixture(name)) == []


def test_visible_devices_choose_as_llamacpp_does_cpu_type_and_twins_included() -> None:
    # what the lab's Vulkan host runs with: rpc-server's own listing (recorded) agrees, Vulkan0 (and Vulkan1)
    one = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_1.4.304_lavapipe_debian13_real.txt"), [0])
    assert [(d["ggml_name"] if "ggml_name" in d else None, d["index"], d["vk_index"], d["name"]) for d in one] == [
        (None, 0, 0, LAVAPIPE_DEBIAN13)]
    two = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_1.4.304_lavapipe_two_icds_debian13_real.txt"), [0, 1])
    assert [(d["index"], d["vk_index"]) for d in two] == [(0, 0), (1, 1)]
    listed = parse_ggml_device_lines(fixture("rpc-server_v7.0.0_vulkan_lavapipe_two_icds_debian13_real.txt"))
    assert [d["ggml_name"] for d in listed if d["backend"] == "vulkan"] == ["Vulkan0", "Vulkan1"]
    # the order is the variable's
    assert [d["vk_index"] for d in parse_vulkaninfo_summary(
        fixture("vulkaninfo_summary_1.4.304_lavapipe_two_icds_debian13_real.txt"), [1, 0])] == [1, 0]
    with pytest.raises(ParseError, match="names Vulkan device.s. 3, but vulkaninfo lists 0"):
        parse_vulkaninfo_summary(fixture("vulkaninfo_summary_1.4.304_lavapipe_debian13_real.txt"), [3])


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("0", [0]), ("0,1", [0, 1]), (" 1 ,0", [1, 0])])
def test_parse_vk_visible_devices(value: str | None, expected: list[int] | None) -> None:
    assert parse_vk_visible_devices(value) == expected


def test_parse_vk_visible_devices_refuses_names() -> None:
    with pytest.raises(ParseError, match="GGML_VK_VISIBLE_DEVICES='Vulkan0'"):
        parse_vk_visible_devices("Vulkan0")


def test_vulkaninfo_summary_debian13_fields() -> None:
    devices = parse_vulkaninfo_summary(as_integrated(fixture("vulkaninfo_summary_1.4.304_lavapipe_debian13_real.txt")))
    assert brief(devices) == [("vulkan", 0, LAVAPIPE_DEBIAN13, None, None, True)]
    assert [(d["vk_index"], d["uuid"], d["driver"]) for d in devices] == [(0, LAVAPIPE_DEBIAN13_UUID, "llvmpipe")]


def test_vulkaninfo_same_uuid_twice_real() -> None:
    # Two ICD files naming libvulkan_lvp.so: the loader enumerates GPU0 and GPU1 with one deviceUUID.
    text = as_integrated(fixture("vulkaninfo_summary_1.4.304_lavapipe_two_icds_debian13_real.txt"))
    assert text.count("deviceUUID         = " + LAVAPIPE_DEBIAN13_UUID) == 2
    devices = parse_vulkaninfo_summary(text)
    assert [(d["index"], d["vk_index"], d["name"]) for d in devices] == [(0, 0, LAVAPIPE_DEBIAN13)]


def test_vulkaninfo_discrete_and_integrated() -> None:
    devices = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_radv_discrete_integrated_reconstructed.txt"))
    assert brief(devices) == [
        ("vulkan", 0, "AMD Radeon RX 6800 XT (RADV NAVI21)", None, None, False),
        ("vulkan", 1, "AMD Radeon Graphics (RADV RAPHAEL_MENDOCINO)", None, None, True),
    ]
    assert [d["vk_index"] for d in devices] == [0, 1]


def test_vulkaninfo_same_gpu_twice_is_one_device() -> None:
    text = fixture("vulkaninfo_summary_radv_discrete_integrated_reconstructed.txt")
    doubled = text.replace("GPU2:", "GPU3:\n\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU\n"
                           "\tdeviceName         = AMD Radeon RX 6800 XT (AMDVLK)\n"
                           "\tdeviceUUID         = 00000000-0300-0000-0000-000000000000\nGPU2:")
    names = [d["name"] for d in parse_vulkaninfo_summary(doubled)]
    assert names == ["AMD Radeon RX 6800 XT (RADV NAVI21)", "AMD Radeon Graphics (RADV RAPHAEL_MENDOCINO)"]


@pytest.mark.parametrize("name, device, heap_mib, budget_mib", [
    # Mesa 22.3: a fixed 2 GiB heap, no VK_EXT_memory_budget
    ("vulkaninfo_full_1.3.239_lavapipe_real.txt", "llvmpipe (LLVM 15.0.6, 256 bits)", 2048, None),
    # Mesa 25.0: the heap is the machine's RAM (MemTotal 24683656 kB) with a budget; usage is the RAM in use
    ("vulkaninfo_full_1.4.304_lavapipe_debian13_real.txt", LAVAPIPE_DEBIAN13,
     25276063744 // 2**20, (25276063744 - 1188622336) // 2**20),
])
def test_vulkaninfo_heaps_real_lavapipe(name: str, device: str, heap_mib: int, budget_mib: int | None) -> None:
    heaps = parse_vulkaninfo_heaps(fixture(name))
    assert heaps == [{"vk_index": 0, "device_type": "PHYSICAL_DEVICE_TYPE_CPU",
                      "name": device, "heap_mib": heap_mib, "budget_mib": budget_mib}]


def test_vulkaninfo_merge_real_debian13() -> None:
    summary = parse_vulkaninfo_summary(as_integrated(fixture("vulkaninfo_summary_1.4.304_lavapipe_debian13_real.txt")))
    heaps = parse_vulkaninfo_heaps(fixture("vulkaninfo_full_1.4.304_lavapipe_debian13_real.txt"))
    merged = merge_vulkan(summary, heaps)
    assert [(d["name"], d["total_mib"], d["free_mib"], d["source"]) for d in merged] == [
        (LAVAPIPE_DEBIAN13, 24683656 // 1024, (25276063744 - 1188622336) // 2**20, "vulkaninfo")]


def test_vulkaninfo_heaps_with_budget_and_merge() -> None:
    heaps = parse_vulkaninfo_heaps(fixture("vulkaninfo_heaps_budget_excerpt_reconstructed.txt"))
    # heaps 0 and 2 are device-local: 16592666624 + 268435456 bytes; budget minus usage of both
    assert heaps[0]["heap_mib"] == (16592666624 + 268435456) // 2**20
    assert heaps[0]["budget_mib"] == (16147365888 - 226230272 + 261095424) // 2**20
    summary = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_radv_discrete_integrated_reconstructed.txt"))
    merged = merge_vulkan(summary, heaps)
    assert (merged[0]["total_mib"], merged[0]["free_mib"], merged[0]["source"]) == (16080, 15432, "vulkaninfo")
    assert merged[1]["total_mib"] is None  # no heap block for GPU1 in the excerpt


# --- CPU -----------------------------------------------------------------------------------------

def test_meminfo_real() -> None:
    dev = parse_meminfo(fixture("proc_meminfo_debian12_real.txt"), name="AMD EPYC")
    assert dev["backend"] == "cpu" and dev["name"] == "AMD EPYC"
    assert dev["total_mib"] == 24684084 // 1024 == 24105
    assert 0 < dev["free_mib"] < dev["total_mib"]


def test_meminfo_rejects_other_text() -> None:
    with pytest.raises(ParseError, match="MemTotal"):
        parse_meminfo("nothing\n")


# --- llama.cpp's own view ---------------------------------------------------------------------

@pytest.mark.parametrize("name, devices", [
    ("rpc-server_v7.0.0_cpu_cache_real.txt", [("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    ("rpc-server_v7.0.0_cpu_banner_real.txt", [("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    ("rpc-server_v7.0.0_two_devices_real.txt",
     [("CPU", "cpu", "AMD EPYC", 24105, 24105), ("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    # the CUDA build of 0c1e570 on a real H100: llama.cpp counts 480 MiB less than nvidia-smi's total
    ("rpc-server_v7.0.0_cuda_h100_real.txt",
     [("CUDA0", "cuda", "NVIDIA H100 80GB HBM3", 81079, 80552), ("CPU", "cpu", "Intel(R) Xeon(R) Processor", 128887, 128887)]),
    # and on a real H200: 616 MiB less than nvidia-smi's total
    ("rpc-server_v7.0.0_cuda_h200_real.txt",
     [("CUDA0", "cuda", "NVIDIA H200", 143155, 142629), ("CPU", "cpu", "Intel(R) Xeon(R) Processor", 128887, 128887)]),
    ("rpc-server_v7.0.0_cuda_two_gpus_reconstructed.txt",
     [("CUDA0", "cuda", "NVIDIA GeForce RTX 4090", 24080, 23604),
      ("CUDA1", "cuda", "NVIDIA GeForce RTX 3060", 11913, 11765)]),
    ("rpc-server_journal_cat_metal_reconstructed.txt", [("MTL0", "metal", "Apple M2 Pro", 21845, 21845)]),
    # the lab's Vulkan host: lavapipe once it is named, skipped (only the CPU) when not, twice with two manifests
    ("rpc-server_v7.0.0_vulkan_lavapipe_debian13_real.txt",
     [("Vulkan0", "vulkan", "llvmpipe (LLVM 19.1.7, 256 bits)", 24105, 23324), ("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    ("rpc-server_v7.0.0_vulkan_lavapipe_unnamed_debian13_real.txt", [("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    ("rpc-server_v7.0.0_vulkan_lavapipe_two_icds_debian13_real.txt",
     [("Vulkan0", "vulkan", "llvmpipe (LLVM 19.1.7, 256 bits)", 24105, 23336),
      ("Vulkan1", "vulkan", "llvmpipe (LLVM 19.1.7, 256 bits)", 24105, 23336), ("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
])
def test_rpc_server_device_lines(name: str, devices: list[tuple[Any, ...]]) -> None:
    """The device lines of rpc-server's startup output (console or journal) are llama.cpp's device listing."""
    listed = parse_ggml_device_lines(fixture(name), source="rpc-server")
    assert [(d["ggml_name"], d["backend"], d["name"], d["total_mib"], d["free_mib"]) for d in listed] == devices
    assert [d["index"] for d in listed] == list(range(len(devices)))
    assert {d["source"] for d in listed} == {"rpc-server"}


def test_llama_server_log_device_info_lines_parse_too() -> None:
    # llama-server -lv 4 prints "- RPC0 : 127.0.0.1:50171 (24105 MiB, 24105 MiB free)" in its device_info block
    lines = parse_ggml_device_lines("  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80478 MiB free)\n"
                                    "  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes\n")
    assert [(d["ggml_name"], d["total_mib"]) for d in lines] == [("CUDA0", 81079)]
