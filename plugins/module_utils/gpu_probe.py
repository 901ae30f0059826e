# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Probing a host's devices: which tools to run, in which order, and what to make of their results.

The commands are run by the caller's ``run`` (the ``gpu_facts`` module passes
one that runs them on the host, tests pass recordings); their outputs are read
by ``gpu_parsers`` and the devices chosen by ``gpu_devices``.

Stdlib only: shared by the Ansible modules (module_utils) and the
``llamafleet`` library (``llamafleet.core.gpu_probe``).
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from .atomic_file import read_text
from .gpu_devices import (
    GGML_PREFIX,
    ParseError,
    ggml_device_name,
    preferred_backend,
    rpc_exposed_devices,
    select_backend_devices,
)
from .gpu_memory import MainPid, memory_figures, read_memory_limits
from .gpu_parsers import (
    NVIDIA_SMI_QUERY,
    merge_vulkan,
    parse_amd_smi_json,
    parse_cpuinfo_model,
    parse_ggml_device_lines,
    parse_meminfo,
    parse_nvidia_smi_csv,
    parse_rocm_smi_json,
    parse_vulkaninfo_heaps,
    parse_vk_visible_devices,
    parse_vulkaninfo_summary,
)
from .systemd_show import show_argv

RPC_PROBE_DEVICE = "__llamafleet_probe__"

# (typing.List/Tuple/Optional: these aliases are evaluated at import, also on older target Pythons)
Runner = Callable[[List[str]], Tuple[int, str, str]]   # argv -> (rc, stdout, stderr)
Which = Callable[[str], Optional[str]]                 # tool name -> path, or None when missing
ReadText = Callable[[str], Optional[str]]              # file path -> text, or None when unreadable


def read_text_file(path: str) -> str | None:
    """A file's text (undecodable bytes replaced), or None when it cannot be read: a real host's ReadText."""
    try:
        return read_text(path)
    except OSError:
        return None


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


def collect_devices(run: Runner, which: Which, read_text: ReadText,
                    backends: Sequence[str] | None = None, rpc_server: str | None = None,
                    environ: Mapping[str, str] | None = None, units: Sequence[str] = ()) -> dict[str, Any]:
    """Probe a host's devices with whatever tools it has.

    ``run(argv) -> (rc, stdout, stderr)`` runs a command, ``which(name)``
    returns a tool's path or None, ``read_text(path)`` a file's text or None;
    the Ansible module passes real ones, tests pass recordings. ``backends``
    limits the probes (default: all; Linux only, macOS hosts are refused in
    preflight). A missing tool is normal (no such GPU); a tool that fails or
    prints something unreadable is an error in ``errors``.

    With ``rpc_server`` (path to the built rpc-server), it is started with a
    device name that does not exist, which makes it list llama.cpp's own view
    of the devices and exit without binding a port; ``rpc_devices`` then
    follows exactly the devices that rpc-server serves (CPU figures from
    /proc/meminfo, which unlike llama.cpp's reports MemAvailable).

    ``environ`` is the environment llama.cpp will run with: ``GGML_VK_VISIBLE_DEVICES`` there chooses the
    Vulkan devices as llama.cpp does (CPU-type ones included).

    The CPU entry's figures are the tighter of /proc/meminfo and the cgroup limits above the service's systemd
    ``units`` (gpu_memory: a container's or a slice's memory.max), what those units hold counted as theirs (their
    processes' resident memory where a unit has no memory cgroup; ``systemctl show`` gives its MainPID where no
    cgroup hierarchy lists them);
    ``total_source`` and ``free_source`` say where each figure came from, ``memory`` has the details.

    Returns ``{"devices", "rpc_devices", "backend", "tools", "warnings", "errors"}``.
    """
    wanted = list(PROBE_BACKENDS if not backends or list(backends) == ["auto"] else backends)
    unknown = [b for b in wanted if b not in PROBE_BACKENDS]
    if unknown:
        raise ParseError("unknown backends %s; choose from auto, %s" % (", ".join(unknown), ", ".join(PROBE_BACKENDS)))
    probe = _Probe(run, which, read_text)
    for backend in PROBE_BACKENDS:
        if backend in wanted:
            probe.devices += _PROBES[backend](probe, environ or {})
    for dev in probe.devices:
        if dev["backend"] == "cpu":
            limit_cpu_memory(dev, read_memory_limits(read_text, units, main_pid=systemd_main_pid(run, which)))

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
                    for key in ("total_mib", "free_mib", "total_source", "free_source", "memory"):
                        dev[key] = cpu[0][key]
                    dev["source"] = "rpc-server + %s" % cpu[0]["source"]
            backend = preferred_backend(rpc_devices)
    return {"devices": probe.devices, "rpc_devices": rpc_devices, "backend": backend, "tools": probe.tools,
            "warnings": probe.warnings, "errors": probe.errors}


