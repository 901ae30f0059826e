"""Per-host memory limits of the lab: each container runs in its own memory cgroup with a hard limit.

A lab host stands for a machine with that much RAM: its container, and everything its systemd starts,
is charged to one memory cgroup whose limit the kernel enforces (an allocation beyond it is reclaimed
from the page cache first, then ends in an OOM kill inside that host only).  The planner on the host reads
the same figure from its own cgroup, as it would under a container runtime or a systemd ``MemoryMax``.

The controller here may run either cgroup layout:

- cgroup v2 with the memory controller: the host's cgroup in the unified hierarchy (the one
  :func:`llamafleet.lab.machines.host_cgroups` already makes) gets ``memory.max``;
- cgroup v1 (hybrid or legacy): the memory hierarchy gets a cgroup of its own for the host, under the
  memory cgroup the lab command itself runs in (so the lab stays inside whatever limit this machine gives
  it), with ``memory.limit_in_bytes``.

Inside a host, systemd sees the memory controller read-only on v1, so a unit's ``MemoryMax`` is not
applied there: the host's own limit is the one that holds on such a controller.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .machines import CGROUP_PARENT, remove_cgroup_tree
from .system import LabError, current_mounts

MIB = 1024 * 1024
# A host needs this much for its systemd, sshd and journald alone; a smaller limit cannot boot usefully.
MIN_MEMORY_MIB = 512
# v1 reports "no limit" as the largest page-aligned signed 64-bit value.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryHierarchy:
    """Where this controller keeps memory limits: the folder lab hosts' cgroups go in, and the limit file."""

    parent: Path
    limit_file: str
    version: int

    def host_dir(self, name: str) -> Path:
        return self.parent / name


def _own_cgroup(controller: str, proc_cgroup: str) -> str:
    """The path of this process's cgroup in the v1 hierarchy of ``controller`` ("" when not listed)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and controller in parts[1].split(","):
            return parts[2]
    return ""


def memory_hierarchy(proc_cgroup: str | None = None) -> MemoryHierarchy | None:
    """The memory hierarchy lab hosts' limits go in, or None when this kernel has no memory controller."""
    mounts = current_mounts()
    for mount in mounts:
        if mount.fstype != "cgroup2":
            continue
        controllers = Path(mount.mountpoint) / "cgroup.controllers"
        with contextlib.suppress(OSError):
            if "memory" in controllers.read_text().split():
                return MemoryHierarchy(Path(mount.mountpoint) / CGROUP_PARENT, "memory.max", 2)
    if proc_cgroup is None:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    for mount in mounts:
        if mount.fstype == "cgroup" and "memory" in mount.super_options.split(","):
            own = _own_cgroup("memory", proc_cgroup).strip("/")
            # A host started by an earlier run keeps its cgroup; the limit goes where its init is (below).
            base = Path(mount.mountpoint) / own if own else Path(mount.mountpoint)
            return MemoryHierarchy(base / CGROUP_PARENT, "memory.limit_in_bytes", 1)
    return None


def limit_text(mib: int | None, version: int = 2) -> str:
    """What to write into a limit file of cgroup ``version`` for ``mib`` (None or 0: no limit, which v2's memory.max
    writes "max" and v1's memory.limit_in_bytes "-1": v1 refuses "max" with EINVAL)."""
    if mib:
        return str(mib * MIB)
    return "max" if version == 2 else "-1"


def parse_limit(text: str) -> int | None:
    """MiB from a limit file's content; None for no limit ("max" on v2, a huge number on v1)."""
    value = text.strip()
    if value == "max":
        return None
    number = int(value)
    return None if number >= _V1_UNLIMITED else number // MIB


def check_memory_mib(mib: int | None) -> None:
    if mib is not None and mib != 0 and mib < MIN_MEMORY_MIB:
        raise LabError(f"--memory-mib {mib}: a lab host needs at least {MIN_MEMORY_MIB} MiB (0: no limit)")


def prepare_host_cgroup(name: str, mib: int | None) -> Path | None:
    """Make host ``name``'s memory cgroup with its limit; return the directory its processes join (None: no controller)."""
    hierarchy = memory_hierarchy()
    if hierarchy is None:
        if mib:
            raise LabError(f"{name}: this machine's kernel has no memory cgroup controller, so --memory-mib "
                           f"{mib} cannot be enforced (use --memory-mib 0)")
        return None
    directory = hierarchy.host_dir(name)
    if hierarchy.version == 2:
        for level in (hierarchy.parent.parent, hierarchy.parent):
            if level == hierarchy.parent:
                level.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):  # already on, or managed by systemd at the root
                (level / "cgroup.subtree_control").write_text("+memory")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / hierarchy.limit_file).write_text(limit_text(mib, hierarchy.version))
    return directory


