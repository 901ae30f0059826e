"""``llamafleet lab``: up, down, status and shape for the on-machine lab (thin layer over :mod:`.core`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .core import DEFAULT_MEMORY_MIB, Lab, LabStatus, shape
from .system import LabError
from .net import BRIDGE, MAX_HOSTS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``lab`` command group to the top-level parser."""
    lab = subparsers.add_parser(
        "lab", help="real hosts on this machine (systemd-nspawn) to deploy and test on",
        description="A lab of real Debian hosts on this machine: systemd-nspawn containers booting "
                    "systemd and sshd on bridge lfbr0 (10.77.0.0/24). Needs root.",
    )
    sub = lab.add_subparsers(dest="lab_command", metavar="SUBCOMMAND")
    sub.required = True

    up = sub.add_parser("up", help="start the lab (idempotent) and write its Ansible inventory",
                        description="Start hosts lab1..labN (lab1 orchestrator, the rest workers), the package "
                                    "proxy and the file mirror, and write inventories/lab. Re-running is a quick "
                                    "no-op; a failed run removes what it made.")
    up.add_argument("--hosts", type=int, default=3, metavar="N", help=f"number of hosts, 1..{MAX_HOSTS} (default 3)")
    up.add_argument("--inventory-dir", type=Path, metavar="DIR",
                    help="where to write hosts.ini and group_vars (default: inventories/lab in the repository)")
    up.add_argument("--vulkan", action="append", default=[], metavar="HOST",
                    help="make HOST (e.g. lab3) a Vulkan host: Debian 13 with Mesa's software Vulkan device "
                         "(lavapipe), in the group llamafleet_backend_vulkan; repeatable")
    up.add_argument("--memory-mib", type=int, default=DEFAULT_MEMORY_MIB, metavar="MIB",
                    help=f"each host's memory limit in MiB, enforced by its memory cgroup (default "
                         f"{DEFAULT_MEMORY_MIB}; 0: none); a running host gets a new limit in place")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="remove every lab host, the bridge, the daemons and the inventory",
                          description="Stop and remove everything the lab made; works without its state files.")
    down.add_argument("--inventory-dir", type=Path, metavar="DIR", help="inventory directory to clean as well")
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help="show hosts and daemons (exit 0 only when all are healthy)")
    status.set_defaults(func=_status)

    shp = sub.add_parser("shape", help="limit a host's link bandwidth (tbf) for benchmarks",
                         description="Limit the link of a running lab host in both directions with a tbf qdisc.")
    shp.add_argument("host", help="lab host name, e.g. lab2")
    how = shp.add_mutually_exclusive_group(required=True)
    how.add_argument("--rate", help="tc rate, e.g. 30mbit, 500kbit, 1gbit (or 4mbps = 4 megabytes/s)")
    how.add_argument("--clear", action="store_true", help="remove the limit")
    shp.set_defaults(func=_shape)
    for name, what in (("stop", "power a lab host off as its admin would (its disk stays), for fault tests"),
                       ("start", "boot a lab host stopped with `lab stop` again")):
        power = sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
        power.add_argument("host", help="lab host name, e.g. lab3")
        power.set_defaults(func=_power, power=name)


def _up(args: argparse.Namespace) -> int:
    Lab(args.hosts, kinds={name: "vulkan" for name in args.vulkan}, inventory_dir=args.inventory_dir,
        memory_mib=args.memory_mib).up()
    return 0


def _down(args: argparse.Namespace) -> int:
    Lab(inventory_dir=args.inventory_dir).down()
    return 0


def _status(args: argparse.Namespace) -> int:
    report = Lab(progress=None).status()
    print(format_status(report))
    return 0 if report.healthy else 1


def _power(args: argparse.Namespace) -> int:
    number = args.host[3:] if args.host.startswith("lab") else ""
    if not number.isdigit():
        raise LabError(f"{args.host} is not a lab host name (lab1, lab2, ...)")
    lab = Lab(hosts=max(3, int(number)))
    (lab.power_off if args.power == "stop" else lab.power_on)(args.host)
    return 0


def _shape(args: argparse.Namespace) -> int:
    shape(args.host, None if args.clear else args.rate)
    print(f"{args.host}: " + ("link limit removed" if args.clear else f"link limited to {args.rate} each way"))
    return 0


def _memory_text(mib: int | None | bool) -> str:
    if mib is False:
        return "no cgroup"
    return f"{mib} MiB" if mib else "unlimited"


def format_status(report: LabStatus) -> str:
    """The status report as aligned text tables."""
    rows = [("HOST", "ADDRESS", "CONTAINER", "SSH", "SYSTEMD", "LINK", "MEMORY")]
    rows += [(h.name, h.address, "up" if h.running else "down", "ok" if h.ssh_ok else "-", h.systemd,
              h.shaped or "unlimited", _memory_text(h.memory_mib) if h.running else "-") for h in report.hosts]
    lines = _table(rows) if report.hosts else ["no lab hosts (start them with: llamafleet lab up)"]
    lines.append("")
    lines += _table([("DAEMON", "URL", "PID", "LISTENING")] + [
        (d.name, d.url, str(d.pid or "-"), "yes" if d.listening else "no") for d in report.daemons])
    lines.append("")
    lines.append(f"bridge {BRIDGE}: {'up ' + ' '.join(report.bridge_addresses) if report.bridge else 'absent'}")
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
