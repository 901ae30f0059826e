# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Hosts that joined or left the fleet between two deploys, from the controller's record of the last one.

deploy.yml keeps, on the controller, a record of each deploy: every host of the fleet, its roles
(orchestrator, worker) and how Ansible reached it.  The next deploy compares the fleet it deployed
with that record (:func:`fleet_changes`): a host with no role any more (dropped from the inventory, or
from the groups that deploy it) left the fleet, and playbooks/_fleet_changes.yml takes llamafleet off it
with the connection the record kept.  A removed host that cannot be reached stays in the new record,
marked pending (:func:`with_pending`), so the next deploy tries again.  Stdlib only.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .constants import COLLECTION_VERSION, GROUP_ORCHESTRATOR, GROUP_WORKERS

RECORD_SCHEMA = 1
# How the report names each role, and what taking it on brings to a host that already had another.
ROLE_WORDS = {
    "worker": ("a worker", "an rpc-server runs there beside llama-server, and the plan counts the memory llama-server "
                           "leaves it"),
    "orchestrator": ("the orchestrator", "llama-server, the gate and the edge run there beside its rpc-server"),
}
# What the record keeps of how a host was reached (never a password).
CONNECTION_KEYS = ("ansible_host", "ansible_port", "ansible_user", "ansible_ssh_private_key_file",
                   "ansible_ssh_common_args", "ansible_become", "ansible_become_user", "ansible_python_interpreter")


class FleetRecordError(ValueError):
    """A controller record that cannot be used; the message names its file."""


def host_roles(name: str, groups: Mapping[str, Iterable[str]], workers_group: str = GROUP_WORKERS) -> list[str]:
    """``orchestrator`` and/or ``worker``: what ``name`` is in the fleet's groups."""
    roles = []
    if name in (groups.get(GROUP_ORCHESTRATOR) or ()):
        roles.append("orchestrator")
    if name in (groups.get(workers_group) or ()):
        roles.append("worker")
    return roles


def connection_of(hostvars: Mapping[str, Any]) -> dict[str, Any]:
    """The connection settings of one host's variables that the record keeps."""
    out = {}
    for key in CONNECTION_KEYS:
        value = hostvars.get(key)
        if value is not None and value != "":
            out[key] = value if isinstance(value, (bool, int)) else str(value)
    return out


def check_record(record: Any, path: str) -> dict[str, Any]:
    """The last deploy's record (``{}``: none), refused when it is not one or is of a newer schema."""
    if not record:
        return {}
    if not isinstance(record, dict) or not isinstance(record.get("hosts"), dict):
        raise FleetRecordError("%s is not a llamafleet controller record (no hosts): move it away and deploy again"
                               % path)
    schema = record.get("schema")
    if not isinstance(schema, int) or schema > RECORD_SCHEMA:
        version = record.get("collection_version")
        raise FleetRecordError("%s has record schema %r, this llamafleet reads up to %d (written by collection %s): "
                               "upgrade the llamafleet.cluster collection" % (path, schema, RECORD_SCHEMA, version))
    return record


