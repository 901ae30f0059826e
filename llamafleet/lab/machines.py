"""Lab hosts as systemd-nspawn containers booting real systemd: start, find, stop.

The controller does not run systemd as PID 1, so containers are neither
registered with machined nor run in units: each is a plain ``systemd-nspawn``
process started in its own session (``setsid --fork``), found again by its
command line (``-M labN --network-bridge=lfbr0``).  That makes ``lab down`` work
even when every state file is gone.  Each container runs in its own cgroup
(see :data:`CGROUP_PARENT`), and containers whose nspawn died are found by
their init's root mount.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .image import OVERLAY_SOURCE
from .net import BRIDGE, HOST_NAME_RE, LabHost
from .system import LabError, Process, current_mounts, list_processes, send_signal, wait_gone


@dataclass(frozen=True)
class Machine:
    """A running container: its name, nspawn process, root directory and init (leader) process."""

    name: str
    pid: int
    root: str
    leader: int | None


def nspawn_argv(host: LabHost, root: Path) -> list[str]:
    """The command that boots ``host`` from ``root`` (see LAB.md for why exactly these flags)."""
    return ["systemd-nspawn", "-D", str(root), "-M", host.name, f"--network-bridge={BRIDGE}",
            "--register=no", "--keep-unit", "-b"]


def _option(argv: tuple[str, ...], short: str, long: str) -> str | None:
    """The value of ``-X VALUE``, ``--long=VALUE`` or ``--long VALUE`` in ``argv``."""
    for i, arg in enumerate(argv):
        if arg in (short, long) and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(long + "="):
            return arg.split("=", 1)[1]
    return None


def parse_machine(proc: Process, children: dict[int, list[int]]) -> Machine | None:
    """A :class:`Machine` if ``proc`` is a lab container's nspawn process, else None."""
    argv = proc.argv
    if not argv or os.path.basename(argv[0]) != "systemd-nspawn":
        return None
    name = _option(argv, "-M", "--machine")
    if name is None or not HOST_NAME_RE.match(name) or _option(argv, "", "--network-bridge") != BRIDGE:
        return None
    kids = children.get(proc.pid, [])
    return Machine(name, proc.pid, _option(argv, "-D", "--directory") or "", kids[0] if kids else None)


def find_machines() -> dict[str, list[Machine]]:
    """Every running lab container, by host name (normally one per name)."""
    procs = list_processes()
    children: dict[int, list[int]] = {}
    for proc in procs:
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: dict[str, list[Machine]] = {}
    for proc in procs:
        machine = parse_machine(proc, children)
        if machine:
            found.setdefault(machine.name, []).append(machine)
    return found


# Each container gets its own cgroup in the hierarchies systemd tracks processes in.
# Without one, every nspawn started by the same shell shares that shell's cgroup,
# and the containers' systemds create and delete each other's unit cgroups there
# (units then fail at random with "Failed at step CGROUP ... No such file").
CGROUP_PARENT = "llamafleet-lab"


def systemd_cgroup_roots() -> list[Path]:
    """Mount points of the cgroup hierarchies systemd uses: cgroup2, and the v1 ``name=systemd`` one."""
    return [Path(m.mountpoint) for m in current_mounts()
            if m.fstype == "cgroup2" or (m.fstype == "cgroup" and "name=systemd" in m.super_options.split(","))]


def host_cgroups(name: str) -> list[Path]:
    """The cgroup directories a lab host's container runs in, one per systemd hierarchy."""
    return [root / CGROUP_PARENT / name for root in systemd_cgroup_roots()]


def remove_cgroup_tree(top: Path, wait: float = 10.0) -> bool:
    """Remove cgroup directory ``top`` and those below it; True once it is gone.

    cgroupfs directories go with rmdir only, children first, and only once their last process has left: a host just
    stopped may still have processes exiting, so this tries again for up to ``wait`` seconds.
    """
    deadline = time.monotonic() + wait
    while top.is_dir():
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
        if not top.exists() or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return not top.exists()


def remove_cgroups(name: str | None = None) -> list[Path]:
    """Remove the (empty) cgroups of host ``name``, or of every lab host; return those still present."""
    return [top for root in systemd_cgroup_roots()
            if not remove_cgroup_tree(root / CGROUP_PARENT / name if name else root / CGROUP_PARENT)]


