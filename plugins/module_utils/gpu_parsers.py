# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pure parsers of the tools that report accelerators and memory on a host.

Each parser takes the text a tool printed and returns a list of *device dicts*::

    {
        "backend": "cuda" | "rocm" | "vulkan" | "metal" | "cpu" | "musa" | "sycl" | "other",
        "index": int,            # the device's index as that backend numbers it
        "name": str,             # the human name (product name, CPU model, ...)
        "total_mib": int | None, # None when the tool cannot tell
        "free_mib": int | None,
        "integrated": bool,      # llama.cpp types it an integrated GPU (IGPU): used only
                                 # when the host has no discrete GPU (Metal counts as a GPU)
        "source": str,           # which tool/format the figures came from
        # optional: "ggml_name" (llama.cpp's device name, e.g. CUDA0), "uuid", ...
    }

Figures are MiB (2**20 bytes) everywhere, rounded down like llama.cpp does.
Nothing here runs a command or touches the host: the ``gpu_facts`` module
runs the tools, these functions only read their output, so they are tested
on recorded outputs.

Stdlib only: shared by the Ansible modules (module_utils) and the
``llamafleet`` library (``llamafleet.core.gpu_parsers``).
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import re
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

MIB = 1024 * 1024

BACKENDS = ("cuda", "rocm", "vulkan", "metal", "cpu", "musa", "sycl", "other")

# llama.cpp's device-name prefix for each backend (ggml/include/ggml-cuda.h:
# GGML_CUDA_NAME is "CUDA", "ROCm" for HIP builds and "MUSA"; ggml-vulkan.h:
# GGML_VK_NAME "Vulkan"; ggml-metal-device.m: "MTL%d"; the CPU device is "CPU").
GGML_PREFIX = {
    "cuda": "CUDA",
    "rocm": "ROCm",
    "musa": "MUSA",
    "vulkan": "Vulkan",
    "metal": "MTL",
    "sycl": "SYCL",
    "cpu": "CPU",
}
_PREFIX_TO_BACKEND = {prefix.lower(): backend for backend, prefix in GGML_PREFIX.items()}

# Device names of ggml "ACCEL" devices (BLAS and similar CPU helpers): rpc-server
# never serves them on its own, like the CPU.
_ACCEL_NAMES = ("blas", "zendnn", "openvino_cpu")


class ParseError(ValueError):
    """A tool's output is not in a format this module understands."""


def _device(backend: str, index: int, name: str, total_mib: int | None, free_mib: int | None,
            source: str, integrated: bool = False, **extra: Any) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "backend": backend,
        "index": index,
        "name": name,
        "total_mib": total_mib,
        "free_mib": free_mib,
        "integrated": integrated,
        "source": source,
    }
    dev.update({k: v for k, v in extra.items() if v is not None})
    return dev


def ggml_device_name(backend: str, index: int) -> str:
    """llama.cpp's name for a local device: ``CUDA0``, ``ROCm1``, ``Vulkan0``, ``MTL0``, ``CPU``."""
    if backend == "cpu":
        return "CPU"
    try:
        return "%s%d" % (GGML_PREFIX[backend], index)
    except KeyError:
        raise ParseError("backend %r has no llama.cpp device name; expected one of %s"
                         % (backend, ", ".join(sorted(GGML_PREFIX)))) from None


def backend_of_ggml_name(ggml_name: str) -> str:
    """Backend of a llama.cpp device name (``CUDA0`` -> cuda, ``MTL0`` -> metal, ``CPU`` -> cpu)."""
    prefix = re.sub(r"\d+$", "", ggml_name).lower()
    if prefix in _PREFIX_TO_BACKEND:
        return _PREFIX_TO_BACKEND[prefix]
    return "other"


# ---------------------------------------------------------------------------
# NVIDIA: nvidia-smi --query-gpu=index,name,memory.total,memory.free,uuid --format=csv[,noheader][,nounits]
# ---------------------------------------------------------------------------

