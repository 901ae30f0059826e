# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The llama.cpp backends llamafleet builds and serves: one table, read by everything that differs by backend.

:data:`BACKENDS` maps each backend's name (the role variable ``llamacpp_build_backend``) to a
:class:`Backend`. Who reads which field:

* ``cmake``, ``gpu_targets``: ``llamacpp_build.cmake_args`` (``BACKEND_CMAKE``);
* ``ggml_prefix``: ``gpu_devices.GGML_PREFIX``, llama.cpp's device names (``CUDA0``, ``Vulkan1``);
* ``linux``: ``backend_checks`` (preflight refuses the others) and ``systemd_unit.device_policy``;
* ``device_nodes``: ``systemd_unit.device_policy`` (none: the unit's device policy is closed);
* ``user_groups``: the roles' service user (``roles/_common/tasks/user.yml``, through the
  ``constants`` lookup's ``backend_user_groups``), those of them the host has;
* ``needs``, ``fix``: ``backend_checks.host_problem``'s message (what the host lacks is
  ``backend_checks._LACKS[name]``, code per backend);
* ``unit_environment``: ``llama_server_plan`` sets it in llama-server's unit when the plan
  uses a local device of the backend (unless the user set it);
* ``build_packages``: per OS family, what ``roles/llamacpp_build/tasks/packages.yml`` installs
  (through the ``constants`` lookup's ``backend_build_packages``).

Code per backend lives beside its use and is keyed by the same names: the probe of its
devices (``gpu_probe._PROBES``) and the check of what the host lacks
(``backend_checks._LACKS``). YAML that Ansible needs static (the ``choices`` of
``llamacpp_build_backend`` in ``roles/llamacpp_build/meta/argument_specs.yml``) is held equal to
this table by ``tests/unit/plugins/module_utils/test_backends.py``.

Stdlib only: module_utils ship to the hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Backend:
    """One llama.cpp backend: what building, checking and serving it need."""

    name: str
    cmake: Tuple[str, ...]                   # the CMake switches that turn it on
    ggml_prefix: str                         # llama.cpp's device-name prefix (CUDA -> CUDA0)
    linux: bool = True                       # False: macOS only (metal), refused by preflight, no unit
    device_nodes: Tuple[str, ...] = ()       # globs of the nodes it opens; () closes the unit's devices
    user_groups: Tuple[str, ...] = ()        # groups the service user joins (those the host has)
    needs: str = ""                          # what a host needs to run it, for preflight's message
    fix: str = ""                            # how to get it
    gpu_targets: Optional[Tuple[str, str]] = None   # (llamacpp_build setting, CMake variable) of GPU targets
    unit_environment: Mapping[str, str] = field(default_factory=dict)
    build_packages: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)  # OS family -> packages


# NVIDIA's Vulkan driver uses NVIDIA's nodes, Mesa's Vulkan drivers /dev/dri.
_NVIDIA_NODES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                 "/dev/nvidia-modeset")
_DRI_NODES = ("/dev/dri/card*", "/dev/dri/renderD*")
# GPU device nodes are the groups video and render's (udev); a host without the render group has none of it.
_GPU_GROUPS = ("video", "render")

# In the order of the role's choices and of messages that list them.
BACKENDS: Dict[str, Backend] = {b.name: b for b in (
    Backend("cpu", (), "CPU", build_packages={"Debian": (), "RedHat": ()}),
    Backend("cuda", ("-DGGML_CUDA=ON",), "CUDA", device_nodes=_NVIDIA_NODES, user_groups=_GPU_GROUPS,
            needs="the NVIDIA driver", fix="Install the NVIDIA driver (and the CUDA toolkit on build hosts)",
            gpu_targets=("cuda_architectures", "CMAKE_CUDA_ARCHITECTURES"),
            # CUDA0, CUDA1 ... in the PCI bus order that nvidia-smi (and so gpu_facts) reports; CUDA's own
            # default puts the fastest GPU first.
            unit_environment={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
            build_packages={"Debian": ("nvidia-cuda-toolkit",), "RedHat": ("cuda-toolkit",)}),
    Backend("vulkan", ("-DGGML_VULKAN=ON",), "Vulkan", device_nodes=_DRI_NODES + _NVIDIA_NODES,
            user_groups=_GPU_GROUPS, needs="a Vulkan loader",
            fix="Install the Vulkan loader and a Vulkan driver (Debian: libvulkan1 and mesa-vulkan-drivers or the "
                "GPU vendor's)",
            build_packages={"Debian": ("libvulkan-dev", "glslc", "spirv-headers"),
                            "RedHat": ("vulkan-headers", "vulkan-loader-devel", "glslc", "spirv-headers-devel")}),
    Backend("metal", ("-DGGML_METAL=ON",), "MTL", linux=False),
    Backend("rocm", ("-DGGML_HIP=ON",), "ROCm", device_nodes=("/dev/kfd",) + _DRI_NODES, user_groups=_GPU_GROUPS,
            needs="an AMD GPU with ROCm", fix="Install ROCm on a host with an AMD GPU",
            gpu_targets=("rocm_targets", "AMDGPU_TARGETS"),
            build_packages={"Debian": ("hipcc", "librocblas-dev", "libhipblas-dev"),
                            "RedHat": ("rocm-hip-devel", "rocblas-devel", "hipblas-devel")}),
)}

# The backends a Linux host can build and serve (the others need macOS, see constants.MACOS_UNSUPPORTED).
LINUX_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.linux)


def user_groups() -> dict:
    """``{backend: [group, ...]}``: the groups each backend's service user joins (the constants lookup's)."""
    return {name: list(b.user_groups) for name, b in BACKENDS.items()}


def build_packages() -> dict:
    """``{OS family: {backend: [package, ...]}}``: what the llamacpp_build role installs (the constants lookup's)."""
    families = sorted({family for b in BACKENDS.values() for family in b.build_packages})
    return {family: {name: list(b.build_packages[family]) for name, b in BACKENDS.items() if family in b.build_packages}
            for family in families}
