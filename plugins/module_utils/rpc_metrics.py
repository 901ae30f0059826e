# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A worker's rpc-server facts as Prometheus text, for node_exporter's textfile collector.

rpc-server has no metrics endpoint, and asking it anything would disturb it: it serves one client
at a time with a backlog of one, so a probe's connection waits behind llama-server's (and the
worker's guard counts waiting clients). So nothing here connects to it. Each run (the oneshot
``llamafleet-rpc-metrics.service``, started every few seconds by its timer) reads only what the
host already knows about each rpc-server unit:

- ``systemctl show --property=ActiveState,InvocationID -- UNIT``: whether the unit runs, and which run it is;
- ``ss -ltnH``: whether its port listens, and the connections waiting in its accept queue;
- ``ss -tnH state established``: the connections on its port (accepted ones plus those queued);
- the journal of that run: the last of the two lines rpc-server prints around each client,
  ``Accepted client connection`` and ``Client connection closed`` (ggml-rpc.cpp, flushed at once);
- the weight cache directory: its files (16 hex digits, the tensors' FNV-1a hashes) and their bytes.

and writes, atomically (a temporary file in the same directory, then a rename), one file:

=====================================================  ==============================================================
``llamafleet_rpc_server_up``                           1 when the unit is active and its port listens
``llamafleet_rpc_server_client_connected``             1 when rpc-server serves a client (llama-server) now
``llamafleet_rpc_server_clients_waiting``              connections waiting in the accept queue behind it
``llamafleet_rpc_server_client_connected_since_seconds`` when the client served now was accepted (Unix time);
                                                       only while one is, and the journal says when
``llamafleet_rpc_cache_files``, ``llamafleet_rpc_cache_bytes``  the weight cache (with a cache directory)
``llamafleet_rpc_metrics_errors``                      commands or reads that failed in this run
=====================================================  ==============================================================

The per-unit series carry the labels ``unit`` and ``endpoint`` (``address:port``). A model load's
duration is not among them: the worker sees llama-server connect (the load begins) but nothing
marks its end (rpc-server logs no more per client without ``GGML_RPC_DEBUG``), so it is left out
rather than guessed. The time since the client connected is exported instead.

Stdlib only. Shipped to the workers in the host package beside the gate's ``host_observation.py`` (whose
``ss`` parsers it uses), ``gate_metrics.py`` (the renderer), ``atomic_file.py`` and ``systemd_show.py`` (constants.HOST_PACKAGE) and run as a module:
``python3 -m llamafleet_host.rpc_metrics --output FILE [--cache-dir DIR] ADDRESS:PORT=UNIT ...``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from .atomic_file import write_text_atomic
from .gate_metrics import render_exposition
from .host_observation import (SS_ESTABLISHED, SS_LISTENERS, command_output, established_on, parse_listeners,
                               parse_ss)
from .systemd_show import parse_show, show_argv

# The lines rpc-server prints (stdout, flushed) when it accepts a client and when that client goes (ggml-rpc.cpp).
ACCEPTED = "Accepted client connection"
CLOSED = "Client connection closed"
# rpc-server's cache file names (rpc_cache.CACHE_NAME; a test keeps the two equal).
CACHE_NAME = re.compile(r"^[0-9a-f]{16}$")

# name: (type, help), in the order the file lists them.
METRICS: dict[str, tuple[str, str]] = {
    "llamafleet_rpc_server_up": ("gauge", "1 when the rpc-server unit is active and its port listens, else 0."),
    "llamafleet_rpc_server_client_connected": (
        "gauge", "1 when rpc-server is serving a client (llama-server) now, else 0."),
    "llamafleet_rpc_server_clients_waiting": (
        "gauge", "Connections waiting in rpc-server's accept queue (it serves one client at a time)."),
    "llamafleet_rpc_server_client_connected_since_seconds": (
        "gauge", "Unix time rpc-server accepted the client it serves now (from its journal); absent without one."),
    "llamafleet_rpc_cache_files": ("gauge", "Files in rpc-server's weight cache."),
    "llamafleet_rpc_cache_bytes": ("gauge", "Bytes in rpc-server's weight cache."),
    "llamafleet_rpc_metrics_errors": (
        "gauge", "Commands or reads that failed in this run (what they would have told is reported down or absent)."),
}

