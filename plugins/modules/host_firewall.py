#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_firewall
short_description: Open TCP ports to a few clients only in the host's firewalld or ufw, and close them again
version_added: "0.1.0"
description:
  - nftables runs every base chain hooked at input, and a packet must be accepted by all of them. Where
    firewalld or ufw is active, a port another nftables table accepts is still closed unless that manager
    accepts it too. This module opens O(ports) at O(address) to O(clients), and to no one else, there.
  - "firewalld: a rich rule per client and port, runtime and permanent (so it survives C(firewall-cmd --reload)),
    in the zone the client's packets land in: a zone bound to a source holding the client, else the zone of
    the interface holding O(address), else the default zone."
  - "ufw: C(ufw allow proto tcp from CLIENT to ADDRESS port PORT comment COMMENT) per client and port."
  - The rules it added are recorded in O(state_path) (firewalld rich rules carry no comment); those no longer
    wanted (a client left, or the manager is no longer the chosen one) are removed. Rules that were already
    there are never recorded, so never removed.
  - With the manager not active, rules recorded for it stay recorded (installed) or are forgotten (not
    installed), with a warning.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  manager:
    description:
      - V(auto) takes the active manager (none active opens nothing); V(firewalld) and V(ufw) must be active;
        V(none) opens nothing (and removes the rules recorded before).
    type: str
    choices: [auto, firewalld, ufw, none]
    default: auto
  clients:
    description: Addresses or networks allowed in.
    type: list
    elements: str
    required: true
  ports:
    description: TCP ports to open.
    type: list
    elements: int
    required: true
  address:
    description: The address the service binds to; V(0.0.0.0) for any.
    type: str
    required: true
  state_path:
    description: The JSON file recording the rules added.
    type: path
    default: /etc/llamafleet/host-firewall.json
  comment:
    description: The comment of the ufw rules (rules with it are ours).
    type: str
    default: llamafleet-rpc
seealso:
  - module: llamafleet.cluster.host_firewall_facts
"""

EXAMPLES = r"""
- name: Let only the orchestrator reach rpc-server through firewalld or ufw
  llamafleet.cluster.host_firewall:
    clients: [10.77.0.11]
    ports: [50052]
    address: 10.77.0.13
"""

RETURN = r"""
manager:
  description: The manager the ports are open in (V(firewalld), V(ufw)), or V(none).
  returned: always
  type: str
  sample: firewalld
added:
  description: Rules added (or, in check mode, that would be), as C(LAYER firewalld zone Z RULE) or C(ufw ARGS).
  returned: always
  type: list
  elements: str
  sample: ['permanent firewalld zone public: rule family="ipv4" source address="10.77.0.11"
            destination address="10.77.0.13" port port="50052" protocol="tcp" accept']
removed:
  description: Rules removed (or that would be).
  returned: always
  type: list
  elements: str
rules:
  description: The rules recorded in O(state_path) afterwards (C(manager), C(zone), C(client), C(address), C(port)).
  returned: always
  type: list
  elements: dict
firewalld:
  description: With firewalld chosen, C(interface) (of O(address)), C(default_zone) and the active C(zones).
  returned: always
  type: dict
facts:
  description: The managers found (as llamafleet.cluster.host_firewall_facts returns them).
  returned: always
  type: dict
"""

import os
import tempfile

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import (
    HOST_FIREWALL_COMMENT,
    HOST_FIREWALL_STATE,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.host_firewall import (
    CHOICES,
    HostFirewallError,
    converge,
    dump_state,
)


def write_state(module: AnsibleModule, path: str, text: str) -> None:
    """Write the state file (root only, 0644) atomically, creating its directory."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        module.atomic_move(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def run_module(module: AnsibleModule) -> dict:
    """Converge the host's firewall manager and the state file; the module's result."""
    params = module.params
    path = params["state_path"]
    before = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            before = handle.read()
    try:
        outcome = converge(lambda argv: module.run_command(argv, environ_update={"LC_ALL": "C"}),
                           module.get_bin_path, params["manager"], params["clients"], params["ports"],
                           params["address"], before, comment=params["comment"], check_mode=module.check_mode)
    except (HostFirewallError, ValueError) as exc:
        module.fail_json(msg=str(exc))
    after = dump_state(outcome.tracked)
    state_changed = after != before and (before is not None or bool(outcome.tracked))
    if state_changed and not module.check_mode:
        write_state(module, path, after)
    result = outcome.as_dict()
    for warning in result.pop("warnings"):
        module.warn(warning)
    diff = result.pop("diff")
    result["changed"] = bool(outcome.added or outcome.removed or state_changed)
    if module._diff:
        result["diff"] = diff
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            manager=dict(type="str", choices=list(CHOICES), default="auto"),
            clients=dict(type="list", elements="str", required=True),
            ports=dict(type="list", elements="int", required=True),
            address=dict(type="str", required=True),
            state_path=dict(type="path", default=HOST_FIREWALL_STATE),
            comment=dict(type="str", default=HOST_FIREWALL_COMMENT),
        ),
        supports_check_mode=True,
    )
    module.exit_json(**run_module(module))


if __name__ == "__main__":
    main()
