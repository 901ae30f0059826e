"""Controller-side plumbing the lab needs: commands, preconditions, processes, mounts, a lock.

Everything here acts on the machine that runs ``llamafleet lab``.  Nothing is mocked
in the tests: the pure helpers (``parse_mountinfo``) take text, the rest touch the
real system.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

# Which Debian package provides each controller tool the lab runs.
TOOL_PACKAGES: dict[str, str] = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "ip": "iproute2",
    "tc": "iproute2",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "mount": "mount",
    "umount": "mount",
    "nsenter": "util-linux",
}

LOCK_PATH = Path("/run/lock/llamafleet-lab.lock")


class LabError(UserError):
    """The lab could not do what was asked; the message says what failed and where to look."""


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    check: bool = True,
    timeout: float | None = 120,
    what: str | None = None,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with captured text output; on failure raise :class:`LabError`.

    ``what`` names the step in the error message ("creating bridge lfbr0").
    """
    args = [os.fspath(a) for a in argv]
    try:
        proc = subprocess.run(
            args,
            input=input_text,
            stdin=None if input_text is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as exc:
        raise LabError(f"{what or args[0]}: command not found: {args[0]}") from exc
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{what or ' '.join(args)}: timed out after {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise LabError(
            f"{what or 'command'} failed (exit {proc.returncode}): {' '.join(args)}"
            + ("\n  " + "\n  ".join(detail) if detail else "")
        )
    return proc


def require_controller(tools: Iterable[str]) -> None:
    """Raise :class:`UserError` unless this is Linux, we are root, and ``tools`` are installed."""
    if platform.system() != "Linux":
        raise UserError(f"the lab needs Linux (systemd-nspawn, bridges); this is {platform.system()}")
    if os.geteuid() != 0:
        raise UserError("the lab creates bridges, mounts and containers: run it as root (sudo llamafleet lab ...)")
    problem = missing_tools_message(tools)
    if problem:
        raise UserError(problem)


def missing_tools_message(tools: Iterable[str]) -> str | None:
    """What to install for the ``tools`` not found on PATH, or None when all are there."""
    missing = sorted({t for t in tools if shutil.which(t) is None})
    if not missing:
        return None
    packages = sorted({TOOL_PACKAGES.get(t, t) for t in missing})
    return f"missing tool(s) on this machine: {', '.join(missing)}; install them with: apt-get install {' '.join(packages)}"


@contextlib.contextmanager
def lab_lock(path: Path = LOCK_PATH, announce: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the machine-wide lab lock: one lab per machine, one ``up``/``down`` at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="ascii") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            announce(f"==> waiting for another llamafleet lab command to finish (lock {path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class Process:
    """A process seen in /proc: its id, parent and argument vector."""

    pid: int
    ppid: int
    argv: tuple[str, ...]


def list_processes() -> list[Process]:
    """Every process visible in /proc (those that vanish while reading are skipped)."""
    found: list[Process] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
            stat = Path(entry.path, "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not raw:
            continue  # kernel thread or zombie
        # The command name in stat is in parentheses and may contain spaces: split after it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        found.append(Process(int(entry.name), ppid, tuple(a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0"))))
    return found


def pid_alive(pid: int) -> bool:
    """True if a process with this id exists (zombies count as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def send_signal(pid: int, sig: int) -> None:
    """Signal ``pid``, ignoring a process that has already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to exit; return those still alive."""
    pending = [p for p in pids if pid_alive(p)]
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [p for p in pending if pid_alive(p)]
    return pending


def terminate(pids: Iterable[int], *, sig: int = signal.SIGTERM, grace: float = 8.0) -> list[int]:
    """Send ``sig`` to ``pids``, wait up to ``grace`` seconds, then SIGKILL the survivors.

    Returns the ids that still exist afterwards (normally none).
    """
    pending = [p for p in pids if pid_alive(p)]
    for pid in pending:
        send_signal(pid, sig)
    pending = wait_gone(pending, grace)
    for pid in pending:
        send_signal(pid, signal.SIGKILL)
    return wait_gone(pending, 5)


def write_atomic(path: Path, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` so readers see the old or the new content, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding=encoding)
    tmp.replace(path)


# --------------------------------------------------------------------------- mounts


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo, the parts the lab needs."""

    mountpoint: str
    fstype: str
    source: str
    super_options: str = ""

    def option(self, name: str) -> str | None:
        """A file-system option such as ``upperdir`` (None if absent)."""
        for item in self.super_options.split(","):
            key, _, value = item.partition("=")
            if key == name:
                return value
        return None


def _unescape_mountinfo(field: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) the kernel writes in mountinfo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse /proc/self/mountinfo text into :class:`Mount` records."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        options = tail[2] if len(tail) > 2 else ""
        mounts.append(Mount(_unescape_mountinfo(fields[4]), tail[0], _unescape_mountinfo(tail[1]), options))
    return mounts


def current_mounts(pid: int | str = "self") -> list[Mount]:
    """The mounts of this process's (or ``pid``'s) mount namespace."""
    return parse_mountinfo(Path(f"/proc/{pid}/mountinfo").read_text(encoding="utf-8"))


def mounts_under(path: Path) -> list[Mount]:
    """Mounts at or below ``path``, deepest first (the order to unmount them in)."""
    root = os.path.realpath(path)
    inside = [m for m in current_mounts() if m.mountpoint == root or m.mountpoint.startswith(root + "/")]
    return sorted(inside, key=lambda m: m.mountpoint.count("/"), reverse=True)


def unmount(mountpoint: str) -> None:
    """Unmount ``mountpoint``; fall back to a lazy unmount if something still holds it."""
    proc = run(["umount", mountpoint], check=False)
    if proc.returncode != 0 and os.path.ismount(mountpoint):
        run(["umount", "--lazy", mountpoint], what=f"unmounting {mountpoint}")


def remove_tree(path: Path) -> None:
    """Delete ``path`` recursively, refusing to descend into anything still mounted below it."""
    if not path.exists() and not path.is_symlink():
        return
    for mount in mounts_under(path):
        unmount(mount.mountpoint)
    if mounts_under(path):
        raise LabError(f"refusing to delete {path}: something is still mounted below it")
    run(["rm", "-rf", "--one-file-system", str(path)], what=f"removing {path}", timeout=300)
