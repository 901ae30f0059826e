# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters of playbooks/_fleet_changes.yml (thin wrappers over module_utils/fleet_changes.py).

- ``fleet_changes``: the last deploy's controller record and this deploy's hosts -> added, removed, the new record.
- ``fleet_record_pending``: the new record, the removed hosts and those not reached -> the record to write.
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.llamafleet.cluster.plugins.module_utils.fleet_changes import (
    FleetRecordError,
    fleet_changes,
    with_pending,
)


def llamafleet_fleet_changes(last, hosts, hostvars, groups, path, workers_group="llamafleet_workers"):
    """What changed since the deploy recorded in ``last`` (``{}``: none): see module_utils/fleet_changes.py."""
    try:
        return fleet_changes(last or {}, list(hosts), hostvars, groups, str(path), str(workers_group))
    except FleetRecordError as exc:
        raise AnsibleFilterError(str(exc)) from None


def llamafleet_fleet_record_pending(changes, unreached):
    """The record to write: ``changes``' record, with the removed hosts in ``unreached`` kept as pending."""
    if not isinstance(changes, dict) or "record" not in changes:
        raise AnsibleFilterError("fleet_record_pending: expected the result of fleet_changes, got %r" % (changes,))
    return with_pending(changes["record"], changes.get("removed") or [], list(unreached or []))


class FilterModule:
    """llamafleet fleet-change filters."""

    def filters(self):
        return {"fleet_changes": llamafleet_fleet_changes, "fleet_record_pending": llamafleet_fleet_record_pending}