Sample = tuple[str, dict[str, str], float]
Runner = Callable[[list[str]], "str | None"]


class MetricsError(ValueError):
    """An argument the writer cannot use; the message names it."""


@dataclass(frozen=True)
class Server:
    """One rpc-server unit to report on."""

    unit: str
    address: str
    port: int

    @property
    def endpoint(self) -> str:
        return "%s:%d" % (self.address, self.port)


def parse_server(text: str) -> Server:
    """``ADDRESS:PORT=UNIT`` (as the rpc_server role renders the service's command line) -> a Server."""
    endpoint, sep, unit = text.partition("=")
    address, colon, port = endpoint.rpartition(":")
    if not sep or not colon or not address or not unit or not port.isdigit() or not 0 < int(port) < 65536:
        raise MetricsError("expected ADDRESS:PORT=UNIT, got %r" % text)
    return Server(unit, address, int(port))


def unit_run_argv(unit: str) -> list[str]:
    """The command that tells whether ``unit`` runs, and which run it is (read by :func:`unit_run`)."""
    return show_argv(unit, ("ActiveState", "InvocationID"))


def unit_run(text: str) -> tuple[bool, str]:
    """:func:`unit_run_argv`'s output -> (active?, invocation id or "")."""
    values = parse_show(text)
    return values.get("ActiveState", "").strip() == "active", values.get("InvocationID", "").strip()


def journal_argv(invocation: str) -> list[str]:
    """The newest of rpc-server's accept and close lines in one run of its unit, as one JSON line.

    Two matches on the same field are alternatives, matches on different fields all apply
    (journalctl(1)); ``-r -n 1`` is the newest entry that matches.
    """
    return ["journalctl", "--no-pager", "-q", "-o", "json", "-r", "-n", "1",
            "_SYSTEMD_INVOCATION_ID=" + invocation, "MESSAGE=" + ACCEPTED, "MESSAGE=" + CLOSED]


def _message(value: Any) -> str:
    """A journal field as text: a string, or a list of bytes where it was not valid UTF-8 (journalctl -o json)."""
    if isinstance(value, list):
        return bytes(int(b) & 0xFF for b in value).decode("utf-8", "replace")
    return str(value)


def last_client_event(text: str) -> tuple[bool, float] | None:
    """``journalctl -o json`` output (newest first) -> (was it an accept?, Unix time) of its first line that
    is an accept or a close; None when there is none (no client since the unit started)."""
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            message = _message(entry.get("MESSAGE", "")).strip()
            when = int(entry["__REALTIME_TIMESTAMP"]) / 1e6
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if message in (ACCEPTED, CLOSED):
            return message == ACCEPTED, when
    return None


def served_clients(established: int, queued: int) -> int:
    """Clients rpc-server has accepted and still holds: the port's established connections less those that
    wait in its accept queue (the kernel counts both as established)."""
    return max(0, established - queued)


def cache_usage(names_sizes: Iterable[tuple[str, int]]) -> tuple[int, int]:
    """(files, bytes) of the cache files among ``(name, size)`` pairs (temporary and index files left out)."""
    files = total = 0
    for name, size in names_sizes:
        if CACHE_NAME.match(name):
            files += 1
            total += int(size)
    return files, total


def read_cache_dir(path: str) -> list[tuple[str, int]]:
    """``(name, size)`` of the regular files in ``path`` (OSError when it cannot be listed)."""
    found = []
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                found.append((entry.name, entry.stat(follow_symlinks=False).st_size))
    return found


