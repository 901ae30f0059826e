# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The workers' rpc-server guard (``python3 -m llamafleet_host.serving_gate guard PORT=UNIT ...``): after a silent
partition a worker's rpc-server still holds the dead connection of the llama-server that was killed (its reset was
lost in the partition, and rpc-server has no keepalive), so it never accepts the new llama-server, which waits for
it forever. The guard sees a live client queued behind the one being served (see :func:`guard_decide`) and
restarts rpc-server.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .host_observation import (SS_ESTABLISHED, SS_LISTENERS, command_output, established_on, parse_listeners,
                               parse_ss, parse_systemctl_show, systemctl_show_argv)


# Seconds a live client may wait behind the one rpc-server is serving before the guard restarts rpc-server.
# llama-server holds one connection per endpoint and nothing else connects while it runs (the deploy and the
# gate never probe a connected worker), so a second live client that waits this long is a new llama-server
# and the served one is dead. Longer than a HELLO attempt (5 s) so a probe alone never triggers it.
DEFAULT_GUARD_STALE = 20.0
DEFAULT_GUARD_POLL = 2.0
GUARD_LOG_PREFIX = "llamafleet-rpc-guard: "


def guard_decide(queued: int, established: int, since: float | None, now: float,
                 stale: float = DEFAULT_GUARD_STALE, backlog: int = 1) -> tuple[float | None, bool]:
    """One rpc-server port's poll -> (when clients began waiting or None, restart now?).

    Clients wait when a connection is queued for accept and either a live one is among them (two or
    more established: the one being served and a waiting one) or the queue is full (``queued`` above
    ``backlog``: reset attempts fill it, and no new client can connect at all). The clock starts then
    and stops only when the accept queue empties (a client that gives up and resets stays queued, so
    retrying clients keep it running). Restart when it has run ``stale`` seconds and clients wait now.
    """
    if queued <= 0:
        return None, False
    waiting = established >= 2 or queued > backlog
    if since is None:
        return (now if waiting else None), False
    return since, waiting and now - since >= stale


def _guard_log(message: str) -> None:
    sys.stdout.write(GUARD_LOG_PREFIX + message + "\n")
    sys.stdout.flush()


def _main_pid(unit: str) -> int:
    out = command_output(systemctl_show_argv(unit))
    return parse_systemctl_show(out)[1] if out is not None else 0


def guard(servers: dict[int, str], stale: float = DEFAULT_GUARD_STALE, poll: float = DEFAULT_GUARD_POLL,
          rounds: int | None = None) -> None:
    """Watch each rpc-server port (``servers``: port -> unit) and restart the unit's process (SIGKILL; systemd
    restarts it) when a live client has waited ``stale`` seconds behind a dead one."""
    since: dict[int, float | None] = {port: None for port in servers}
    _guard_log("watching %s (restart after a client waits %g s)"
               % (", ".join("%s on port %d" % (unit, port) for port, unit in sorted(servers.items())), stale))
    done = 0
    while rounds is None or done < rounds:
        done += 1
        listeners, conns = command_output(SS_LISTENERS), command_output(SS_ESTABLISHED)
        if listeners is not None and conns is not None:
            queued, established = parse_listeners(listeners), parse_ss(conns)
            for port, unit in sorted(servers.items()):
                now = time.monotonic()
                waiting, backlog = queued.get(port, (0, 0))
                since[port], restart = guard_decide(waiting, established_on(established, port), since[port], now,
                                                    stale, max(backlog, 1))
                if restart:
                    pid = _main_pid(unit)
                    _guard_log("%s (port %d) has kept a client waiting %.0f s behind a connection whose peer is "
                               "gone (a partition or a killed llama-server): restarting it (pid %d)"
                               % (unit, port, now - (since[port] or now), pid))
                    if pid > 0:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError as exc:
                            _guard_log("cannot kill pid %d: %s" % (pid, exc))
                    since[port] = None
        time.sleep(poll)


def guard_main(argv: list[str]) -> int:
    """``python3 -m llamafleet_host.serving_gate guard [--stale S] PORT=UNIT ...``."""
    import argparse

    parser = argparse.ArgumentParser(prog="llamafleet-rpc-guard",
                                     description="restart an rpc-server stuck on a dead client")
    parser.add_argument("--stale", type=float, default=DEFAULT_GUARD_STALE,
                        help="seconds a live client may wait (default %(default)s)")
    parser.add_argument("--poll", type=float, default=DEFAULT_GUARD_POLL, help=argparse.SUPPRESS)
    parser.add_argument("servers", nargs="+", metavar="PORT=UNIT", help="an rpc-server's port and its unit")
    args = parser.parse_args(argv)
    servers = {}
    for item in args.servers:
        port, sep, unit = item.partition("=")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not unit:
            parser.error("expected PORT=UNIT, got %r" % item)
        servers[int(port)] = unit
    if args.stale <= 0 or args.poll <= 0:
        parser.error("--stale and --poll must be > 0")
    try:
        guard(servers, args.stale, args.poll)
    except KeyboardInterrupt:
        return 0
    return 0