def systemd_main_pid(run: Runner, which: Which) -> MainPid:
    """A unit's MainPID by ``systemctl show`` (0 without systemctl, for a unit not running, or when it fails)."""

    def main_pid(unit: str) -> int:
        systemctl = which("systemctl")
        if not systemctl:
            return 0
        rc, out, dummy = run([systemctl] + show_argv(unit, ["MainPID"], value=True)[1:])
        value = out.strip()
        return int(value) if rc == 0 and value.isdigit() else 0

    return main_pid


def limit_cpu_memory(dev: dict[str, Any], limits: dict[str, Any]) -> None:
    """Give a CPU device read from /proc/meminfo the figures of gpu_memory.memory_figures (cgroup limits), in place."""
    figures = memory_figures(int(dev["total_mib"]), int(dev["free_mib"] or 0), limits)
    dev.update(total_mib=figures["total_mib"], free_mib=figures["free_mib"], total_source=figures["total_source"],
               free_source=figures["free_source"], memory=figures)
    if figures["cgroups"]:
        dev["source"] = "/proc/meminfo + %s" % figures["hierarchy"]


def _cuda_devices(probe: _Probe, environ: Mapping[str, str]) -> list[dict[str, Any]]:
    out = probe.tool("nvidia-smi", ["--query-gpu=" + NVIDIA_SMI_QUERY, "--format=csv,noheader,nounits"])
    return probe.parse("nvidia-smi", parse_nvidia_smi_csv, out) if out is not None else []


def _rocm_devices(probe: _Probe, environ: Mapping[str, str]) -> list[dict[str, Any]]:
    static = probe.tool("amd-smi", ["static", "--json"])
    if static is not None:
        metric = probe.tool("amd-smi", ["metric", "--json"], optional=True)
        return probe.parse("amd-smi", parse_amd_smi_json, static, metric)
    if probe.tools.get("amd-smi") == "missing":
        out = probe.tool("rocm-smi", ["--showmeminfo", "vram", "--showproductname", "--json"])
        if out is not None:
            return probe.parse("rocm-smi", parse_rocm_smi_json, out)
    return []


def _vulkan_devices(probe: _Probe, environ: Mapping[str, str]) -> list[dict[str, Any]]:
    summary = probe.tool("vulkaninfo", ["--summary"])
    if summary is None:
        return []
    visible = parse_vk_visible_devices(environ.get("GGML_VK_VISIBLE_DEVICES"))
    found = probe.parse("vulkaninfo", parse_vulkaninfo_summary, summary, visible)
    if found:
        full = probe.tool("vulkaninfo", [], optional=True)
        if full is not None:
            found = merge_vulkan(found, parse_vulkaninfo_heaps(full))
    return found


def _cpu_devices(probe: _Probe, environ: Mapping[str, str]) -> list[dict[str, Any]]:
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


# How the devices of each backend a Linux host serves (module_utils/backends.py) are found, in probing order: the
# native tools before vulkaninfo (which sees the same GPUs), the CPU last.
_PROBES: dict[str, Callable[[_Probe, Mapping[str, str]], list[dict[str, Any]]]] = {
    "cuda": _cuda_devices,
    "rocm": _rocm_devices,
    "vulkan": _vulkan_devices,
    "cpu": _cpu_devices,
}
PROBE_BACKENDS = tuple(_PROBES)
