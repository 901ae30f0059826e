"""The fleet at a glance: each host's units, build and weight cache, and llama-server's health.

The facts of every host are read in parallel (one SSH session per host) and
turned into one row per host; the rows are plain dicts so ``status --json``
prints them as they are.  Row fields: ``host``, ``address``, ``role``, ``unit``
(the host's units, comma-separated), ``state`` (``active`` when every unit
is, else the first unit's state that is not, or ``unreachable``), ``since``,
``restarts`` (summed), ``units`` (per unit), ``build``, ``cache_bytes`` and
``cache_files`` (workers; None elsewhere), ``health`` and ``endpoint``
(orchestrator), ``error`` (when the host could not be read).
"""

from __future__ import annotations

import shlex
from typing import Any

from .cluster import Endpoint
from .errors import UserError
from .facts import (
    Fact,
    HostFacts,
    gather,
    parse_du_bytes,
    parse_line_count,
    parse_systemctl_show,
    parse_word,
    systemctl_show,
)
from .fleet import Fleet, Host
from .layout import HostLayout, host_layout

# The state of a host in the fleet group that is neither orchestrator nor worker.
NO_UNIT = "-"
UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "ActiveEnterTimestamp", "NRestarts")


def status_facts(layout: HostLayout) -> list[Fact]:
    """What ``status`` reads from a host: its units, the build in use, and (workers) the weight cache."""
    facts = [Fact("build", f"readlink {shlex.quote(layout.build_link)}", parse_word)]
    if layout.units:
        facts.append(Fact("units", systemctl_show(layout.units, UNIT_PROPERTIES), parse_systemctl_show))
    if layout.rpc_cache_dir:
        cache = shlex.quote(layout.rpc_cache_dir)
        facts += [Fact("cache_bytes", f"du -sb {cache}", parse_du_bytes),
                  Fact("cache_files", f"ls -A {cache}", parse_line_count)]
    return facts


def unit_row(props: dict[str, str]) -> dict[str, Any]:
    """One unit's state from its ``systemctl show`` properties."""
    since = props.get("ActiveEnterTimestamp", "")
    restarts = props.get("NRestarts", "")
    return {
        "unit": props.get("Id", ""),
        "state": props.get("ActiveState", "") or "unknown",
        "sub_state": props.get("SubState", ""),
        "load_state": props.get("LoadState", ""),
        "since": "" if since == "n/a" else since,
        "restarts": int(restarts) if restarts.isdigit() else 0,
    }


def overall_state(units: list[dict[str, Any]]) -> str:
    """``active`` when every unit is active, else the state of the first unit that is not (``-``: no unit)."""
    if not units:
        return NO_UNIT
    return next((u["state"] for u in units if u["state"] != "active"), "active")


def host_row(host: Host, layout: HostLayout | None, facts: HostFacts) -> dict[str, Any]:
    """The status row of one host from its layout and facts (or the error that stopped reading them)."""
    row: dict[str, Any] = {
        "host": host.name,
        "address": host.cluster_address,
        "role": layout.role if layout else "?",
        "unit": ", ".join(layout.units) if layout else "",
    }
    if not facts.ok or layout is None:
        row.update(state="unreachable", error=facts.error or "unknown error")
        return row
    units = [unit_row(props) for props in facts.values.get("units", [])]
    row.update(
        state=overall_state(units),
        since=units[0]["since"] if units else "",
        restarts=sum(u["restarts"] for u in units),
        units=units,
        build=facts.values["build"],
        cache_bytes=facts.values.get("cache_bytes"),
        cache_files=facts.values.get("cache_files"),
    )
    return row


def is_bad(row: dict[str, Any]) -> bool:
    """A row that needs attention: a unit not active, or llama-server not healthy (a host without units is not)."""
    return row.get("state") not in ("active", NO_UNIT) or row.get("health", "ok") != "ok"


def fleet_status(fleet: Fleet, health_timeout: float = 2.0) -> list[dict[str, Any]]:
    """One status row per host of the fleet, by host name; llama-server's /health on an active orchestrator."""
    hosts = fleet.members()
    layouts: dict[str, HostLayout] = {}
    errors: dict[str, str] = {}
    for host in hosts:
        try:
            layouts[host.name] = host_layout(fleet, host)
        except UserError as exc:
            errors[host.name] = str(exc)
    found = gather(fleet, [h for h in hosts if h.name in layouts], lambda h: status_facts(layouts[h.name]))
    rows = []
    for host in hosts:
        facts = found.get(host.name) or HostFacts(host.name, error=errors.get(host.name))
        row = host_row(host, layouts.get(host.name), facts)
        if facts.ok and layouts[host.name].orchestrator:
            row.update(orchestrator_health(fleet, row["state"], health_timeout))
        rows.append(row)
    return rows


def orchestrator_health(fleet: Fleet, state: str, timeout: float) -> dict[str, str]:
    """``endpoint``, and ``health`` (/health's answer) when llama-server's unit is active."""
    try:
        endpoint = Endpoint.of(fleet, api_key="")  # /health needs no key
    except UserError as exc:
        return {"health": str(exc)}
    if state != "active":
        return {"endpoint": endpoint.url}
    return {"endpoint": endpoint.url, "health": endpoint.health(timeout=timeout)}


def journal_command(layout: HostLayout, lines: int) -> str:
    """The journal of a host's llamafleet units, last ``lines`` lines."""
    if not layout.units:
        raise UserError(f"{layout.host} is neither the orchestrator nor a worker: it runs no llamafleet unit")
    units = " ".join(f"-u {shlex.quote(u)}" for u in layout.units)
    return f"journalctl {units} -n {int(lines)} --no-pager -o short-iso"
