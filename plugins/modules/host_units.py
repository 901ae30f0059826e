#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Enables and starts a set of systemd units in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: host_units
short_description: Enable and start a set of systemd units in one step
version_added: "0.4.0"
description:
  - Makes every given unit enabled and running, reading all of their states with one C(systemctl show) and then
    enabling and starting only those that are not, so a deploy that changes nothing pays one round trip for the set
    instead of one per unit (the rpc_server role's worker firewall, rpc-servers, guard and metrics timer).
  - A unit that is masked or not found fails the task, naming it. A unit that fails to start fails the task with the
    end of its journal.
  - Supports check mode (reports what it would enable or start).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
attributes:
  check_mode:
    support: full
    details: Reports the units it would enable or start, and changes nothing.
  diff_mode:
    support: none
options:
  units:
    description: The units, for example C(llamafleet-rpc-server.service). An empty list does nothing.
    type: list
    elements: str
    required: true
  enable_only:
    description: Units to make enabled without starting them (one started later, or by a handler). A unit in both
      lists is started.
    type: list
    elements: str
    default: []
  daemon_reload:
    description: Run C(systemctl daemon-reload) first, so unit files written just before are read.
    type: bool
    default: false
author:
  - llamafleet maintainers (@llamafleet)
"""

EXAMPLES = r"""
- name: Enable and start the worker's units
  llamafleet.cluster.host_units:
    units:
      - llamafleet-rpc-firewall.service
      - llamafleet-rpc-server.service
    daemon_reload: true
"""

RETURN = r"""
enabled:
  description: The units this run enabled (or would, in check mode).
  returned: always
  type: list
  elements: str
started:
  description: The units this run started (or would, in check mode).
  returned: always
  type: list
  elements: str
active_states:
  description: Each unit's C(ActiveState) (O(units) and O(enable_only)) as read before this run enabled or started
    anything, for example C(active), C(inactive) or C(failed).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.systemd_show import (
    journal_tail_argv,
    show_units,
    units_to_enable_and_start,
)

PROPERTIES = ("Id", "LoadState", "UnitFileState", "ActiveState")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            units=dict(type="list", elements="str", required=True),
            enable_only=dict(type="list", elements="str", default=[]),
            daemon_reload=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    to_run = module.params["units"]
    units = to_run + [unit for unit in module.params["enable_only"] if unit not in to_run]
    if not units:
        module.exit_json(changed=False, enabled=[], started=[], active_states={})
    if module.params["daemon_reload"] and not module.check_mode:
        module.run_command(["systemctl", "daemon-reload"], check_rc=True)
    try:
        shown = show_units(module.run_command, units, PROPERTIES)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    try:
        to_enable, to_start, problems = units_to_enable_and_start(units, shown)
    except ValueError as exc:
        module.fail_json(msg="systemctl show %s: %s" % (" ".join(units), exc))
    active_states = dict((unit, props.get("ActiveState", "")) for unit, props in zip(units, shown))
    to_start = [unit for unit in to_start if unit in to_run]
    if problems:
        module.fail_json(msg="; ".join(problems))
    if not module.check_mode:
        if to_enable:
            module.run_command(["systemctl", "enable", "--", *to_enable], check_rc=True)
        for unit in to_start:
            rc, out, err = module.run_command(["systemctl", "start", "--", unit])
            if rc != 0:
                journal = module.run_command(journal_tail_argv(unit))[1]
                module.fail_json(msg="%s did not start: %s\n%s" % (unit, (err or out).strip(), journal.strip()),
                                 enabled=to_enable, started=[], active_states=active_states)
    module.exit_json(changed=bool(to_enable or to_start), enabled=to_enable, started=to_start,
                     active_states=active_states)


if __name__ == "__main__":
    main()
