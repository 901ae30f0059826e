#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_firewall_facts
short_description: Tell which firewall manager (firewalld, ufw) filters a host, and its nftables tables
version_added: "0.1.0"
description:
  - Reads whether firewalld runs (C(firewall-cmd --state)) and whether ufw is enabled (C(ufw status); the
    C(ufw.service) unit stays active with ufw disabled, so C(systemctl) cannot tell), and lists the nftables
    tables (C(nft list tables)).
  - Resolves O(manager) to the manager the rpc_server role opens its ports in, and says why it cannot
    (RV(problem)), for the role's preflight to assert on.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.read_only
options:
  manager:
    description:
      - The manager asked for (the rpc_server role's C(rpc_server_host_firewall)). V(auto) takes the active
        one; V(firewalld) and V(ufw) must be active; V(none) opens nothing.
    type: str
    choices: [auto, firewalld, ufw, none]
    default: auto
seealso:
  - module: llamafleet.cluster.host_firewall
"""

EXAMPLES = r"""
- name: Read the host's firewall managers
  llamafleet.cluster.host_firewall_facts:
    manager: "{{ rpc_server_host_firewall }}"
  register: host_firewall

- name: Stop before any change when the manager asked for is not active
  ansible.builtin.assert:
    that: host_firewall.problem is none
    fail_msg: "{{ inventory_hostname }}: {{ host_firewall.problem }}"
"""

RETURN = r"""
manager:
  description: The manager the ports are opened in (V(firewalld), V(ufw)), or V(none).
  returned: always
  type: str
  sample: firewalld
problem:
  description: Why O(manager) cannot be used on this host (names C(rpc_server_host_firewall)), or null.
  returned: always
  type: str
facts:
  description: What the host runs.
  returned: always
  type: dict
  contains:
    firewalld:
      description: C(installed), C(active) and C(status) (the first line C(firewall-cmd --state) printed).
      type: dict
    ufw:
      description: C(installed), C(active) and C(status) (the first line of C(ufw status)).
      type: dict
    nft_tables:
      description: The nftables tables (C(inet firewalld), C(ip filter), ...), or null without C(nft).
      type: list
      elements: str
  sample: {firewalld: {installed: true, active: true, status: running},
           ufw: {installed: false, active: false, status: ""},
           nft_tables: [inet llamafleet_rpc, inet firewalld]}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.host_firewall import (
    CHOICES,
    host_firewall_problem,
    probe,
    resolve_manager,
)


def run_module(module: AnsibleModule) -> dict:
    """The facts, the manager and the problem (read-only)."""
    facts = probe(lambda argv: module.run_command(argv, environ_update={"LC_ALL": "C"}), module.get_bin_path)
    requested = module.params["manager"]
    return {"changed": False, "facts": facts, "manager": resolve_manager(requested, facts)[0],
            "problem": host_firewall_problem(requested, facts)}


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(manager=dict(type="str", choices=list(CHOICES), default="auto")),
        supports_check_mode=True,
    )
    module.exit_json(**run_module(module))


if __name__ == "__main__":
    main()
