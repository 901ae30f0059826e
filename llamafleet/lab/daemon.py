"""Controller-side lab daemons (the package proxy, the file mirror): start, find, stop.

A daemon is ``python -m <module> ... --pidfile FILE``, started detached (own session,
no stdin, output to a log under ``$LLAMAFLEET_CACHE/lab/run``), so it outlives the
command that started it.  The daemon writes its pidfile once it is listening,
which is also how the starter knows it is ready.  ``lab down`` finds daemons by
pidfile and, should the pidfiles be gone, by their command line.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from socketserver import TCPServer

from .paths import REPO_ROOT
from .system import LabError, list_processes, pid_alive, terminate, write_atomic

# Every lab daemon's HTTP Server header starts with this; status checks rely on it.
SERVER_PREFIX = "llamafleet-lab-"


@dataclass(frozen=True)
class DaemonSpec:
    """What to run: a lab daemon module with its arguments and the address it listens on."""

    name: str
    module: str
    args: tuple[str, ...]
    host: str
    port: int

    def argv(self, run_dir: Path) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args, "--pidfile", str(self.pidfile(run_dir))]

    def pidfile(self, run_dir: Path) -> Path:
        return run_dir / f"{self.name}.pid"

    def logfile(self, run_dir: Path) -> Path:
        return run_dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class DaemonStatus:
    """A daemon as found now: its pid (None if not running) and whether its port answers."""

    name: str
    url: str
    pid: int | None
    listening: bool


def module_processes(module: str) -> dict[int, tuple[str, ...]]:
    """Processes running ``python -m <module>``, by pid."""
    found = {}
    for proc in list_processes():
        argv = proc.argv
        if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == module:
            found[proc.pid] = argv
    return found


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at host:port.

    Only meaningful for addresses on this machine or the lab network: elsewhere a
    transparent egress proxy may accept any connection.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def answers(spec: DaemonSpec, timeout: float = 1.0) -> bool:
    """Whether *our* daemon answers HTTP at the spec's address (by its Server header).

    A bare TCP connect is not enough: with the lab bridge absent, 10.77.0.1 is
    routed off the machine, where something else may accept the connection.
    """
    conn = http.client.HTTPConnection(spec.host, spec.port, timeout=timeout)
    try:
        conn.request("HEAD", "/")
        server = conn.getresponse().getheader("Server") or ""
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    return server.startswith(SERVER_PREFIX)


def daemon_status(spec: DaemonSpec, probe: bool = True) -> DaemonStatus:
    """The daemon's pid, and (with ``probe``, only sensible while the lab bridge exists) whether it answers."""
    pids = sorted(module_processes(spec.module))
    return DaemonStatus(spec.name, spec.url, pids[0] if pids else None, probe and answers(spec))


def ensure_daemon(spec: DaemonSpec, run_dir: Path, timeout: float = 15.0) -> bool:
    """Have exactly one ``spec`` daemon running with ``spec``'s arguments and listening.

    Returns True if it had to be (re)started.
    """
    wanted = tuple(spec.argv(run_dir))
    running = module_processes(spec.module)
    if list(running.values()) == [wanted] and answers(spec):
        return False
    stop_daemon(spec.name, spec.module, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pidfile, log = spec.pidfile(run_dir), spec.logfile(run_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with open(log, "w", encoding="utf-8") as out:
        # setsid --fork: the daemon is nobody's child here and leads its own session.
        subprocess.run(["setsid", "--fork", *wanted], stdin=subprocess.DEVNULL, stdout=out,
                       stderr=subprocess.STDOUT, env=env, check=True)
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < timeout:
        pid = read_pidfile(pidfile)
        if pid and pid_alive(pid) and answers(spec):
            return True
        if elapsed > 2 and not module_processes(spec.module):
            break  # it started and has already exited
        time.sleep(0.1)
    tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-6:]
    stop_daemon(spec.name, spec.module, run_dir)
    raise LabError(f"the lab {spec.name} did not start listening on {spec.host}:{spec.port}; "
                   f"its log {log} ends with:\n  " + "\n  ".join(tail or ["(empty)"]))


def read_pidfile(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None


def stop_daemon(name: str, module: str, run_dir: Path) -> list[int]:
    """Stop every process running ``module`` (by pidfile and by command line); return their pids."""
    pids = set(module_processes(module))
    pidfile = run_dir / f"{name}.pid"
    pid = read_pidfile(pidfile)
    if pid and pid in module_processes(module):
        pids.add(pid)
    survivors = terminate(sorted(pids), grace=5.0)
    if survivors:
        raise LabError(f"could not stop the lab {name} (pids {survivors})")
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    return sorted(pids)


# --------------------------------------------------------------------------- inside a daemon


def serve(server: TCPServer, pidfile: Path | None, name: str) -> None:
    """Run ``server`` until SIGTERM/SIGINT, with ``pidfile`` present exactly while it serves."""
    log = logging.getLogger(name)

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if pidfile:
        write_atomic(pidfile, f"{os.getpid()}\n", encoding="ascii")
    host, port = server.socket.getsockname()[:2]
    log.info("listening on %s:%s (pid %d)", host, port, os.getpid())
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if pidfile and read_pidfile(pidfile) == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                pidfile.unlink()


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
