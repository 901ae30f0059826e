"""``llamafleet status|logs|probe``: what playbooks are clumsy at, over SSH.

A thin layer: the library reads the hosts (:mod:`llamafleet.status`,
:mod:`llamafleet.probe`), this module parses arguments and formats.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .core.gate_decision import DOWN, LOADING, SERVING
from .errors import UserError
from .fleet import Fleet
from .layout import fleet_layouts
from .probe import Link, probe_links
from .status import fleet_status, is_bad, journal_command


def with_inventory(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``-i INVENTORY`` and ``--vault-password-file FILE``, read as ansible-playbook reads them."""
    p.add_argument("-i", "--inventory", default=None,
                   help="Ansible inventory (default: Ansible's configured one: ANSIBLE_INVENTORY or ansible.cfg)")
    p.add_argument("--vault-password-file", action="append", default=[], metavar="FILE",
                   help="vault password file for vaulted inventory values (default: Ansible's configuration)")
    return p


def fleet_of(args: argparse.Namespace) -> Fleet:
    """The fleet of the command line's inventory."""
    return Fleet.from_inventory(args.inventory, args.vault_password_file)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = with_inventory(subparsers.add_parser(
        "status", help="the fleet at a glance: units, builds, caches, health, the gate and the worker links"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=status)

    p = with_inventory(subparsers.add_parser("logs", help="journal of the cluster's units on a host"))
    p.add_argument("host", help="inventory host name")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.set_defaults(func=logs)

    p = with_inventory(subparsers.add_parser("probe", help="link probes: TCP round trip and throughput orchestrator -> workers"))
    p.add_argument("--megabytes", type=int, default=32, help="bytes to send per link (MB)")
    p.add_argument("--port", type=int, default=50999, help="temporary port on the workers")
    p.set_defaults(func=probe)


STATUS_HEADER = (f"{'host':<10} {'role':<12} {'address':<15} {'state':<11} {'restarts':<8} {'build':<28} {'cache':<14} "
                 f"{'gate':<10} {'link':<8} {'serving':<14} detail")


def ago(seconds: float | None) -> str:
    """A duration, short: ``42s``, ``17m``, ``5h``, ``3d`` (``-`` for None)."""
    if seconds is None:
        return "-"
    for unit, size, limit in (("s", 1, 120), ("m", 60, 120 * 60), ("h", 3600, 48 * 3600)):
        if seconds < limit:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds // 86400:.0f}d"


def serving_cell(row: dict[str, Any]) -> str:
    """The serving column: the gate's state and how long it has been so (``?`` when the gate is not running)."""
    if "serving" not in row:
        return "-"
    if row.get("serving_state") is None:
        return "?"
    return f"{row['serving_state']} {ago(row.get('serving_since'))}"


def status_note(row: dict[str, Any]) -> str:
    """The last column: why the cluster does not serve and /health when it adds to that, or why the host could
    not be read; else /health's answer (and how long the last model load took); then the watchdog's restarts,
    if any."""
    notes = [row["serving"]] if row.get("serving") and (row.get("serving_state") != SERVING
                                                        or row.get("degraded_without")) else []
    health = row.get("health")
    # while the gate is loading or down, /health's 503 only repeats its reason
    repeats = row.get("serving_state") in (LOADING, DOWN) and str(health).startswith("HTTP 503")
    if health and health != "ok" and not repeats:
        notes.append(health)
    note = "; ".join(notes) or row.get("error") or health or "-"
    if row.get("serving_state") == SERVING and isinstance(row.get("load_seconds"), (int, float)):
        note += f", model loaded in {row['load_seconds']:.1f} s"
    restarts = row.get("gate_restarts")
    return f"{note} ({restarts} watchdog restart{'' if restarts == 1 else 's'})" if restarts else note


def status_line(row: dict[str, Any]) -> str:
    """One row of the status table (gate: the gate's unit on the orchestrator, the guard's on a worker)."""
    files = row.get("cache_files")
    cache = f"{(row.get('cache_bytes') or 0) / 2**20:.0f} MiB/{files}" if files is not None else "-"
    helpers = [row[key] for key in ("gate", "guard") if row.get(key)]  # a host in both roles runs both
    gate = next((state for state in helpers if state != "active"), helpers[0] if helpers else "-")
    return (f"{row['host']:<10} {row['role']:<12} {row['address']:<15} {row.get('state', '?'):<11} "
            f"{row.get('restarts', ''):<8} {row.get('build') or '-':<28} {cache:<14} "
            f"{gate:<10} {row.get('link') or '-':<8} {serving_cell(row):<14} {status_note(row)}")


def status(args: argparse.Namespace) -> int:
    rows = fleet_status(fleet_of(args))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(STATUS_HEADER)
        for row in rows:
            print(status_line(row))
    return 1 if any(is_bad(r) for r in rows) else 0


def logs(args: argparse.Namespace) -> int:
    fleet = fleet_of(args)
    if args.host not in fleet.hosts:
        raise UserError(f"{args.host} is not in the inventory (hosts: {', '.join(sorted(fleet.hosts))})")
    host = fleet.hosts[args.host]
    layouts, _, errors = fleet_layouts(fleet, [host])
    if host.name in errors:
        raise UserError(f"{host.name}: {errors[host.name]}")
    print(fleet.run_one(journal_command(layouts[host.name], args.lines), host, what="journalctl"), end="")
    return 0


PROBE_HEADER = f"{'link':<24} {'connect ms':>10} {'MB/s':>10}"


def probe_line(link: Link) -> str:
    """One row of the probe table: connect time and throughput, or why the link failed."""
    if link.error:
        return f"{link.name:<24} failed: {link.error}"
    return f"{link.name:<24} {link.connect_ms:>10.2f} {link.mb_per_s:>10.1f}"


def probe(args: argparse.Namespace) -> int:
    """Measure each orchestrator -> worker link with real TCP traffic on the cluster addresses."""
    fleet = fleet_of(args)
    print(PROBE_HEADER, flush=True)
    failures = 0
    for link in probe_links(fleet, args.megabytes, args.port):
        failures += link.error is not None
        print(probe_line(link), flush=True)
    return 1 if failures else 0
