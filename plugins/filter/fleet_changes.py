# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters of playbooks/_fleet_changes.yml (thin wrappers over module_utils/fleet_changes.py).

- ``fleet_changes``: the last deploy's controller record and this deploy's hosts -> added, removed, the new record.
- ``fleet_record_pending``: the new record, the removed hosts and those not reached -> the record to write.
- ``orchestrator_moved_problem``: ``fleet_changes``' result -> why the deploy must stop (a host that was the
  orchestrator stays in the fleet as a worker), or "".
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.llamafleet.cluster.plugins.module_utils.fleet_changes import (
    FleetRecordError,
    fleet_changes,
    orchestrator_moved_problem,
    with_pending,
)


def llamafleet_fleet_changes(last, hosts, hostvars, groups, path, workers_group="llamafleet_workers"):
    """What changed since the deploy recorded in ``last`` (``{}``: none): see module_utils/fleet_changes.py."""
    try:
        return fleet_changes(last or {}, list(hosts), hostvars, groups, str(path), str(workers_group))
    except FleetRecordError as exc:
        raise AnsibleFilterError(str(exc)) from None


def llamafleet_fleet_record_pending(changes, unreached, not_run=None):
    """The record to write: ``changes``' record, with the removed hosts in ``unreached`` kept as pending, and the
    hosts that left a role but are in ``not_run`` (left out by --limit) still recorded with it."""
    if not isinstance(changes, dict) or "record" not in changes:
        raise AnsibleFilterError("fleet_record_pending: expected the result of fleet_changes, got %r" % (changes,))
    return with_pending(changes["record"], changes.get("removed") or [], list(unreached or []),
                        changes.get("left_roles") or [], list(not_run or []))


def llamafleet_orchestrator_moved_problem(changes):
    """Why the deploy must stop before any change (the orchestrator moved within the fleet), or ""."""
    if not isinstance(changes, dict) or "record" not in changes:
        raise AnsibleFilterError("orchestrator_moved_problem: expected the result of fleet_changes, got %r"
                                 % (changes,))
    return orchestrator_moved_problem(changes)


class FilterModule:
    """llamafleet fleet-change filters."""

    def filters(self):
        return {"fleet_changes": llamafleet_fleet_changes, "fleet_record_pending": llamafleet_fleet_record_pending,
                "orchestrator_moved_problem": llamafleet_orchestrator_moved_problem}
