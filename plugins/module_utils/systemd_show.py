# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``systemctl show``: the one command line and the one reader of its ``KEY=VALUE`` output.

The serving gate and guard (``host_observation.py``), the rpc-server metrics (``rpc_metrics.py``), the
library's status and journal reads and the bench all ask systemd this way. Stdlib only and without
imports of its own: it runs on the hosts in the host package (constants.HOST_SCRIPTS), imported
relatively by the gate.
"""

from __future__ import annotations

from typing import Iterable


def show_argv(units: str | Iterable[str], properties: Iterable[str], value: bool = False) -> list[str]:
    """``systemctl show --property=P1,P2 [--value] -- UNIT...``: the ``properties`` of one unit (a
    string) or of several, read by :func:`parse_show` / :func:`parse_show_units`; with ``value``
    systemd prints the bare values, one a line, in the order of ``properties``."""
    names = [units] if isinstance(units, str) else list(units)
    return ["systemctl", "show", "--property=" + ",".join(properties), *(["--value"] if value else []), "--", *names]


def parse_show(text: str) -> dict[str, str]:
    """One unit's ``KEY=VALUE`` lines -> ``{KEY: VALUE}`` (values as printed; a line without ``=``,
    which systemctl does not print, is left out)."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def parse_show_units(text: str) -> list[dict[str, str]]:
    """Several units' blocks (systemctl separates them by an empty line) -> one ``{KEY: VALUE}`` per
    unit, in the order asked; ValueError on a line that is not ``KEY=VALUE`` (an error message)."""
    units: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                units.append(current)
                current = {}
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError("not a property line: %r" % line)
        current[key] = value
    if current:
        units.append(current)
    return units