def server_samples(server: Server, active: bool, listeners: dict[int, tuple[int, int]] | None,
                   conns: list[dict[str, Any]] | None, last_event: tuple[bool, float] | None) -> list[Sample]:
    """The samples of one rpc-server from what was read (``listeners``/``conns`` None: ss failed, so the
    server counts as down and serving no one)."""
    labels = {"unit": server.unit, "endpoint": server.endpoint}
    listening = listeners is not None and server.port in listeners
    queued = listeners.get(server.port, (0, 0))[0] if listeners else 0
    established = established_on(conns, server.port) if conns is not None else 0
    up = active and listening
    connected = up and served_clients(established, queued) > 0
    samples: list[Sample] = [
        ("llamafleet_rpc_server_up", labels, 1 if up else 0),
        ("llamafleet_rpc_server_client_connected", labels, 1 if connected else 0),
        ("llamafleet_rpc_server_clients_waiting", labels, queued),
    ]
    if connected and last_event is not None and last_event[0]:
        samples.append(("llamafleet_rpc_server_client_connected_since_seconds", labels, last_event[1]))
    return samples


def render(samples: Sequence[Sample]) -> str:
    """Prometheus text exposition of ``samples`` (see gate_metrics.render_exposition); an unknown metric name is
    a MetricsError."""
    try:
        return render_exposition(METRICS, samples)
    except ValueError as exc:
        raise MetricsError(str(exc)) from exc


def collect(servers: Sequence[Server], cache_dir: str | None, run: Runner = command_output,
            list_dir: Callable[[str], list[tuple[str, int]]] = read_cache_dir) -> list[Sample]:
    """Read every fact (``run`` gives a command's stdout, None when it failed) and return the samples."""
    errors = 0
    listeners_text, conns_text = run(list(SS_LISTENERS)), run(list(SS_ESTABLISHED))
    errors += (listeners_text is None) + (conns_text is None)
    listeners = parse_listeners(listeners_text) if listeners_text is not None else None
    conns = parse_ss(conns_text) if conns_text is not None else None
    samples: list[Sample] = []
    for server in servers:
        shown = run(unit_run_argv(server.unit))
        errors += shown is None
        active, invocation = unit_run(shown) if shown is not None else (False, "")
        last_event = None
        if active and invocation:
            journal = run(journal_argv(invocation))
            errors += journal is None
            last_event = last_client_event(journal) if journal is not None else None
        samples += server_samples(server, active, listeners, conns, last_event)
    if cache_dir:
        try:
            files, total = cache_usage(list_dir(cache_dir))
        except OSError:
            errors += 1
        else:
            samples += [("llamafleet_rpc_cache_files", {}, files), ("llamafleet_rpc_cache_bytes", {}, total)]
    samples.append(("llamafleet_rpc_metrics_errors", {}, errors))
    return samples


def main(argv: Sequence[str] | None = None, run: Runner = command_output) -> int:
    """``rpc_metrics.py --output FILE [--cache-dir DIR] ADDRESS:PORT=UNIT ...``: write the file once."""
    import argparse

    parser = argparse.ArgumentParser(prog="llamafleet-rpc-metrics",
                                     description="write rpc-server facts for node_exporter's textfile collector")
    parser.add_argument("--output", required=True, help="the .prom file to write (atomically)")
    parser.add_argument("--cache-dir", default="", help="rpc-server's weight cache directory")
    parser.add_argument("servers", nargs="+", metavar="ADDRESS:PORT=UNIT", help="an rpc-server's endpoint and unit")
    args = parser.parse_args(argv)
    try:
        servers = [parse_server(item) for item in args.servers]
    except MetricsError as exc:
        parser.error(str(exc))
    if not args.output.endswith(".prom") or not os.path.isabs(args.output):
        parser.error("--output must be an absolute path ending in .prom (node_exporter reads only those)")
    try:
        write_text_atomic(args.output, render(collect(servers, args.cache_dir or None, run)))
    except OSError as exc:
        sys.stderr.write("llamafleet-rpc-metrics: cannot write %s: %s\n" % (args.output, exc))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
