# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Can this host run the llama.cpp backend it was given?  Decided before anything changes.

Two halves: :func:`probe_backend_facts` reads what a host has (the NVIDIA
driver, ``nvidia-smi``, a Vulkan loader, ``/dev/kfd``, the PCI vendors of its
GPUs) through callables the caller passes (the ``backend_facts`` module passes
real ones, tests pass recordings); :func:`backend_problem` turns a backend, those
facts and the host's inventory groups into one message, or None when the host
can run the backend. The llamacpp_build role's preflight asserts on it.

Backend groups: a host in the inventory group ``llamafleet_backend_<backend>``
(constants.GROUP_BACKEND_PREFIX) builds for that backend (the group's group_vars
set ``llamacpp_build_backend``). A host may be in one such group at most, and
its ``llamacpp_build_backend`` must be the group's backend.

What is checked here is what the host must have whether or not it compiles:
build hosts also need the toolkits and headers (the Vulkan header check stays in
the role, where the header path of the OS family is known).

Stdlib only: shared by the Ansible modules (module_utils) and the
``llamafleet`` library (``llamafleet.core.backend_checks``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable, Mapping, Optional

from .backends import BACKENDS, LINUX_BACKENDS
from .constants import GROUP_BACKEND_PREFIX, MACOS_UNSUPPORTED
from .gpu_probe import ReadText, Runner, Which, read_text_file

Exists = Callable[[str], bool]                              # path -> whether it exists
ListDir = Callable[[str], Optional[list]]                   # directory -> entry names, or None

VARIABLE = "llamacpp_build_backend"
NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"
VULKAN_LOADER = "libvulkan.so.1"
# Where distributions install the loader, for hosts whose ldconfig cache does not list it.
VULKAN_LOADER_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                      "/usr/local/lib")
KFD = "/dev/kfd"
DRM_DIR = "/sys/class/drm"
AMD_VENDOR = "0x1002"
PCI_VENDORS = {"0x1002": "AMD", "0x10de": "NVIDIA", "0x8086": "Intel", "0x1a03": "ASPEED", "0x1af4": "virtio",
               "0x1234": "QEMU", "0x15ad": "VMware", "0x102b": "Matrox"}
# The backends a served host can use (metal needs macOS, see MACOS_UNSUPPORTED).
SERVED_BACKENDS = LINUX_BACKENDS


def parse_ldconfig(text: str, soname: str) -> str | None:
    """The path ``ldconfig -p`` lists for ``soname`` (first entry), or None.

    >>> parse_ldconfig("\\tlibvulkan.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libvulkan.so.1\\n", "libvulkan.so.1")
    '/lib/x86_64-linux-gnu/libvulkan.so.1'
    """
    for line in text.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep and name.split(" (")[0] == soname:
            return path.strip()
    return None


def probe_backend_facts(run: Runner, which: Which, read_text: ReadText, exists: Exists,
                        listdir: ListDir) -> dict[str, Any]:
    """What a host has for each GPU backend; read-only.

    Returns ``{"nvidia_driver": bool, "nvidia_smi": path|None, "vulkan_loader": path|None,
    "kfd": bool, "gpu_vendors": [PCI vendor ids of /sys/class/drm/card*, lower-case]}``.
    """
    loader = None
    ldconfig = which("ldconfig")
    if ldconfig:
        rc, out, _err = run([ldconfig, "-p"])
        loader = parse_ldconfig(out, VULKAN_LOADER) if rc == 0 else None
    if loader is None:
        loader = next((p for p in ("%s/%s" % (d, VULKAN_LOADER) for d in VULKAN_LOADER_DIRS) if exists(p)), None)
    vendors = []
    for name in sorted(listdir(DRM_DIR) or []):
        if re.fullmatch(r"card[0-9]+", name):
            text = read_text("%s/%s/device/vendor" % (DRM_DIR, name))
            if text and text.strip():
                vendors.append(text.strip().lower())
    return {
        "nvidia_driver": exists(NVIDIA_DRIVER_FILE),
        "nvidia_smi": which("nvidia-smi"),
        "vulkan_loader": loader,
        "kfd": exists(KFD),
        "gpu_vendors": vendors,
    }


def group_backends(group_names: Iterable[str]) -> dict[str, str]:
    """The host's backend groups, each with the backend its name gives: ``{group: backend}``."""
    return {g: g[len(GROUP_BACKEND_PREFIX):] for g in sorted(group_names) if g.startswith(GROUP_BACKEND_PREFIX)}


