# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The device dicts that describe a host's accelerators, and what is decided about them.

A *device dict* is::

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
This module names devices the way llama.cpp does, chooses the ones an
rpc-server serves, applies inventory overrides and computes the memory the
split planner may use. The tools' outputs are read by ``gpu_parsers``; which
tools to run is ``gpu_probe``.

Stdlib only: shared by the Ansible modules (module_utils) and the
``llamafleet`` library (``llamafleet.core.gpu_devices``).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Iterable, Mapping, Sequence

from .backends import BACKENDS as _BUILT

MIB = 1024 * 1024

# Devices llama.cpp may report: of the backends llamafleet builds (module_utils/backends.py), and of those an
# rpc-server of another build may list.
_LISTED_ONLY = {"musa": "MUSA", "sycl": "SYCL"}
BACKENDS = tuple(_BUILT) + tuple(_LISTED_ONLY) + ("other",)

# llama.cpp's device-name prefix for each backend (ggml/include/ggml-cuda.h:
# GGML_CUDA_NAME is "CUDA", "ROCm" for HIP builds and "MUSA"; ggml-vulkan.h:
# GGML_VK_NAME "Vulkan"; ggml-metal-device.m: "MTL%d"; the CPU device is "CPU").
GGML_PREFIX = {**{name: b.ggml_prefix for name, b in _BUILT.items()}, **_LISTED_ONLY}
_PREFIX_TO_BACKEND = {prefix.lower(): backend for backend, prefix in GGML_PREFIX.items()}

# Device names of ggml "ACCEL" devices (BLAS and similar CPU helpers): rpc-server
# never serves them on its own, like the CPU.
_ACCEL_NAMES = ("blas", "zendnn", "openvino_cpu")


class ParseError(ValueError):
    """A tool's output, or an inventory override, is not in a format this code understands."""


def new_device(backend: str, index: int, name: str, total_mib: int | None, free_mib: int | None,
               source: str, integrated: bool = False, **extra: Any) -> dict[str, Any]:
    """A device dict; ``extra`` keys whose value is None are left out."""
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


# ---------------------------------------------------------------------------
# llama.cpp's device names
# ---------------------------------------------------------------------------

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
# Choosing the devices a build will see
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


def rpc_exposed_devices(listed: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Which of llama.cpp's devices an rpc-server started without ``-d`` serves.

    tools/rpc/rpc-server.cpp serves every device that is neither the CPU nor an
    ACCEL helper (BLAS, ...); when there is none, it serves the CPU. ``listed``
    is llama.cpp's full device list, e.g. from ``rpc-server -d <unknown>``
    (``gpu_parsers.parse_ggml_device_lines``).
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
# Inventory overrides and usable memory
# ---------------------------------------------------------------------------

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


def _device_list(labels: Iterable[str]) -> str:
    """The devices' labels (:func:`_label`) for a message, or ``(none detected)``."""
    return ", ".join(labels) or "(none detected)"


def _label(dev: Mapping[str, Any]) -> str:
    """``cuda:0 NVIDIA GeForce RTX 4090``: how messages name a device."""
    return "%s:%s %s" % (dev["backend"], dev["index"], dev["name"])


def unmatched_overrides(device_lists: Sequence[Sequence[Mapping[str, Any]]],
                        overrides: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Messages for overrides whose ``match`` selects no device in any of the lists (typos)."""
    devices = [d for devs in device_lists for d in devs]
    messages = []
    for position, override in enumerate(overrides or []):
        if not any(override_matches(override.get("match"), d) for d in devices):
            messages.append("overrides[%d] match %r selects none of this host's devices: %s"
                            % (position, override.get("match"), _device_list(sorted({_label(d) for d in devices}))))
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
                             % (position, override["match"], _device_list(_label(d) for d in result)))
    for out in result:
        if "total_mib" in out["overridden"] and "free_mib" not in out["overridden"]:
            # An inventory total below what the tool saw free (a capped lab host) bounds the free figure too.
            free = out.get("free_mib")
            out["free_mib"] = out["total_mib"] if free is None else min(free, out["total_mib"])
    return result


def usable_mib(dev: Mapping[str, Any]) -> int:
    """Memory the planner may use on a device: free (or total) minus reserve, capped by ``max_mib`` and by
    ``limit_mib`` (the ``MemoryMax=`` its service unit runs under, gpu_facts' ``memory_max_mib``)."""
    free = dev.get("free_mib")
    if free is None:
        free = dev.get("total_mib")
    if free is None:
        return 0
    usable = max(int(free) - int(dev.get("reserve_mib") or 0), 0)
    for cap in ("max_mib", "limit_mib"):
        if dev.get(cap) is not None:
            usable = min(usable, int(dev[cap]))
    return usable
