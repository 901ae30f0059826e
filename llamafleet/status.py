"""The fleet at a glance: each host's units, build and weight cache, and llama-server's health.

The facts of every host are read in parallel (one SSH session per host) and
turned into one row per host; the rows are plain dicts so ``status --json``
prints them as they are.  Row fields: ``host``, ``address``, ``role``, ``unit``
(the host's units, comma-separated), ``state`` (``active`` when every unit
is, else the first unit's state that is not, or ``unreachable``), ``since``,
``restarts`` (summed), ``units`` (per unit), ``build``, ``cache_bytes`` and
``cache_files`` (workers; None elsewhere), ``health`` and ``endpoint``
(orchestrator), ``error`` (when the host could not be read).

The serving gate (``serving_gate.py``, its watchdog in ``gate_watchdog.py``) adds, on the orchestrator: ``gate``
(its unit's state), ``serving`` (``STATE: reason`` from its state file, or
``gate not running (...)``), ``serving_state`` (serving, loading, down; None
when the gate is not running), ``serving_since`` (seconds in that state),
``gate_restarts`` (llama-server restarts by the watchdog), ``load_seconds`` (how long
llama-server's last model load took, as the gate saw it; None before one ended) and ``gate_state``
(the state file as read); on a worker: ``guard`` (its rpc-server guard unit's
state) and ``link`` (what the gate sees of llama-server's link to it: ok,
stalled, lost, unknown; None when llama-server does not use the worker).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from .cluster import Endpoint
from .core import constants, gate_decision
from .core.systemd_show import parse_show_units, show_argv
from .errors import UserError
from .facts import (
    Fact,
    HostFacts,
    gather,
    parse_du_bytes,
    parse_line_count,
    parse_word,
)
from .fleet import Fleet, Host
from .layout import HostLayout, fleet_layouts, inventory_role

# The state of a host in the fleet group that is neither orchestrator nor worker.
NO_UNIT = "-"
UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "ActiveEnterTimestamp", "NRestarts")
# The gate rewrites its state file every poll (1 s): one older than this was left by a gate that stopped.
GATE_STATE_MAX_AGE = 10
# Worker links through which llama-server cannot compute.
BAD_LINKS = ("stalled", "lost")


def status_facts(layout: HostLayout) -> list[Fact]:
    """What ``status`` reads from a host: its units, the build in use, and (workers) the weight cache."""
    facts = [Fact("build", f"readlink {shlex.quote(layout.build_link)}", parse_word)]
    if layout.units:
        facts.append(Fact("units", shlex.join(show_argv(layout.units, UNIT_PROPERTIES)), parse_show_units))
    if layout.helper_units:
        facts.append(Fact("helpers", shlex.join(show_argv(layout.helper_units, UNIT_PROPERTIES)), parse_show_units))
    if layout.gate_state_path:
        # the host's own clock, so that the state file's age does not depend on the controller's
        facts.append(Fact("gate_state", f"date +%s; cat {shlex.quote(layout.gate_state_path)}", parse_gate_state))
    if layout.rpc_cache_dir:
        cache = shlex.quote(layout.rpc_cache_dir)
        facts += [Fact("cache_bytes", f"du -sb {cache}", parse_du_bytes),
                  Fact("cache_files", f"ls -A {cache}", parse_line_count)]
    return facts


def parse_gate_state(text: str) -> dict[str, Any]:
    """``date +%s; cat STATE_FILE``: ``now`` (the host's clock), ``doc`` (the gate's state, or None) and
    ``error`` (why there is none: no file, not JSON, not the gate's shape)."""
    first, _, rest = text.partition("\n")
    now = int(first.strip())
    if not rest.strip():
        return {"now": now, "doc": None, "error": "no state file"}
    try:
        doc = json.loads(rest)
    except ValueError as exc:
        return {"now": now, "doc": None, "error": f"state file is not JSON: {exc}"}
    problem = gate_doc_problem(doc)
    return {"now": now, "doc": None if problem else doc, "error": problem}


def gate_doc_problem(doc: Any) -> str | None:
    """Why ``doc`` is not a state file of the gate (Watchdog.snapshot's shape), or None."""
    if not isinstance(doc, dict):
        return "state file is not a JSON object"
    if doc.get("state") not in gate_decision.STATES:
        return f"state file has state {doc.get('state')!r}, not one of {', '.join(gate_decision.STATES)}"
    for key in ("since", "updated", "restarts"):
        if isinstance(doc.get(key), bool) or not isinstance(doc.get(key), (int, float)):
            return f"state file has {key} {doc.get(key)!r}, not a number"
    if not isinstance(doc.get("reason"), str):
        return f"state file has reason {doc.get('reason')!r}, not a text"
    if not isinstance(doc.get("workers", {}), dict):
        return "state file's workers is not an object"
    return None


def gate_fields(unit_state: str, found: dict[str, Any]) -> dict[str, Any]:
    """The orchestrator's gate fields from the gate unit's state and its state file (:func:`parse_gate_state`).

    The file speaks for the gate only while the unit is active and the file is fresh (``updated`` at most
    GATE_STATE_MAX_AGE seconds ago by the host's clock); otherwise the gate is not running.
    """
    doc = found["doc"]
    load = (doc.get("load") if doc else None) or {}
    fields: dict[str, Any] = {"gate": unit_state, "serving_state": None, "serving_since": None,
                              "gate_restarts": doc["restarts"] if doc else None, "gate_state": doc,
                              "load_seconds": load.get("last_seconds") if isinstance(load, dict) else None}
    if unit_state != "active":
        return dict(fields, serving=f"gate not running ({constants.GATE_UNIT} is {unit_state})")
    if doc is None:
        return dict(fields, serving=f"gate not running ({found['error']})")
    age = found["now"] - doc["updated"]
    if age > GATE_STATE_MAX_AGE:
        return dict(fields, serving=f"gate not running (state {age:.0f} s old)")
    plan = doc.get("plan") or {}
    without = plan.get("without") if plan.get("mode") == "degraded" else None
    mode = f" (degraded, without {without})" if without else ""
    return dict(fields, serving=f"{doc['state']}{mode}: {doc['reason']}", serving_state=doc["state"],
                serving_since=max(0, round(found["now"] - doc["since"])), degraded_without=without)


def gate_links(orchestrator_row: dict[str, Any] | None) -> dict[str, str] | None:
    """``{worker host: link}`` as the gate last saw it, or None when the gate is not running (or unknown)."""
    if not orchestrator_row or orchestrator_row.get("serving_state") is None:
        return None
    workers = orchestrator_row["gate_state"].get("workers", {})
    return {host: str(info.get("link", "unknown")) for host, info in workers.items() if isinstance(info, dict)}


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


def host_row(host: Host, layout: HostLayout | None, facts: HostFacts, role: str = "?") -> dict[str, Any]:
    """The status row of one host from its layout and facts (or the error that stopped reading them);
    ``role``: the inventory's, shown when there is no layout (the host could not be read)."""
    row: dict[str, Any] = {
        "host": host.name,
        "address": host.cluster_address,
        "role": layout.role if layout else role,
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
    helpers = {u["unit"]: u["state"] for u in (unit_row(props) for props in facts.values.get("helpers", []))}
    if layout.worker:
        row["guard"] = helpers.get(layout.guard_unit, "unknown")
    if "gate_state" in facts.values:
        row.update(gate_fields(helpers.get(layout.gate_unit, "unknown"), facts.values["gate_state"]))
    row["recorded"] = layout.recorded
    return row


def is_bad(row: dict[str, Any]) -> bool:
    """A row that needs attention (a host without units does not): a unit not active, llama-server not
    healthy, the gate or a guard not active, the cluster not serving, or a worker link stalled or lost."""
    return (row.get("state") not in ("active", NO_UNIT) or row.get("health", "ok") != "ok"
            or row.get("gate", "active") != "active" or row.get("guard", "active") != "active"
            or ("serving" in row and row.get("serving_state") != gate_decision.SERVING)
            or row.get("link") in BAD_LINKS)


def fleet_status(fleet: Fleet, health_timeout: float = 2.0) -> list[dict[str, Any]]:
    """One status row per host of the fleet, by host name; llama-server's /health on an active orchestrator."""
    hosts = fleet.members()
    layouts, _records, errors = fleet_layouts(fleet, hosts)
    found = gather(fleet, [h for h in hosts if h.name in layouts], lambda h: status_facts(layouts[h.name]))
    rows = []
    for host in hosts:
        facts = found.get(host.name) or HostFacts(host.name, error=errors.get(host.name))
        row = host_row(host, layouts.get(host.name), facts, inventory_role(fleet, host))
        if facts.ok and layouts[host.name].orchestrator:
            row.update(orchestrator_health(fleet, row["state"], health_timeout, layouts[host.name]))
        rows.append(row)
    links = gate_links(next((r for r in rows if "serving" in r), None))
    for row in rows:
        if "guard" in row:  # a worker that could be read
            row["link"] = "unknown" if links is None else links.get(row["host"])
    return rows


def orchestrator_health(fleet: Fleet, state: str, timeout: float,
                        layout: HostLayout | None = None) -> dict[str, str]:
    """``endpoint`` (where the orchestrator's ``layout`` says it serves), and ``health`` (/health's answer)
    when llama-server's unit is active."""
    try:
        endpoint = Endpoint.of(fleet, api_key="", layout=layout)  # /health needs no key
    except UserError as exc:
        return {"health": str(exc)}
    if state != "active":
        return {"endpoint": endpoint.url}
    return {"endpoint": endpoint.url, "health": endpoint.health(timeout=timeout)}


def journal_command(layout: HostLayout, lines: int) -> str:
    """The journal of a host's llamafleet units (servers, the gate, the guard), last ``lines`` lines."""
    if not layout.units:
        raise UserError(f"{layout.host} is neither the orchestrator nor a worker: it runs no llamafleet unit")
    units = " ".join(f"-u {shlex.quote(u)}" for u in layout.journal_units)
    return f"journalctl {units} -n {int(lines)} --no-pager -o short-iso"
