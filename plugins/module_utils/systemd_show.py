# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``systemctl show``: the one command line and the one reader of its ``KEY=VALUE`` output; and the
journal tail that the modules' errors about a unit quote.

The serving gate and guard (``host_observation.py``), the rpc-server metrics (``rpc_metrics.py``), the
library's status and journal reads and the bench all ask systemd this way. Stdlib only and without
imports of its own: it runs on the hosts in the host package (constants.HOST_SCRIPTS), imported
relatively by the gate.
"""

from __future__ import annotations

from typing import Callable, Iterable


def show_argv(units: str | Iterable[str], properties: Iterable[str], value: bool = False) -> list[str]:
    """``systemctl show --property=P1,P2 [--value] -- UNIT...``: the ``properties`` of one unit (a
    string) or of several, read by :func:`parse_show` / :func:`parse_show_units`; with ``value``
    systemd prints the bare values, one a line, in the order of ``properties``."""
    names = [units] if isinstance(units, str) else list(units)
    return ["systemctl", "show", "--property=" + ",".join(properties), *(["--value"] if value else []), "--", *names]


def journal_tail_argv(unit: str, lines: int = 20) -> list[str]:
    """``journalctl -u UNIT -n LINES``: the end of a unit's journal as bare messages, for an error that names it."""
    return ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"]


def parse_show(text: str) -> dict[str, str]:
    """One unit's ``KEY=VALUE`` lines -> ``{KEY: VALUE}`` (values as printed; a line without ``=``,
    which systemctl does not print, is left out)."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def show_units(run: Callable[[list[str]], tuple[int, str, str]], units: list[str],
               properties: Iterable[str]) -> list[dict[str, str]]:
    """``systemctl show`` of several units through ``run(argv) -> (rc, stdout, stderr)``: one ``{KEY: VALUE}`` per
    unit, in the order asked; ValueError naming the units when systemctl fails or prints something else."""
    rc, out, err = run(show_argv(units, properties))
    if rc != 0:
        raise ValueError("systemctl show %s failed: %s" % (" ".join(units), (err or out).strip()))
    try:
        return parse_show_units(out)
    except ValueError as exc:
        raise ValueError("systemctl show %s: %s" % (" ".join(units), exc)) from None


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


# UnitFileState values of a unit that starts at boot (or needs no enabling); masked ones are refused.
_ENABLED_STATES = frozenset(("enabled", "enabled-runtime", "static", "alias", "indirect", "generated", "transient"))
# ActiveState values of a unit that is running or on its way (a timer waiting is "active").
_RUNNING_STATES = frozenset(("active", "activating", "reloading"))


def units_to_enable_and_start(units: list[str], shown: list[dict[str, str]]
                              ) -> tuple[list[str], list[str], list[str]]:
    """``units`` and their ``systemctl show -p Id,LoadState,UnitFileState,ActiveState`` blocks (in that order) ->
    (units to enable, units to start, problems naming each unit that cannot be: not found, masked, a bad file)."""
    if len(shown) != len(units):
        raise ValueError("asked about %d units, systemctl described %d" % (len(units), len(shown)))
    to_enable, to_start, problems = [], [], []
    for unit, props in zip(units, shown):
        load, file_state = props.get("LoadState", ""), props.get("UnitFileState", "")
        if load != "loaded" or file_state.startswith("masked"):
            problems.append("%s cannot be started: LoadState=%s UnitFileState=%s" % (unit, load, file_state or "-"))
            continue
        if file_state not in _ENABLED_STATES:
            to_enable.append(unit)
        if props.get("ActiveState", "") not in _RUNNING_STATES:
            to_start.append(unit)
    return to_enable, to_start, problems