def fleet_changes(last: Any, hosts: Iterable[str], hostvars: Mapping[str, Mapping[str, Any]],
                  groups: Mapping[str, Iterable[str]], path: str, workers_group: str = GROUP_WORKERS
                  ) -> dict[str, Any]:
    """What changed since the last deploy's ``last`` record, and the record of this one.

    :param hosts: the hosts of the fleet group in the inventory, those a ``--limit`` leaves out of this run
        included (they are still in the fleet).
    :returns: ``{path, record, added, removed: [{name, connection, roles}], left_roles: [{name, roles, stays}],
        gained_roles: [{name, roles, had}], report: [lines]}``. ``left_roles``: the hosts that stay in the fleet
        without a role they had (``roles``, ``stays``: the roles they keep); ``gained_roles``: the hosts of the last
        deploy that keep every role they had and take another (``had``: the roles they had).
    """
    previous = check_record(last, path).get("hosts", {})
    current = {}
    for name in hosts:
        roles = host_roles(name, groups, workers_group)
        if roles:
            current[name] = {"roles": roles, "connection": connection_of(hostvars.get(name) or {})}
    removed = [{"name": name, "roles": entry.get("roles", []), "connection": dict(entry.get("connection") or {})}
               for name, entry in sorted(previous.items()) if name not in current]
    added = sorted(name for name in current if name not in previous) if previous else []
    left_roles, gained_roles = [], []
    for name, entry in sorted(previous.items()):
        if name in current:
            had = list(entry.get("roles") or [])
            gone = [role for role in had if role not in current[name]["roles"]]
            if gone:
                left_roles.append({"name": name, "roles": gone, "stays": list(current[name]["roles"])})
            new = [role for role in current[name]["roles"] if role not in had]
            if new and had and not gone:
                gained_roles.append({"name": name, "roles": new, "had": had})
    report = ["%s joined the fleet as %s" % (name, " and ".join(current[name]["roles"])) for name in added]
    report += ["%s left the fleet (it was %s): its llamafleet units are stopped and removed; users, caches and "
               "builds stay (playbooks/teardown.yml takes them)" % (r["name"], " and ".join(r["roles"]) or "pending")
               for r in removed]
    report += ["%s is no longer a worker (it stays the orchestrator): its rpc-server units and firewall rules are "
               "removed; its user and weight cache stay (playbooks/teardown.yml takes them)" % r["name"]
               for r in left_roles if "worker" in r["roles"]]
    report += [gained_line(r) for r in gained_roles]
    record = {"schema": RECORD_SCHEMA, "collection_version": COLLECTION_VERSION, "hosts": current}
    return {"path": path, "record": record, "added": added, "removed": removed, "left_roles": left_roles,
            "gained_roles": gained_roles, "report": report}


def gained_line(gained: Mapping[str, Any]) -> str:
    """The report's line for one of ``fleet_changes``' ``gained_roles``."""
    return "%s is now %s too (it stays %s): %s" % (
        gained["name"], " and ".join(ROLE_WORDS[role][0] for role in gained["roles"]),
        " and ".join(ROLE_WORDS[role][0] for role in gained["had"]),
        "; ".join(ROLE_WORDS[role][1] for role in gained["roles"]))


def orchestrator_moved_problem(changes: Mapping[str, Any]) -> str:
    """Why this deploy must not go on: a host that stays in the fleet but is no longer the orchestrator (its
    llama-server, gate and edge would go on serving the old plan there), or ``""``."""
    moved = [r for r in changes.get("left_roles") or [] if "orchestrator" in r["roles"]]
    if not moved:
        return ""
    names = ",".join(r["name"] for r in moved)
    return ("%s was the orchestrator of the last deploy and stays in the fleet as %s: its llama-server, gate and edge "
            "would go on serving the old plan there. Moving the orchestrator takes two runs: playbooks/teardown.yml "
            "-l %s first (users, caches and builds stay), then this deploy. Nothing was changed."
            % (" and ".join(r["name"] for r in moved), " and ".join(moved[0]["stays"]), names))


def with_pending(record: Mapping[str, Any], removed: Iterable[Mapping[str, Any]],
                 unreached: Iterable[str], left_roles: Iterable[Mapping[str, Any]] = (),
                 not_run: Iterable[str] = ()) -> dict[str, Any]:
    """``record`` with the removed hosts that could not be reached kept, marked pending, and the hosts of
    ``left_roles`` that this run left out (``not_run``: a ``--limit``) still recorded with the roles they left, so
    that the next deploy takes those roles off them."""
    out = {**record, "hosts": dict(record.get("hosts") or {})}
    missing = set(unreached)
    for entry in removed:
        if entry["name"] in missing:
            out["hosts"][entry["name"]] = {"roles": list(entry.get("roles") or []), "pending_removal": True,
                                           "connection": dict(entry.get("connection") or {})}
    skipped = set(not_run)
    for entry in left_roles:
        host = out["hosts"].get(entry["name"])
        if entry["name"] in skipped and host is not None:
            roles = list(host.get("roles") or [])
            out["hosts"][entry["name"]] = {**host, "roles": roles + [r for r in entry["roles"] if r not in roles]}
    return out
