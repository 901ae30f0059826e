"""gpu_parsers: device tools' outputs (recorded real ones where this machine has the tool) -> device dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_parsers import (
    ParseError,
    apply_overrides,
    collect_devices,
    ggml_device_name,
    merge_vulkan,
    metal_working_set_mib,
    parse_amd_smi_json,
    parse_ggml_device_lines,
    parse_meminfo,
    parse_metal,
    parse_nvidia_smi_csv,
    parse_rocm_smi_json,
    parse_rpc_server_startup,
    parse_vulkaninfo_heaps,
    parse_vulkaninfo_summary,
    preferred_backend,
    rpc_exposed_devices,
    select_backend_devices,
    unmatched_overrides,
    usable_mib,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gpu"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def brief(devices: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(d["backend"], d["index"], d["name"], d["total_mib"], d["free_mib"], d["integrated"]) for d in devices]


# --- nvidia-smi -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
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

def test_vulkaninfo_lavapipe_is_not_a_llamacpp_device() -> None:
    # Real output on this machine: Mesa's llvmpipe is PHYSICAL_DEVICE_TYPE_CPU, which ggml-vulkan skips.
    assert parse_vulkaninfo_summary(fixture("vulkaninfo_summary_1.3.239_lavapipe_real.txt")) == []


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


def test_vulkaninfo_heaps_real_lavapipe() -> None:
    heaps = parse_vulkaninfo_heaps(fixture("vulkaninfo_full_1.3.239_lavapipe_real.txt"))
    assert heaps == [{"vk_index": 0, "device_type": "PHYSICAL_DEVICE_TYPE_CPU",
                      "name": "llvmpipe (LLVM 15.0.6, 256 bits)", "heap_mib": 2048, "budget_mib": None}]


def test_vulkaninfo_heaps_with_budget_and_merge() -> None:
    heaps = parse_vulkaninfo_heaps(fixture("vulkaninfo_heaps_budget_excerpt_reconstructed.txt"))
    # heaps 0 and 2 are device-local: 16592666624 + 268435456 bytes; budget minus usage of both
    assert heaps[0]["heap_mib"] == (16592666624 + 268435456) // 2**20
    assert heaps[0]["budget_mib"] == (16147365888 - 226230272 + 261095424) // 2**20
    summary = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_radv_discrete_integrated_reconstructed.txt"))
    merged = merge_vulkan(summary, heaps)
    assert (merged[0]["total_mib"], merged[0]["free_mib"], merged[0]["source"]) == (16080, 15432, "vulkaninfo")
    assert merged[1]["total_mib"] is None  # no heap block for GPU1 in the excerpt


# --- Metal, CPU ---------------------------------------------------------------------------------

@pytest.mark.parametrize("memsize_gib, wired, expected", [
    (8, 0, 5461),
    (16, 0, 10922),
    (32, 0, 21845),
    (64, 0, 49152),
    (192, 0, 147456),
    (64, 57344, 57344),
])
def test_metal_working_set_rule(memsize_gib: int, wired: int, expected: int) -> None:
    assert metal_working_set_mib(memsize_gib * 2**30, wired) == expected


def test_parse_metal() -> None:
    (dev,) = parse_metal("34359738368\n", "0\n", "Apple M2 Pro\n")
    assert (dev["backend"], dev["name"], dev["total_mib"], dev["free_mib"]) == ("metal", "Apple M2 Pro", 21845, 21845)
    assert dev["integrated"] is False  # llama.cpp types Metal a GPU, so it is ordered like a discrete one
    assert dev["unified_memory_mib"] == 32768
    with pytest.raises(ParseError, match="byte count"):
        parse_metal("sysctl: unknown oid 'hw.memsize'")


def test_meminfo_real() -> None:
    dev = parse_meminfo(fixture("proc_meminfo_debian12_real.txt"), name="AMD EPYC")
    assert dev["backend"] == "cpu" and dev["name"] == "AMD EPYC"
    assert dev["total_mib"] == 24684084 // 1024 == 24105
    assert 0 < dev["free_mib"] < dev["total_mib"]


def test_meminfo_rejects_other_text() -> None:
    with pytest.raises(ParseError, match="MemTotal"):
        parse_meminfo("nothing\n")


# --- llama.cpp's own view ---------------------------------------------------------------------

@pytest.mark.parametrize("name, version, endpoint, cache, exposed, devices", [
    ("rpc-server_v7.0.0_cpu_cache_real.txt", "7.0.0", "127.0.0.1:50161", "/root/.cache/llama.cpp/rpc", False,
     [("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    ("rpc-server_v7.0.0_cpu_banner_real.txt", "7.0.0", "127.0.0.2:50162", None, True,
     [("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    ("rpc-server_v7.0.0_two_devices_real.txt", "7.0.0", "127.0.0.1:50181", None, False,
     [("CPU", "cpu", "AMD EPYC", 24105, 24105), ("CPU", "cpu", "AMD EPYC", 24105, 24105)]),
    ("rpc-server_v7.0.0_cuda_two_gpus_reconstructed.txt", "7.0.0", "10.77.0.12:50052",
     "/var/lib/llamafleet/rpc/cache/rpc", True,
     [("CUDA0", "cuda", "NVIDIA GeForce RTX 4090", 24080, 23604),
      ("CUDA1", "cuda", "NVIDIA GeForce RTX 3060", 11913, 11765)]),
    ("rpc-server_journal_cat_metal_reconstructed.txt", "7.0.0", "10.77.0.14:50052", None, False,
     [("MTL0", "metal", "Apple M2 Pro", 21845, 21845)]),
])
def test_rpc_server_startup(name: str, version: str, endpoint: str, cache: str | None, exposed: bool,
                            devices: list[tuple[Any, ...]]) -> None:
    info = parse_rpc_server_startup(fixture(name))
    assert (info["version"], info["endpoint"], info["cache_dir"], info["exposed_to_network"]) == (
        version, endpoint, cache, exposed)
    assert info["transport"] == "TCP"
    got = [(d["ggml_name"], d["backend"], d["name"], d["total_mib"], d["free_mib"]) for d in info["devices"]]
    assert got == devices
    assert [d["index"] for d in info["devices"]] == list(range(len(devices)))


def test_rpc_server_startup_rejects_other_output() -> None:
    with pytest.raises(ParseError, match="not rpc-server output"):
        parse_rpc_server_startup("Usage: ./rpc-server [options]\n")


def test_llama_server_log_device_info_lines_parse_too() -> None:
    # llama-server -lv 4 prints "- RPC0 : 127.0.0.1:50171 (24105 MiB, 24105 MiB free)" in its device_info block
    lines = parse_ggml_device_lines("  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80478 MiB free)\n"
                                    "  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes\n")
    assert [(d["ggml_name"], d["total_mib"]) for d in lines] == [("CUDA0", 81079)]


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


# --- probing with recorded tool runs ------------------------------------------------------------

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


def test_collect_metal_on_darwin() -> None:
    host = FakeHost({"sysctl": {("-n", "hw.memsize"): (0, "68719476736\n", ""),
                                ("-n", "iogpu.wired_limit_mb"): (1, "", "sysctl: unknown oid 'iogpu.wired_limit_mb'"),
                                ("-n", "machdep.cpu.brand_string"): (0, "Apple M1 Max\n", "")}}, {})
    found = collect_devices(host.run, host.which, host.read_text, system="Darwin")
    assert [(d["ggml_name"], d["total_mib"]) for d in found["devices"]] == [("MTL0", 49152), ("CPU", 65536)]
    assert found["backend"] == "metal" and found["errors"] == []
    assert "iogpu.wired_limit_mb" in found["warnings"][0]


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
