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

    :param hosts: the hosts this deploy ran on (the fleet group).
    :returns: ``{path, record, added, removed: [{name, connection, roles}], report: [lines]}``.
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
    report = ["%s joined the fleet as %s" % (name, " and ".join(current[name]["roles"])) for name in added]
    report += ["%s left the fleet (it was %s): its llamafleet units are stopped and removed; users, caches and "
               "builds stay (playbooks/teardown.yml takes them)" % (r["name"], " and ".join(r["roles"]) or "pending")
               for r in removed]
    record = {"schema": RECORD_SCHEMA, "collection_version": COLLECTION_VERSION, "hosts": current}
    return {"path": path, "record": record, "added": added, "removed": removed, "report": report}


def with_pending(record: Mapping[str, Any], removed: Iterable[Mapping[str, Any]],
                 unreached: Iterable[str]) -> dict[str, Any]:
    """``record`` with the removed hosts that could not be reached kept, marked pending."""
    out = {**record, "hosts": dict(record.get("hosts") or {})}
    missing = set(unreached)
    for entry in removed:
        if entry["name"] in missing:
            out["hosts"][entry["name"]] = {"roles": list(entry.get("roles") or []), "pending_removal": True,
                                           "connection": dict(entry.get("connection") or {})}
    return out