def running_host_cgroup(init_pid: int) -> Path | None:
    """The memory cgroup directory a running host's init is charged to, when it is a lab host's own."""
    hierarchy = memory_hierarchy()
    if hierarchy is None:
        return None
    try:
        proc_cgroup = Path(f"/proc/{init_pid}/cgroup").read_text()
    except OSError:
        return None
    if hierarchy.version == 2:
        own = next((line.split(":", 2)[2] for line in proc_cgroup.splitlines() if line.startswith("0::")), "")
        root = hierarchy.parent.parent
    else:
        own = _own_cgroup("memory", proc_cgroup)
        root = next(Path(m.mountpoint) for m in current_mounts()
                    if m.fstype == "cgroup" and "memory" in m.super_options.split(","))
    parts = Path(own.strip("/")).parts
    # the init is the container's own; its cgroup is .../llamafleet-lab/<name> or below it (v2: systemd's own children)
    for index in range(len(parts) - 1):
        if parts[index] == CGROUP_PARENT:
            return root.joinpath(*parts[:index + 2])
    return None


def host_limit_mib(init_pid: int) -> int | None | bool:
    """The limit (MiB, None for none) of a running host; False when it runs outside a lab memory cgroup."""
    directory = running_host_cgroup(init_pid)
    hierarchy = memory_hierarchy()
    if directory is None or hierarchy is None:
        return False
    try:
        return parse_limit((directory / hierarchy.limit_file).read_text())
    except (OSError, ValueError):
        return False


def set_host_limit(name: str, init_pid: int, mib: int | None) -> None:
    """Change a running host's limit in place (the kernel reclaims down to a lower one, or refuses it)."""
    directory = running_host_cgroup(init_pid)
    hierarchy = memory_hierarchy()
    if directory is None or hierarchy is None:
        raise LabError(f"{name}: runs outside a lab memory cgroup; `llamafleet lab down` then `lab up` recreates it")
    try:
        (directory / hierarchy.limit_file).write_text(limit_text(mib, hierarchy.version))
    except OSError as exc:
        raise LabError(f"{name}: could not set its memory limit to {mib} MiB ({exc.strerror}): it uses more now; "
                       "stop its services first or recreate the lab") from exc


def outside_lab_cgroup(init_pid: int) -> bool:
    """Whether a running host is charged to no lab memory cgroup (started before hosts had them)."""
    return memory_hierarchy() is not None and host_limit_mib(init_pid) is False


def keep_limit(name: str, init_pid: int, mib: int | None, say: Callable[[str], None]) -> None:
    """Give a running host the limit asked for now, in place (no reboot), saying so when it changes."""
    if memory_hierarchy() is None:
        return
    current = host_limit_mib(init_pid)
    if (current or 0) != (mib or 0):
        set_host_limit(name, init_pid, mib)
        say(f"==> {name}: memory limit {current or 'none'} -> {mib or 'none'} MiB")


# Each rpc-server unit's peak resident memory on a host (kB lines), for comparing with the host's limit (by the units'
# main pids: the process is not named rpc-server).
PEAK_RSS_COMMAND = ("for u in $(systemctl list-units --plain --no-legend 'llamafleet-rpc-server*.service' | cut -d' ' -f1); "
                    "do grep VmHWM /proc/$(systemctl show -p MainPID --value $u)/status; done")


def oom_kills() -> dict[str, int]:
    """OOM kills so far in each running lab host's memory cgroup, as the kernel counts them."""
    from .machines import find_machines

    kills = {}
    for name, machines in find_machines().items():
        directory = running_host_cgroup(machines[0].leader)
        if directory is None:
            raise LabError(f"{name} runs outside a lab memory cgroup")
        for events in ("memory.events", "memory.oom_control"):  # v2, v1
            path = directory / events
            if path.exists():
                found = re.search(r"^oom_kill (\d+)$", path.read_text(), re.MULTILINE)
                kills[name] = int(found.group(1)) if found else 0
                break
    return kills


def remove_memory_cgroups(name: str | None = None) -> None:
    """Remove the (empty) memory cgroups of host ``name``, or of every lab host (v1; v2 shares the systemd ones)."""
    hierarchy = memory_hierarchy()
    if hierarchy is None or hierarchy.version == 2:
        return
    remove_cgroup_tree(hierarchy.host_dir(name) if name else hierarchy.parent)