NVIDIA_SMI_QUERY = "index,name,memory.total,memory.free,uuid"
_NA_VALUES = ("[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "")
_UNIT_FACTORS = {"b": 1, "kib": 1024, "kb": 1024, "mib": MIB, "mb": MIB, "gib": 1024 * MIB, "gb": 1024 * MIB}


def _mib_field(value: str, default_unit: str = "mib") -> int | None:
    """``"24576"``, ``"24576 MiB"`` or ``"[N/A]"`` -> MiB (None when not available)."""
    text = value.strip()
    if text.lower() in _NA_VALUES:
        return None
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)", text)
    if not match:
        raise ParseError("not a memory figure: %r" % value)
    unit = (match.group(2) or default_unit).lower()
    if unit not in _UNIT_FACTORS:
        raise ParseError("unknown memory unit %r in %r" % (match.group(2), value))
    return int(float(match.group(1)) * _UNIT_FACTORS[unit] // MIB)


def parse_nvidia_smi_csv(text: str) -> list[dict[str, Any]]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,memory.free,uuid --format=csv...``.

    Accepts the output with or without the header line and with or without units
    (``nounits``). The ``uuid`` column is optional. GPUs whose memory nvidia-smi
    cannot report (``[N/A]``, ``[Not Supported]``: Jetson, GB10 and other
    unified-memory parts) get ``None`` figures and ``integrated: True`` (CUDA
    reports such parts as integrated, which llama.cpp types IGPU); plan them
    with an inventory override.
    """
    devices: list[dict[str, Any]] = []
    reader = csv.reader(io.StringIO(text), skipinitialspace=True)
    for lineno, row in enumerate(reader, start=1):
        if not row or not "".join(row).strip():
            continue
        if row[0].strip().lower() == "index":  # header line: index, name, memory.total [MiB], ...
            continue
        if len(row) < 4:
            raise ParseError("nvidia-smi line %d has %d fields, expected at least 4 (%s): %r"
                             % (lineno, len(row), NVIDIA_SMI_QUERY, ",".join(row)))
        try:
            index = int(row[0])
        except ValueError:
            raise ParseError("nvidia-smi line %d: index %r is not an integer" % (lineno, row[0])) from None
        total = _mib_field(row[2])
        free = _mib_field(row[3])
        uuid = row[4].strip() if len(row) > 4 else None
        devices.append(_device("cuda", index, row[1].strip(), total, free, "nvidia-smi",
                               integrated=total is None, uuid=uuid or None))
    return devices


# ---------------------------------------------------------------------------
# AMD: rocm-smi --showmeminfo vram [--showproductname] --json; amd-smi static/metric --json
# ---------------------------------------------------------------------------

def _json(text: str, tool: str) -> Any:
    # rocm-smi and amd-smi may print warnings before the JSON document.
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise ParseError("%s printed no JSON document" % tool)
    try:
        return json.loads(text[start:])
    except ValueError as exc:
        raise ParseError("%s printed invalid JSON: %s" % (tool, exc)) from None


def parse_rocm_smi_json(text: str) -> list[dict[str, Any]]:
    """Parse ``rocm-smi --showmeminfo vram --json`` (optionally with ``--showproductname``).

    The document maps ``card0``, ``card1`` ... to ``VRAM Total Memory (B)`` and
    ``VRAM Total Used Memory (B)`` (decimal strings of bytes); with
    ``--showproductname`` a card also has ``Card Series``/``Card Model``
    (capitalised differently across releases; matched case-insensitively).
    """
    data = _json(text, "rocm-smi")
    if not isinstance(data, dict):
        raise ParseError("rocm-smi JSON is not an object of cards")
    devices = []
    for key in sorted((k for k in data if re.fullmatch(r"card\d+", k)), key=lambda k: int(k[4:])):
        card = data[key]
        if not isinstance(card, dict):
            continue
        # Key capitalisation differs between rocm-smi releases ("Card series" / "Card Series").
        card = {str(k).lower(): v for k, v in card.items()}
        total_b = card.get("vram total memory (b)")
        used_b = card.get("vram total used memory (b)")
        if total_b is None:
            continue
        try:
            total = int(total_b) // MIB
            free = (int(total_b) - int(used_b)) // MIB if used_b is not None else None
        except (TypeError, ValueError):
            raise ParseError("rocm-smi %s: VRAM figures %r/%r are not byte counts" % (key, total_b, used_b)) from None
        name = card.get("card series") or card.get("card sku") or card.get("card model") or key
        devices.append(_device("rocm", int(key[4:]), str(name), total, free, "rocm-smi"))
    return devices


def _amd_value_mib(value: Any) -> int | None:
    """amd-smi figures: ``{"value": 196592, "unit": "MB"}``, ``"196592 MB"`` or a bare number (MB).

    amd-smi's "MB" are MiB (an MI300X's 192 GiB shows as 196592 MB), so they are taken as MiB.
    """
    if value is None:
        return None
    if isinstance(value, dict):
        if "value" not in value:
            return None
        unit = str(value.get("unit", "MB"))
        value = "%s %s" % (value["value"], unit)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        return _mib_field(value, default_unit="mib")
    return None


def _amd_gpu_list(data: Any, tool: str) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        for key in ("gpu_data", "gpus"):
            if isinstance(data.get(key), list):
                return data[key]
        raise ParseError("%s JSON object has no gpu_data list" % tool)
    if isinstance(data, list):
        return data
    raise ParseError("%s JSON is neither a list of GPUs nor an object with gpu_data" % tool)


def parse_amd_smi_json(static_text: str | None = None, metric_text: str | None = None) -> list[dict[str, Any]]:
    """Parse ``amd-smi static --json`` and/or ``amd-smi metric --json`` and merge them by GPU.

    The name comes from ``asic.market_name`` (static), the total from
    ``vram.size`` (static) or ``mem_usage.total_vram`` (metric), the free
    figure from ``mem_usage.free_vram`` (or total minus ``used_vram``).
    Both the older list layout and the newer ``{"gpu_data": [...]}`` wrapper
    are accepted.
    """
    if static_text is None and metric_text is None:
        raise ParseError("amd-smi: give the static or the metric output (or both)")
    merged: dict[int, dict[str, Any]] = {}
    if static_text is not None:
        for gpu in _amd_gpu_list(_json(static_text, "amd-smi static"), "amd-smi static"):
            idx = int(gpu.get("gpu", len(merged)))
            asic = gpu.get("asic") or {}
            vram = gpu.get("vram") or {}
            entry = merged.setdefault(idx, {})
            entry["name"] = asic.get("market_name") or asic.get("device_id") or "AMD GPU %d" % idx
            entry["total"] = _amd_value_mib(vram.get("size"))
            entry["uuid"] = (gpu.get("asic") or {}).get("asic_serial")
    if metric_text is not None:
        for gpu in _amd_gpu_list(_json(metric_text, "amd-smi metric"), "amd-smi metric"):
            idx = int(gpu.get("gpu", len(merged)))
            usage = gpu.get("mem_usage") or {}
            entry = merged.setdefault(idx, {})
            total = _amd_value_mib(usage.get("total_vram"))
            if total is not None:
                entry["total"] = total
            free = _amd_value_mib(usage.get("free_vram"))
            used = _amd_value_mib(usage.get("used_vram"))
            if free is None and used is not None and entry.get("total") is not None:
                free = entry["total"] - used
            entry["free"] = free
    devices = []
    for idx in sorted(merged):
        entry = merged[idx]
        devices.append(_device("rocm", idx, str(entry.get("name") or "AMD GPU %d" % idx), entry.get("total"),
                               entry.get("free"), "amd-smi", uuid=entry.get("uuid")))
    return devices


# ---------------------------------------------------------------------------
# Vulkan: vulkaninfo --summary (names and types) and vulkaninfo (memory heaps)
# ---------------------------------------------------------------------------

_VK_GPU_HEADER = re.compile(r"^GPU(\d+):\s*$")
_VK_FIELD = re.compile(r"^\s+(\w+)\s*=\s*(.*?)\s*$")


def _vulkan_gpus(text: str) -> list[dict[str, str]]:
    """The ``GPUn:`` blocks of ``vulkaninfo --summary``, as dicts of their ``key = value`` fields."""
    gpus: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for line in text.splitlines():
        header = _VK_GPU_HEADER.match(line)
        if header:
            current = {"_vk_index": header.group(1)}
            gpus.append(current)
            continue
        if current is None:
            continue
        field = _VK_FIELD.match(line)
        if field:
            current.setdefault(field.group(1), field.group(2))
        elif line.strip() and not line.startswith((" ", "\t")):
            current = None  # the next top-level section
    return gpus


def parse_vulkaninfo_summary(text: str) -> list[dict[str, Any]]:
    """Parse ``vulkaninfo --summary`` into the devices llama.cpp's Vulkan backend would use.

    ggml-vulkan uses only ``PHYSICAL_DEVICE_TYPE_DISCRETE_GPU`` and
    ``..._INTEGRATED_GPU`` devices (CPU implementations such as llvmpipe are
    skipped) and drops a second driver for the same ``deviceUUID``; it numbers
    the ones it keeps ``Vulkan0``, ``Vulkan1`` ... in enumeration order, which
    is what ``index`` is here (``vk_index`` keeps vulkaninfo's own number).
    The summary has no memory figures: ``total_mib``/``free_mib`` are None;
    see :func:`parse_vulkaninfo_heaps` for the full output.
    """
    devices: list[dict[str, Any]] = []
    seen_uuids: set[str] = set()
    for gpu in _vulkan_gpus(text):
        dev_type = gpu.get("deviceType", "")
        if dev_type not in ("PHYSICAL_DEVICE_TYPE_DISCRETE_GPU", "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU"):
            continue
        uuid = gpu.get("deviceUUID")
        if uuid and uuid in seen_uuids:
            continue
        if uuid:
            seen_uuids.add(uuid)
        devices.append(_device("vulkan", len(devices), gpu.get("deviceName", "Vulkan GPU"), None, None,
                               "vulkaninfo --summary",
                               integrated=dev_type.endswith("INTEGRATED_GPU"),
                               vk_index=int(gpu["_vk_index"]), uuid=uuid, driver=gpu.get("driverName")))
    return devices


_VK_HEAP = re.compile(r"^\s+memoryHeaps\[(\d+)\]:\s*$")
_VK_HEAP_VALUE = re.compile(r"^\s+(size|budget|usage)\s*=\s*(\d+)")


def parse_vulkaninfo_heaps(text: str) -> list[dict[str, Any]]:
    """Device-local memory of each ``GPUn`` in full ``vulkaninfo`` output.

    Returns one dict per GPU block: ``{"vk_index", "device_type", "name",
    "heap_mib", "budget_mib"}`` where ``heap_mib`` sums the heaps flagged
    ``MEMORY_HEAP_DEVICE_LOCAL_BIT`` and ``budget_mib`` sums their
    ``budget - usage`` (present only when the driver has VK_EXT_memory_budget).
    """
    result: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    heap: dict[str, int] | None = None
    heaps: list[dict[str, int]] = []

    def close_gpu() -> None:
        if current is None:
            return
        local = [h for h in heaps if h.get("local")]
        current["heap_mib"] = sum(h.get("size", 0) for h in local) // MIB if local else None
        if local and all("budget" in h for h in local):
            current["budget_mib"] = sum(h["budget"] - h.get("usage", 0) for h in local) // MIB
        else:
            current["budget_mib"] = None
        result.append(current)

    for line in text.splitlines():
        header = _VK_GPU_HEADER.match(line)
        if header:
            close_gpu()
            current = {"vk_index": int(header.group(1)), "device_type": None, "name": None}
            heaps = []
            heap = None
            continue
        if current is None:
            continue
        stripped = line.strip()
        if stripped.startswith("deviceType") and current["device_type"] is None:
            current["device_type"] = stripped.split("=", 1)[1].strip()
        elif stripped.startswith("deviceName") and current["name"] is None:
            current["name"] = stripped.split("=", 1)[1].strip()
        elif _VK_HEAP.match(line):
            heap = {}
            heaps.append(heap)
        elif stripped.startswith("memoryTypes:"):
            heap = None
        elif heap is not None:
            value = _VK_HEAP_VALUE.match(line)
            if value:
                heap[value.group(1)] = int(value.group(2))
            elif stripped == "MEMORY_HEAP_DEVICE_LOCAL_BIT":
                heap["local"] = 1
    close_gpu()
    return result


def merge_vulkan(summary: list[dict[str, Any]], heaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill the summary's devices with the heap figures of the same ``vk_index``."""
    by_index = {h["vk_index"]: h for h in heaps}
    merged = []
    for dev in summary:
        dev = dict(dev)
        heap = by_index.get(dev.get("vk_index"))
        if heap and heap.get("heap_mib") is not None:
            dev["total_mib"] = heap["heap_mib"]
            dev["free_mib"] = heap["budget_mib"] if heap.get("budget_mib") is not None else heap["heap_mib"]
            dev["source"] = "vulkaninfo"
        merged.append(dev)
    return merged


# ---------------------------------------------------------------------------
# Apple silicon (Metal): sysctl hw.memsize [+ iogpu.wired_limit_mb]
# ---------------------------------------------------------------------------

METAL_SMALL_LIMIT_MIB = 32 * 1024


def metal_working_set_mib(memsize_bytes: int, wired_limit_mib: int = 0) -> int:
    """Estimate Metal's ``recommendedMaxWorkingSetSize`` for a Mac with ``memsize_bytes`` of RAM.

    llama.cpp's Metal device reports that value as its total (and, on an idle
    GPU, its free) memory. macOS does not expose it to the shell, so the rule
    used here matches the figures llama.cpp logs on Apple silicon: two thirds of
    unified memory up to 32 GiB, three quarters above (e.g. 16 GiB -> 10922 MiB,
    64 GiB -> 49152 MiB). When the administrator raised the GPU wired limit
    (``sysctl iogpu.wired_limit_mb``, macOS 14+) that limit is used instead.
    The authoritative figure is the one rpc-server prints at start
    (:func:`parse_rpc_server_devices`); prefer it when a worker already runs.
    """
    if wired_limit_mib > 0:
        return wired_limit_mib
    total_mib = memsize_bytes // MIB
    if total_mib <= METAL_SMALL_LIMIT_MIB:
        return total_mib * 2 // 3
    return total_mib * 3 // 4


def parse_metal(memsize_text: str, wired_limit_text: str | None = None,
                chip_name: str | None = None) -> list[dict[str, Any]]:
    """Parse ``sysctl -n hw.memsize`` (and ``sysctl -n iogpu.wired_limit_mb``) into the MTL0 device."""
    try:
        memsize = int(memsize_text.strip())
    except ValueError:
        raise ParseError("sysctl hw.memsize printed %r, expected a byte count" % memsize_text.strip()) from None
    wired = 0
    if wired_limit_text is not None and wired_limit_text.strip():
        try:
            wired = int(wired_limit_text.strip())
        except ValueError:
            raise ParseError("sysctl iogpu.wired_limit_mb printed %r, expected MiB" % wired_limit_text.strip()) from None
    working_set = metal_working_set_mib(memsize, wired)
    name = (chip_name or "").strip() or "Apple GPU"
    # llama.cpp's Metal device is of type GPU, not IGPU, so it is not "integrated" for device ordering.
    return [_device("metal", 0, name, working_set, working_set, "sysctl hw.memsize", integrated=False,
                    unified_memory_mib=memsize // MIB)]


# ---------------------------------------------------------------------------
# CPU: /proc/meminfo
# ---------------------------------------------------------------------------

def parse_meminfo(text: str, name: str = "CPU") -> dict[str, Any]:
    """Parse ``/proc/meminfo``: the CPU "device", total MemTotal, free MemAvailable.

    (llama.cpp's CPU device, as rpc-server prints it, reports MemTotal as both
    its total and its free figure; MemAvailable is what can really be used.)
    """
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+):\s+(\d+)\s*kB\s*$", line)
        if match:
            values[match.group(1)] = int(match.group(2))
    if "MemTotal" not in values:
        raise ParseError("/proc/meminfo has no MemTotal line")
    total = values["MemTotal"] // 1024
    free = values.get("MemAvailable", values.get("MemFree", 0) + values.get("Cached", 0)) // 1024
    return _device("cpu", 0, name, total, free, "/proc/meminfo", integrated=False)


def parse_cpuinfo_model(text: str) -> str | None:
    """The first ``model name`` of ``/proc/cpuinfo`` (None if absent, e.g. on some ARM kernels)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return value.strip()
    return None


# ---------------------------------------------------------------------------
# llama.cpp's own view: rpc-server startup and device listings
# ---------------------------------------------------------------------------

# "  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23664 MiB free)" as printed by
# ggml_backend_rpc_start_server, rpc-server's "available devices:" list and
# llama-server --list-devices. The name may follow a journal prefix.
_GGML_DEVICE_LINE = re.compile(
    r"(?:^|\s)(?P<name>[A-Za-z][A-Za-z_]*[0-9]*): (?P<desc>.*) "
    r"\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")
_RPC_VERSION = re.compile(r"Starting RPC server v(\d+\.\d+\.\d+)")
_RPC_FIELD = re.compile(r"(?:^|\s)(endpoint|local cache|transport)\s+:\s*(.*?)\s*$")


def parse_ggml_device_lines(text: str, source: str = "llama.cpp") -> list[dict[str, Any]]:
    """Every ``NAME: description (X MiB, Y MiB free)`` line, in order, as device dicts.

    ``ggml_name`` is llama.cpp's device name (``CUDA0``, ``CPU``), ``index`` the
    device's position in the listing.
    """
    devices = []
    for line in text.splitlines():
        match = _GGML_DEVICE_LINE.search(line)
        if not match:
            continue
        ggml_name = match.group("name")
        backend = backend_of_ggml_name(ggml_name)
        devices.append(_device(backend, len(devices), match.group("desc"), int(match.group("total")),
                               int(match.group("free")), source, ggml_name=ggml_name))
    return devices


def parse_rpc_server_startup(text: str) -> dict[str, Any]:
    """Parse what rpc-server prints when it starts.

    Returns ``{"version", "endpoint", "cache_dir", "transport", "exposed_to_network",
    "devices"}``; ``devices`` are the devices this server serves, in the order
    llama-server will number them (``RPC<n>`` counts on from the previous
    endpoint). ``cache_dir`` is None when the server runs without ``-c``.
    """
    info: dict[str, Any] = {"version": None, "endpoint": None, "cache_dir": None, "transport": None,
                            "exposed_to_network": "Never expose the RPC server" in text, "devices": []}
    version = _RPC_VERSION.search(text)
    if version:
        info["version"] = version.group(1)
    in_devices = False
    for line in text.splitlines():
        field = _RPC_FIELD.search(line)
        if field:
            key = {"endpoint": "endpoint", "local cache": "cache_dir", "transport": "transport"}[field.group(1)]
            value = field.group(2)
            info[key] = None if (key == "cache_dir" and value == "n/a") else value
            continue
        if line.rstrip().endswith("Devices:") and not _GGML_DEVICE_LINE.search(line):
            in_devices = True
            continue
        if in_devices:
            found = parse_ggml_device_lines(line, source="rpc-server")
            if found:
                found[0]["index"] = len(info["devices"])
                info["devices"].append(found[0])
    if not info["devices"] and info["version"] is None:
        raise ParseError("no 'Starting RPC server' banner and no device lines: not rpc-server output")
    return info


def parse_rpc_server_devices(text: str) -> list[dict[str, Any]]:
    """The devices a running rpc-server exposes, from its startup output (journal or console)."""
    return parse_rpc_server_startup(text)["devices"]


def rpc_exposed_devices(listed: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Which of llama.cpp's devices an rpc-server started without ``-d`` serves.

    tools/rpc/rpc-server.cpp serves every device that is neither the CPU nor an
    ACCEL helper (BLAS, ...); when there is none, it serves the CPU. ``listed``
    is llama.cpp's full device list, e.g. from ``rpc-server -d <unknown>`` or
    :func:`parse_ggml_device_lines`.
    """
    gpus = [dict(d) for d in listed
            if d.get("backend") != "cpu" and str(d.get("ggml_name", "")).lower() not in _ACCEL_NAMES]
    if gpus:
        for position, dev in enumerate(gpus):
            dev["index"] = position
        return gpus
    cpus = [dict(d) for d in listed if d.get("backend") == "cpu"]
    for dev in cpus[:1]:
        dev["index"] = 0
    return cpus[:1]


# ---------------------------------------------------------------------------
# Choosing the devices a build will see, and applying inventory overrides
# ---------------------------------------------------------------------------

BACKEND_PREFERENCE = ("cuda", "rocm", "musa", "sycl", "metal", "vulkan")


def preferred_backend(devices: Iterable[Mapping[str, Any]]) -> str:
    """The GPU backend to build for on a host with these devices (``cpu`` if none).

    A GPU usually shows up under several tools (nvidia-smi *and* vulkaninfo):
    the native backend wins over Vulkan.
    """
    found = {d.get("backend") for d in devices}
    for backend in BACKEND_PREFERENCE:
        if backend in found:
            return backend
    return "cpu"


def select_backend_devices(devices: Iterable[Mapping[str, Any]], backend: str) -> list[dict[str, Any]]:
    """The devices an rpc-server built for ``backend`` would serve: that backend's GPUs, else the CPU."""
    devices = list(devices)
    if backend != "cpu":
        gpus = [dict(d) for d in devices if d.get("backend") == backend]
        if gpus:
            return gpus
    return [dict(d) for d in devices if d.get("backend") == "cpu"][:1]


def override_matches(match: Any, dev: Mapping[str, Any]) -> bool:
    """Does an override's ``match`` select this device?

    ``match`` is one of: ``"*"``/``"all"``; a backend name (``cuda``, ``cpu``);
    ``backend:index`` (``cuda:1``); an integer index (any backend); a llama.cpp
    device name (``CUDA1``); or a case-insensitive glob on the device name.
    """
    if isinstance(match, bool):
        return False
    if isinstance(match, int):
        return dev.get("index") == match
    text = str(match).strip()
    low = text.lower()
    if low in ("*", "all"):
        return True
    if low.isdigit():
        return dev.get("index") == int(low)
    if low in BACKENDS:
        return dev.get("backend") == low
    pair = re.fullmatch(r"([a-z]+):(\d+)", low)
    if pair and pair.group(1) in BACKENDS:
        return dev.get("backend") == pair.group(1) and dev.get("index") == int(pair.group(2))
    ggml_name = dev.get("ggml_name")
    if not ggml_name and dev.get("backend") in GGML_PREFIX:
        ggml_name = ggml_device_name(dev["backend"], dev.get("index", 0))
    if ggml_name and low == str(ggml_name).lower():
        return True
    return fnmatch.fnmatchcase(str(dev.get("name", "")).lower(), low)


OVERRIDE_KEYS = ("total_mib", "free_mib", "reserve_mib", "max_mib")


def unmatched_overrides(device_lists: Sequence[Sequence[Mapping[str, Any]]],
                        overrides: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Messages for overrides whose ``match`` selects no device in any of the lists (typos)."""
    devices = [d for devs in device_lists for d in devs]
    messages = []
    for position, override in enumerate(overrides or []):
        if not any(override_matches(override.get("match"), d) for d in devices):
            messages.append("overrides[%d] match %r selects none of this host's devices: %s"
                            % (position, override.get("match"),
                               ", ".join(sorted({"%s:%s %s" % (d["backend"], d["index"], d["name"]) for d in devices}))
                               or "(none detected)"))
    return messages


def apply_overrides(devices: Sequence[Mapping[str, Any]], overrides: Sequence[Mapping[str, Any]] | None,
                    cpu_reserve_mib: int = 0, require_match: bool = True) -> list[dict[str, Any]]:
    """Apply inventory overrides to detected devices; the inventory wins.

    Each override is ``{"match": ..., "total_mib"?, "free_mib"?, "reserve_mib"?, "max_mib"?}``.
    ``total_mib``/``free_mib`` replace the detected figures, ``reserve_mib`` is
    memory to leave unused, ``max_mib`` caps what the planner may use. Later
    overrides win over earlier ones. ``cpu_reserve_mib`` is the default
    reserve for CPU devices (room for the OS and other services).
    Every device gets ``reserve_mib`` (default 0, or ``cpu_reserve_mib``) and
    ``overridden`` (the keys an override set). With ``require_match`` an
    override that selects no device is an error (a typo would silently do nothing).
    """
    result = []
    for dev in devices:
        out = dict(dev)
        out.setdefault("reserve_mib", cpu_reserve_mib if out.get("backend") == "cpu" else 0)
        out["overridden"] = []
        result.append(out)
    for position, override in enumerate(overrides or []):
        if "match" not in override:
            raise ParseError("overrides[%d] has no 'match' (index, backend, backend:index, device name or glob)"
                             % position)
        unknown = set(override) - set(OVERRIDE_KEYS) - {"match"}
        if unknown:
            raise ParseError("overrides[%d] has unknown keys %s; allowed: match, %s"
                             % (position, ", ".join(sorted(unknown)), ", ".join(OVERRIDE_KEYS)))
        hit = False
        for out in result:
            if not override_matches(override["match"], out):
                continue
            hit = True
            for key in OVERRIDE_KEYS:
                if override.get(key) is None:
                    continue
                value = override[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ParseError("overrides[%d].%s is %r, expected a non-negative integer (MiB)"
                                     % (position, key, value))
                out[key] = value
                if key not in out["overridden"]:
                    out["overridden"].append(key)
        if not hit and require_match:
            raise ParseError("overrides[%d] match %r selects none of the devices: %s"
                             % (position, override["match"],
                                ", ".join("%s:%s %s" % (d["backend"], d["index"], d["name"]) for d in result)
                                or "(none detected)"))
    for out in result:
        if "total_mib" in out["overridden"] and "free_mib" not in out["overridden"]:
            # An inventory total below what the tool saw free (a capped lab host) bounds the free figure too.
            free = out.get("free_mib")
            out["free_mib"] = out["total_mib"] if free is None else min(free, out["total_mib"])
    return result


def usable_mib(dev: Mapping[str, Any]) -> int:
    """Memory the planner may use on a device: free (or total) minus reserve, capped by ``max_mib``."""
    free = dev.get("free_mib")
    if free is None:
        free = dev.get("total_mib")
    if free is None:
        return 0
    usable = max(int(free) - int(dev.get("reserve_mib") or 0), 0)
    if dev.get("max_mib") is not None:
        usable = min(usable, int(dev["max_mib"]))
    return usable


# ---------------------------------------------------------------------------
# Probing a host (commands are run by the caller's ``run``; this only decides)
# ---------------------------------------------------------------------------

PROBE_BACKENDS = ("cuda", "rocm", "vulkan", "metal", "cpu")
RPC_PROBE_DEVICE = "__llamafleet_probe__"

# (typing.List/Tuple/Optional: these aliases are evaluated at import, also on older target Pythons)
Runner = Callable[[List[str]], Tuple[int, str, str]]   # argv -> (rc, stdout, stderr)
Which = Callable[[str], Optional[str]]                 # tool name -> path, or None when missing
ReadText = Callable[[str], Optional[str]]              # file path -> text, or None when unreadable


class _Probe:
    """Collects devices, per-tool status and problems while probing one host."""

    def __init__(self, run: Runner, which: Which, read_text: ReadText) -> None:
        self.run = run
        self.which = which
        self.read_text = read_text
        self.devices: list[dict[str, Any]] = []
        self.tools: dict[str, str] = {}
        self.warnings: list[str] = []
        self.errors: list[str] = []

    def tool(self, name: str, args: Sequence[str], optional: bool = False) -> str | None:
        """Run a tool; None when it is missing (not an error) or failed (recorded)."""
        path = self.which(name)
        if not path:
            self.tools.setdefault(name, "missing")
            return None
        rc, out, err = self.run([path] + list(args))
        if rc != 0:
            detail = (err or out or "").strip().splitlines()
            message = "%s %s failed (rc=%s): %s" % (name, " ".join(args), rc, detail[-1] if detail else "no output")
            if optional:
                self.warnings.append(message)
            else:
                self.tools[name] = "failed"
                self.errors.append(message)
            return None
        self.tools[name] = "ok"
        return out

    def parse(self, name: str, parser: Callable[..., list[dict[str, Any]]], *texts: Any) -> list[dict[str, Any]]:
        try:
            return parser(*texts)
        except ParseError as exc:
            self.tools[name] = "unparsed"
            self.errors.append("%s: %s" % (name, exc))
            return []


def collect_devices(run: Runner, which: Which, read_text: ReadText, system: str = "Linux",
                    backends: Sequence[str] | None = None, rpc_server: str | None = None) -> dict[str, Any]:
    """Probe a host's devices with whatever tools it has.

    ``run(argv) -> (rc, stdout, stderr)`` runs a command, ``which(name)``
    returns a tool's path or None, ``read_text(path)`` a file's text or None;
    the Ansible module passes real ones, tests pass recordings. ``backends``
    limits the probes (default: all that make sense on ``system``). A missing
    tool is normal (no such GPU); a tool that fails or prints something
    unreadable is an error in ``errors``.

    With ``rpc_server`` (path to the built rpc-server), it is started with a
    device name that does not exist, which makes it list llama.cpp's own view
    of the devices and exit without binding a port; ``rpc_devices`` then
    follows exactly the devices that rpc-server serves (CPU figures from
    /proc/meminfo, which unlike llama.cpp's reports MemAvailable).

    Returns ``{"devices", "rpc_devices", "backend", "tools", "warnings", "errors"}``.
    """
    default = ("metal", "cpu") if system == "Darwin" else ("cuda", "rocm", "vulkan", "cpu")
    wanted = list(default if not backends or list(backends) == ["auto"] else backends)
    unknown = [b for b in wanted if b not in PROBE_BACKENDS]
    if unknown:
        raise ParseError("unknown backends %s; choose from auto, %s" % (", ".join(unknown), ", ".join(PROBE_BACKENDS)))
    probe = _Probe(run, which, read_text)

    if "cuda" in wanted:
        out = probe.tool("nvidia-smi", ["--query-gpu=" + NVIDIA_SMI_QUERY, "--format=csv,noheader,nounits"])
        if out is not None:
            probe.devices += probe.parse("nvidia-smi", parse_nvidia_smi_csv, out)
    if "rocm" in wanted:
        static = probe.tool("amd-smi", ["static", "--json"])
        if static is not None:
            metric = probe.tool("amd-smi", ["metric", "--json"], optional=True)
            probe.devices += probe.parse("amd-smi", parse_amd_smi_json, static, metric)
        elif probe.tools.get("amd-smi") == "missing":
            out = probe.tool("rocm-smi", ["--showmeminfo", "vram", "--showproductname", "--json"])
            if out is not None:
                probe.devices += probe.parse("rocm-smi", parse_rocm_smi_json, out)
    if "vulkan" in wanted:
        summary = probe.tool("vulkaninfo", ["--summary"])
        if summary is not None:
            found = probe.parse("vulkaninfo", parse_vulkaninfo_summary, summary)
            if found:
                full = probe.tool("vulkaninfo", [], optional=True)
                if full is not None:
                    found = merge_vulkan(found, parse_vulkaninfo_heaps(full))
            probe.devices += found
    if "metal" in wanted and system == "Darwin":
        memsize = probe.tool("sysctl", ["-n", "hw.memsize"])
        if memsize is not None:
            wired = probe.tool("sysctl", ["-n", "iogpu.wired_limit_mb"], optional=True)
            chip = probe.tool("sysctl", ["-n", "machdep.cpu.brand_string"], optional=True)
            probe.devices += probe.parse("sysctl", parse_metal, memsize, wired, chip)
    if "cpu" in wanted:
        probe.devices += _cpu_device(probe, system)

    for dev in probe.devices:
        if "ggml_name" not in dev and dev["backend"] in GGML_PREFIX:
            dev["ggml_name"] = ggml_device_name(dev["backend"], dev["index"])
    backend = preferred_backend(probe.devices)
    rpc_devices = select_backend_devices(probe.devices, backend)
    if rpc_server:
        listed = _rpc_listing(probe, rpc_server)
        if listed:
            rpc_devices = rpc_exposed_devices(listed)
            cpu = [d for d in probe.devices if d["backend"] == "cpu"]
            for dev in rpc_devices:
                if dev["backend"] == "cpu" and cpu:
                    dev["free_mib"] = cpu[0]["free_mib"]
                    dev["source"] = "rpc-server + /proc/meminfo" if system != "Darwin" else dev["source"]
            backend = preferred_backend(rpc_devices)
    return {"devices": probe.devices, "rpc_devices": rpc_devices, "backend": backend, "tools": probe.tools,
            "warnings": probe.warnings, "errors": probe.errors}


def _cpu_device(probe: _Probe, system: str) -> list[dict[str, Any]]:
    if system == "Darwin":
        out = probe.tool("sysctl", ["-n", "hw.memsize"])
        if out is None:
            return []
        try:
            total = int(out.strip()) // MIB
        except ValueError:
            probe.errors.append("sysctl hw.memsize printed %r" % out.strip())
            return []
        return [_device("cpu", 0, "CPU", total, None, "sysctl hw.memsize")]
    meminfo = probe.read_text("/proc/meminfo")
    if meminfo is None:
        probe.errors.append("/proc/meminfo is not readable")
        return []
    cpuinfo = probe.read_text("/proc/cpuinfo") or ""
    try:
        return [parse_meminfo(meminfo, name=parse_cpuinfo_model(cpuinfo) or "CPU")]
    except ParseError as exc:
        probe.errors.append("/proc/meminfo: %s" % exc)
        return []


def _rpc_listing(probe: _Probe, rpc_server: str) -> list[dict[str, Any]]:
    """llama.cpp's device list as an rpc-server binary sees it (``-d <unknown>`` prints it and exits 1)."""
    rc, out, err = probe.run([rpc_server, "-d", RPC_PROBE_DEVICE])
    listed = parse_ggml_device_lines(out + "\n" + err, source="rpc-server")
    if not listed:
        detail = (err or out or "").strip().splitlines()
        probe.tools["rpc-server"] = "failed"
        probe.errors.append("%s -d %s listed no devices (rc=%s): %s"
                            % (rpc_server, RPC_PROBE_DEVICE, rc, detail[-1] if detail else "no output"))
        return []
    probe.tools["rpc-server"] = "ok"
    return listed
