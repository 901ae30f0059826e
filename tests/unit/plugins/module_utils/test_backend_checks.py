"""backend_checks: what a host has for each backend (on pretend hosts) and whether it can run one."""

from __future__ import annotations

from typing import Any

import pytest

from llamafleet.core import backend_checks as bc
from llamafleet.core.constants import GROUP_BACKEND_PREFIX, LLAMACPP_BACKENDS

LDCONFIG_VULKAN = (
    "1234 libs found in cache `/etc/ld.so.cache'\n"
    "\tlibvulkan.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libvulkan.so.1\n"
    "\tlibvulkan.so (libc6,x86-64) => /lib/x86_64-linux-gnu/libvulkan.so\n"
)
LDCONFIG_PLAIN = "812 libs found in cache `/etc/ld.so.cache'\n\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1\n"


class FakeHost:
    """Files, directories and tools of a pretend host."""

    def __init__(self, files: dict[str, str] | None = None, tools: dict[str, tuple[int, str, str]] | None = None,
                 dirs: dict[str, list[str]] | None = None) -> None:
        self.files = files or {}
        self.tools = tools or {}
        self.dirs = dirs or {}

    def which(self, name: str) -> str | None:
        return "/usr/sbin/" + name if name in self.tools else None

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        return self.tools[argv[0].rsplit("/", 1)[-1]]

    def read_text(self, path: str) -> str | None:
        return self.files.get(path)

    def exists(self, path: str) -> bool:
        return path in self.files or path in self.dirs

    def listdir(self, path: str) -> list[str] | None:
        return self.dirs.get(path)

    def facts(self) -> dict[str, Any]:
        return bc.probe_backend_facts(self.run, self.which, self.read_text, self.exists, self.listdir)


def drm(*vendors: str) -> dict[str, Any]:
    """/sys/class/drm with one card per vendor (and a connector entry, which is not a card)."""
    names = ["card%d" % i for i in range(len(vendors))] + ["card0-HDMI-A-1", "renderD128", "version"]
    files = {"/sys/class/drm/card%d/device/vendor" % i: v + "\n" for i, v in enumerate(vendors)}
    return {"dirs": {"/sys/class/drm": names}, "files": files}


LAB = FakeHost(tools={"ldconfig": (0, LDCONFIG_PLAIN, "")})  # minbase Debian 12 container: no GPU, no /sys/class/drm
NVIDIA = FakeHost(files={"/proc/driver/nvidia/version": "NVRM version: 550.54.15\n", **drm("0x10de")["files"]},
                  tools={"ldconfig": (0, LDCONFIG_VULKAN, ""), "nvidia-smi": (0, "", "")},
                  dirs=drm("0x10de")["dirs"])
AMD = FakeHost(files={"/dev/kfd": "", **drm("0x1a03", "0x1002")["files"]}, tools={"ldconfig": (0, LDCONFIG_PLAIN, "")},
               dirs=drm("0x1a03", "0x1002")["dirs"])
INTEL = FakeHost(files=drm("0x8086")["files"], tools={"ldconfig": (0, LDCONFIG_VULKAN, "")}, dirs=drm("0x8086")["dirs"])


@pytest.mark.parametrize(("host", "expected"), [
    (LAB, {"nvidia_driver": False, "nvidia_smi": None, "vulkan_loader": None, "kfd": False, "gpu_vendors": []}),
    (NVIDIA, {"nvidia_driver": True, "nvidia_smi": "/usr/sbin/nvidia-smi",
              "vulkan_loader": "/lib/x86_64-linux-gnu/libvulkan.so.1", "kfd": False, "gpu_vendors": ["0x10de"]}),
    (AMD, {"nvidia_driver": False, "nvidia_smi": None, "vulkan_loader": None, "kfd": True,
           "gpu_vendors": ["0x1a03", "0x1002"]}),
    # no ldconfig cache entry: the usual library directories are looked at
    (FakeHost(files={"/usr/lib64/libvulkan.so.1": ""}), {"nvidia_driver": False, "nvidia_smi": None,
                                                         "vulkan_loader": "/usr/lib64/libvulkan.so.1", "kfd": False,
                                                         "gpu_vendors": []}),
    # ldconfig fails: same
    (FakeHost(files={"/usr/lib/libvulkan.so.1": ""}, tools={"ldconfig": (1, LDCONFIG_VULKAN, "boom")}),
     {"nvidia_driver": False, "nvidia_smi": None, "vulkan_loader": "/usr/lib/libvulkan.so.1", "kfd": False,
      "gpu_vendors": []}),
], ids=["lab", "nvidia", "amd", "loader-by-path", "ldconfig-fails"])
def test_probe(host: FakeHost, expected: dict[str, Any]) -> None:
    assert host.facts() == expected


