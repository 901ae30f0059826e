"""Lab hosts as systemd-nspawn containers booting real systemd: start, find, stop.

The controller does not run systemd as PID 1, so containers are neither
registered with machined nor run in units: each is a plain ``systemd-nspawn``
process started in its own session (``setsid --fork``), found again by its
command line (``-M labN --network-bridge=lfbr0``).  That makes ``lab down`` work
even when every state file is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .net import BRIDGE, HOST_NAME_RE, LabHost
from .image import OVERLAY_SOURCE
from .system import LabError, Process, current_mounts, list_processes, pid_alive, send_signal


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


def start_machine(host: LabHost, root: Path, console_log: Path, timeout: float = 10.0) -> Machine:
    """Boot ``host`` from ``root`` in the background; return it once its init process runs."""
    with open(console_log, "ab") as out:
        subprocess.run(["setsid", "--fork", *nspawn_argv(host, root)], stdin=subprocess.DEVNULL,
                       stdout=out, stderr=subprocess.STDOUT, check=True)
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


def stop_machines(machines: list[Machine], grace: float = 10.0) -> None:
    """Shut containers down: SIGTERM to nspawn (an orderly poweroff of the container's
    systemd), then, for any still running after ``grace`` seconds, SIGKILL to the
    container's init and nspawn (killing a PID namespace's init ends all of it)."""
    for machine in machines:
        send_signal(machine.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    pending = list(machines)
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [m for m in pending if pid_alive(m.pid)]
    for machine in pending:
        for pid in (machine.leader, machine.pid):
            if pid:
                send_signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [m for m in pending if pid_alive(m.pid) or (m.leader and pid_alive(m.leader))]
    if pending:
        raise LabError("could not stop " + ", ".join(f"{m.name} (pid {m.pid})" for m in pending))


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
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(p) for p in orphans):
        time.sleep(0.05)
    left = [p for p in orphans if pid_alive(p)]
    if left:
        raise LabError(f"could not kill the orphaned lab containers with init pids {left}")
    return orphans
