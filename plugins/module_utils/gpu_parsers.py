# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pure parsers of the tools that report accelerators and memory on a host.

Each parser takes the text a tool printed (nvidia-smi, rocm-smi, amd-smi,
vulkaninfo, /proc/meminfo, rpc-server's device listing) and
returns a list of device dicts (see ``gpu_devices``). Nothing here runs a
command or touches the host: ``gpu_probe`` decides which commands to run and
the ``gpu_facts`` module runs them; these functions only read their output,
so they are tested on recorded outputs.

Stdlib only: shared by the Ansible modules (module_utils) and the
``llamafleet`` library (``llamafleet.core.gpu_parsers``).
"""

from __future__ import annotations

import csv
import io
import json
import re
from typing import Any

from .gpu_devices import MIB, ParseError, backend_of_ggml_name, new_device

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
        devices.append(new_device("cuda", index, row[1].strip(), total, free, "nvidia-smi",
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
        devices.append(new_device("rocm", int(key[4:]), str(name), total, free, "rocm-smi"))
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
        devices.append(new_device("rocm", idx, str(entry.get("name") or "AMD GPU %d" % idx), entry.get("total"),
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


def parse_vk_visible_devices(value: str | None) -> list[int] | None:
    """``GGML_VK_VISIBLE_DEVICES`` (comma-separated Vulkan device indices) as llama.cpp reads it; None when unset
    or empty. Anything else is a ParseError naming the variable."""
    if value is None or not value.strip():
        return None
    try:
        return [int(item) for item in value.split(",")]
    except ValueError:
        raise ParseError("GGML_VK_VISIBLE_DEVICES=%r: expected comma-separated Vulkan device indices such as 0,1"
                         % value) from None


def parse_vulkaninfo_summary(text: str, visible: list[int] | None = None) -> list[dict[str, Any]]:
    """Parse ``vulkaninfo --summary`` into the devices llama.cpp's Vulkan backend would use.

    By default ggml-vulkan uses only ``PHYSICAL_DEVICE_TYPE_DISCRETE_GPU`` and
    ``..._INTEGRATED_GPU`` devices (CPU implementations such as llvmpipe are
    skipped) and drops a second driver for the same ``deviceUUID``; it numbers
    the ones it keeps ``Vulkan0``, ``Vulkan1`` ... in enumeration order, which
    is what ``index`` is here (``vk_index`` keeps vulkaninfo's own number).
    With ``visible`` (``GGML_VK_VISIBLE_DEVICES``, see :func:`parse_vk_visible_devices`)
    it uses exactly those vulkaninfo indices, in that order, whatever their type.
    The summary has no memory figures: ``total_mib``/``free_mib`` are None;
    see :func:`parse_vulkaninfo_heaps` for the full output.
    """
    devices: list[dict[str, Any]] = []
    gpus = _vulkan_gpus(text)
    if visible is not None:
        by_index = {int(gpu["_vk_index"]): gpu for gpu in gpus}
        missing = [index for index in visible if index not in by_index]
        if missing:
            raise ParseError("GGML_VK_VISIBLE_DEVICES names Vulkan device(s) %s, but vulkaninfo lists %s"
                             % (", ".join(map(str, missing)), ", ".join(map(str, sorted(by_index))) or "none"))
        for index in visible:
            gpu = by_index[index]
            dev_type = gpu.get("deviceType", "")
            devices.append(new_device("vulkan", len(devices), gpu.get("deviceName", "Vulkan GPU"), None, None,
                                      "vulkaninfo --summary (GGML_VK_VISIBLE_DEVICES)",
                                      integrated=not dev_type.endswith("DISCRETE_GPU"), vk_index=index,
                                      uuid=gpu.get("deviceUUID"), driver=gpu.get("driverName")))
        return devices
    seen_uuids: set[str] = set()
    for gpu in gpus:
        dev_type = gpu.get("deviceType", "")
        if dev_type not in ("PHYSICAL_DEVICE_TYPE_DISCRETE_GPU", "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU"):
            continue
        uuid = gpu.get("deviceUUID")
        if uuid and uuid in seen_uuids:
            continue
        if uuid:
            seen_uuids.add(uuid)
        devices.append(new_device("vulkan", len(devices), gpu.get("deviceName", "Vulkan GPU"), None, None,
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
    return new_device("cpu", 0, name, total, free, "/proc/meminfo", integrated=False)


def parse_cpuinfo_model(text: str) -> str | None:
    """The first ``model name`` of ``/proc/cpuinfo`` (None if absent, e.g. on some ARM kernels)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return value.strip()
    return None


# ---------------------------------------------------------------------------
# llama.cpp's own view: rpc-server's and llama-server's device listings
# ---------------------------------------------------------------------------

# "  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23664 MiB free)" as printed by
# ggml_backend_rpc_start_server, rpc-server's "available devices:" list and
# llama-server --list-devices. The name may follow a journal prefix.
_GGML_DEVICE_LINE = re.compile(
    r"(?:^|\s)(?P<name>[A-Za-z][A-Za-z_]*[0-9]*): (?P<desc>.*) "
    r"\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")


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
        devices.append(new_device(backend, len(devices), match.group("desc"), int(match.group("total")),
                                  int(match.group("free")), source, ggml_name=ggml_name))
    return devices