def start_machine(host: LabHost, root: Path, console_log: Path, timeout: float = 10.0,
                  memory_cgroup: Path | None = None) -> Machine:
    """Boot ``host`` from ``root`` in the background, in its own cgroups; return it once its init runs.

    ``memory_cgroup`` (:func:`llamafleet.lab.memory.prepare_host_cgroup`) is joined as well: the host's memory limit.
    """
    cgroups = host_cgroups(host.name)
    for cgroup in cgroups:
        cgroup.mkdir(parents=True, exist_ok=True)
    if memory_cgroup is not None and memory_cgroup not in cgroups:
        cgroups.append(memory_cgroup)
    # A shell joins the host's cgroups, then becomes nspawn (so nspawn and the container start there).
    join = "; ".join(f"echo $$ > {shlex.quote(str(cg / 'cgroup.procs'))}" for cg in cgroups)
    argv = ["setsid", "--fork", "sh", "-c", f'{join}; exec "$@"', "sh", *nspawn_argv(host, root)]
    with open(console_log, "ab") as out:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for machine in find_machines().get(host.name, []):
            if machine.root == str(root) and machine.leader:
                return machine
        time.sleep(0.1)
    raise LabError(f"{host.name}: systemd-nspawn did not start; see {console_log}:\n  " + console_tail(console_log))


def console_tail(console_log: Path, lines: int = 8) -> str:
    try:
        text = console_log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no console output)"
    return "\n  ".join(text.strip().splitlines()[-lines:]) or "(no console output)"


def stop_machines(machines: list[Machine], grace: float = 8.0) -> None:
    """Shut containers down, orderly if they let us, by force if not.

    SIGTERM to nspawn makes it power the container's systemd off; any container
    still running after ``grace`` seconds gets SIGKILL to its init and nspawn
    (killing a PID namespace's init ends every process in it).
    """
    for machine in machines:
        send_signal(machine.pid, signal.SIGTERM)
    alive = set(wait_gone([m.pid for m in machines], grace))
    forced = [pid for m in machines if m.pid in alive for pid in (m.leader, m.pid) if pid]
    for pid in forced:
        send_signal(pid, signal.SIGKILL)
    stuck = set(wait_gone(forced, 5))
    if stuck:
        raise LabError("could not stop " + ", ".join(f"{m.name} (pid {m.pid})" for m in machines
                                                     if {m.pid, m.leader} & stuck))


def container_inits() -> dict[int, Path]:
    """Init processes of lab containers, alive with or without their nspawn, and each one's host directory.

    A lab container's init is a PID-namespace init (``NSpid: <pid> 1``) whose own
    root mount is a lab overlay; the overlay's upper layer lies in the host's
    directory.  The path of that root is not visible from here (the container
    pivoted into it), but its mount table is.
    """
    found: dict[int, Path] = {}
    for proc in list_processes():
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text(encoding="utf-8")
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if len(nspid) < 2 or nspid[-1] != "1":
                continue
            mounts = current_mounts(proc.pid)
        except OSError:
            continue
        root = next((m for m in reversed(mounts) if m.mountpoint == "/"), None)
        upper = root.option("upperdir") if root and root.source == OVERLAY_SOURCE else None
        if upper:
            found[proc.pid] = Path(upper).parent
    return found


def kill_orphaned_containers(host_dirs: Iterable[Path] | None = None) -> list[int]:
    """SIGKILL the init of every lab container (in ``host_dirs``, or anywhere) that has no nspawn any more.

    Such orphans remain when nspawn itself was killed: their systemd and services
    keep running.  Killing a PID namespace's init ends every process in it.
    """
    attached = {m.leader for ms in find_machines().values() for m in ms}
    wanted = None if host_dirs is None else {os.path.realpath(d) for d in host_dirs}
    orphans = [pid for pid, hdir in container_inits().items()
               if pid not in attached and (wanted is None or os.path.realpath(hdir) in wanted)]
    for pid in orphans:
        send_signal(pid, signal.SIGKILL)
    left = wait_gone(orphans, 5)
    if left:
        raise LabError(f"could not kill the orphaned lab containers with init pids {left}")
    return orphans
