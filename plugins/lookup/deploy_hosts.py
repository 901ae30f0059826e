# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Lookup plugin: a deploy play's host pattern, which leaves out the hosts found in sync with their stamp."""

from __future__ import annotations

DOCUMENTATION = r"""
name: deploy_hosts
author: llamafleet maintainers (@llamafleet)
short_description: The host pattern of a deploy play, less the hosts in sync with the last deploy
description:
  - Returns the inventory group that a constant names (as the lookup C(llamafleet.cluster.constants) does), followed by
    C(:!_llamafleet_in_sync) once the deploy's first play has found every host as the last whole deploy left it
    (module C(llamafleet.cluster.deploy_stamp)) and put them in that group. The play then has no hosts and is skipped.
  - Before that group exists the pattern is the bare group, so a play that uses it prints no warning.
options:
  _terms:
    description: Names of group constants, lower case (for example C(group_workers)).
    required: true
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Run the rpc-server workers
  hosts: "{{ lookup('llamafleet.cluster.deploy_hosts', 'group_workers') }}"
  roles:
    - role: llamafleet.cluster.rpc_server
"""

RETURN = r"""
_raw:
  description: One host pattern per term.
  type: list
  elements: str
"""

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import GROUP_IN_SYNC, as_dict


class LookupModule(LookupBase):
    """Host patterns of the deploy's plays."""

    def run(self, terms, variables=None, **kwargs):
        table = as_dict()
        in_sync = bool(((variables or {}).get("groups") or {}).get(GROUP_IN_SYNC))
        out = []
        for term in terms:
            key = str(term).lower()
            if not key.startswith("group_") or key not in table:
                raise AnsibleLookupError("llamafleet.cluster.deploy_hosts: %r is not a group constant (known: %s)"
                                         % (term, ", ".join(sorted(k for k in table if k.startswith("group_")))))
            out.append(table[key] + (":!" + GROUP_IN_SYNC if in_sync else ""))
        return out