def group_problem(backend: str, group_names: Iterable[str]) -> str | None:
    """Why the host's backend groups disagree with each other or with ``backend``; None when they agree."""
    groups = group_backends(group_names)
    unknown = [g for g, b in groups.items() if b not in SERVED_BACKENDS]
    if unknown:
        return ("the inventory group %s names no backend a served host can use (%s are: %s)"
                % (" and ".join(unknown), VARIABLE, ", ".join(SERVED_BACKENDS)))
    if len(groups) > 1:
        return ("%s is ambiguous: this host is in the backend groups %s, and a host builds for one backend. "
                "Keep it in one %s<backend> group." % (VARIABLE, " and ".join(groups), GROUP_BACKEND_PREFIX))
    for group, wanted in groups.items():
        if backend != wanted:
            return ("%s=%s, but this host is in the backend group %s. Set %s: %s in that group's group_vars, "
                    "or take the host out of the group." % (VARIABLE, backend, group, VARIABLE, wanted))
    return None


def _vendor_names(vendors: Iterable[str]) -> str:
    return ", ".join("%s (%s)" % (PCI_VENDORS.get(v, "unknown vendor"), v) for v in vendors)


def _cuda_lacks(facts: Mapping[str, Any]) -> list[str]:
    missing = []
    if not facts.get("nvidia_driver"):
        missing.append("no NVIDIA kernel driver (%s is missing)" % NVIDIA_DRIVER_FILE)
    if not facts.get("nvidia_smi"):
        missing.append("no nvidia-smi on the PATH")
    return missing


def _vulkan_lacks(facts: Mapping[str, Any]) -> list[str]:
    if facts.get("vulkan_loader"):
        return []
    return ["no %s (neither in ldconfig -p nor in %s)" % (VULKAN_LOADER, ", ".join(VULKAN_LOADER_DIRS))]


def _rocm_lacks(facts: Mapping[str, Any]) -> list[str]:
    missing = []
    vendors = list(facts.get("gpu_vendors") or [])
    if not facts.get("kfd"):
        missing.append("no %s (the amdgpu kernel driver is not loaded)" % KFD)
    if vendors and AMD_VENDOR not in vendors:
        missing.append("GPUs of %s, none of AMD (%s)" % (_vendor_names(vendors), AMD_VENDOR))
    return missing


# What a host lacks for each backend that needs something (module_utils/backends.py says what it needs and how
# to get it, for the message), one phrase each (empty: nothing).
_LACKS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "cuda": _cuda_lacks,
    "vulkan": _vulkan_lacks,
    "rocm": _rocm_lacks,
}


def host_problem(backend: str, facts: Mapping[str, Any]) -> str | None:
    """Why this host (``facts`` from :func:`probe_backend_facts`) cannot run ``backend``; None when it can."""
    if backend in BACKENDS and not BACKENDS[backend].linux:
        return ("%s=%s builds for macOS: %s. Choose one of %s."
                % (VARIABLE, backend, MACOS_UNSUPPORTED, ", ".join(SERVED_BACKENDS)))
    missing = _LACKS[backend](facts) if backend in _LACKS else []
    if not missing:
        return None
    return ("%s=%s needs %s, and this host has %s. %s, or choose another backend."
            % (VARIABLE, backend, BACKENDS[backend].needs, " and ".join(missing), BACKENDS[backend].fix))


def backend_problem(backend: str, facts: Mapping[str, Any], group_names: Iterable[str] = ()) -> str | None:
    """The first reason this host cannot build and serve ``backend``, or None.

    Checked in order: the backend is known, the host's backend groups agree
    with it (:func:`group_problem`), the host can run it (:func:`host_problem`).
    """
    if backend not in BACKENDS:
        return "%s=%s is not a known backend; choose one of %s." % (VARIABLE, backend, ", ".join(SERVED_BACKENDS))
    return group_problem(backend, group_names) or host_problem(backend, facts)


def _listdir(path: str) -> list | None:
    try:
        return os.listdir(path)
    except OSError:
        return None


def check_this_host(backend: str, group_names: Iterable[str], run: Runner, which: Which) -> dict[str, Any]:
    """``{facts, problem}`` of the host this runs on (``run`` and ``which`` from the module) for ``backend``."""
    facts = probe_backend_facts(run, which, read_text_file, os.path.exists, _listdir)
    return {"facts": facts, "problem": backend_problem(backend, facts, group_names)}