@pytest.mark.parametrize(("text", "expected"), [
    (LDCONFIG_VULKAN, "/lib/x86_64-linux-gnu/libvulkan.so.1"),
    (LDCONFIG_PLAIN, None),
    ("", None),
])
def test_parse_ldconfig(text: str, expected: str | None) -> None:
    assert bc.parse_ldconfig(text, "libvulkan.so.1") == expected


def fragments(*parts: str) -> list[str]:
    return list(parts)


# backend, host, groups, None (passes) or fragments the message must hold
CASES = [
    ("cpu", LAB, [], None),
    ("cpu", NVIDIA, ["llamafleet_workers"], None),
    ("cuda", NVIDIA, [], None),
    ("vulkan", NVIDIA, [], None),
    ("vulkan", INTEL, [], None),
    ("rocm", AMD, [], None),
    ("cuda", LAB, [], fragments("llamacpp_build_backend=cuda needs the NVIDIA driver",
                                "/proc/driver/nvidia/version is missing", "no nvidia-smi")),
    ("cuda", FakeHost(files={"/proc/driver/nvidia/version": "x"}), [],
     fragments("llamacpp_build_backend=cuda", "this host has no nvidia-smi on the PATH.")),
    ("vulkan", LAB, [], fragments("llamacpp_build_backend=vulkan needs a Vulkan loader", "no libvulkan.so.1")),
    ("vulkan", AMD, [], fragments("llamacpp_build_backend=vulkan needs a Vulkan loader")),
    ("rocm", INTEL, [], fragments("llamacpp_build_backend=rocm needs an AMD GPU", "no /dev/kfd",
                                  "GPUs of Intel (0x8086), none of AMD (0x1002)")),
    ("rocm", LAB, [], fragments("llamacpp_build_backend=rocm", "no /dev/kfd")),
    ("rocm", NVIDIA, [], fragments("GPUs of NVIDIA (0x10de), none of AMD")),
    ("metal", LAB, [], fragments("llamacpp_build_backend=metal builds for macOS",
                                 "macOS hosts are not supported as workers or orchestrator")),
    ("tpu", LAB, [], fragments("llamacpp_build_backend=tpu is not a known backend", "cpu, cuda, vulkan, rocm")),
    ("cuda", NVIDIA, ["llamafleet_backend_cuda"], None),
    ("cuda", NVIDIA, ["llamafleet_backend_cuda", "llamafleet_backend_vulkan"],
     fragments("llamacpp_build_backend is ambiguous",
               "backend groups llamafleet_backend_cuda and llamafleet_backend_vulkan")),
    ("cpu", NVIDIA, ["llamafleet_backend_cuda"],
     fragments("llamacpp_build_backend=cpu, but this host is in the backend group llamafleet_backend_cuda",
               "Set llamacpp_build_backend: cuda")),
    ("cpu", LAB, ["llamafleet_backend_metal"], fragments("llamafleet_backend_metal names no backend")),
    # the groups are checked before the host: a misplaced host is told about its groups
    ("cuda", LAB, ["llamafleet_backend_cpu"], fragments("llamacpp_build_backend=cuda, but")),
]


@pytest.mark.parametrize(("backend", "host", "groups", "expected"), CASES)
def test_backend_problem(backend: str, host: FakeHost, groups: list[str], expected: list[str] | None) -> None:
    problem = bc.backend_problem(backend, host.facts(), groups)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        for part in expected:
            assert part in problem


def test_every_served_backend_passes_on_a_host_that_has_everything() -> None:
    everything = {"nvidia_driver": True, "nvidia_smi": "/usr/bin/nvidia-smi", "vulkan_loader": "/x/libvulkan.so.1",
                  "kfd": True, "gpu_vendors": ["0x1002", "0x10de"]}
    assert bc.SERVED_BACKENDS == tuple(b for b in LLAMACPP_BACKENDS if b != "metal")
    for backend in bc.SERVED_BACKENDS:
        assert bc.backend_problem(backend, everything, [GROUP_BACKEND_PREFIX + backend]) is None


def test_group_backends_reads_the_prefix_only() -> None:
    assert bc.group_backends(["llamafleet", "llamafleet_workers", "llamafleet_backend_rocm"]) == {
        "llamafleet_backend_rocm": "rocm"}
