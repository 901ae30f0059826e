# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Lookup plugin: llamafleet's fixed names and defaults, from module_utils/constants.py."""

from __future__ import annotations

DOCUMENTATION = r"""
name: constants
author: llamafleet maintainers (@llamafleet)
short_description: The fixed names and defaults of a llamafleet deployment
description:
  - Returns values from the collection's one constants module (unit names, inventory groups, default
    ports, paths, rpc-server binary names, the RPC hash threshold fallback), so roles and playbooks
    never type them again.
  - Without terms, returns the whole table as one dictionary.
options:
  _terms:
    description: Names of constants, lower case (for example C(llama_server_unit)).
    required: false
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Restart the orchestrator's unit
  ansible.builtin.systemd_service:
    name: "{{ lookup('llamafleet.cluster.constants', 'llama_server_unit') }}"
    state: restarted
"""

RETURN = r"""
_raw:
  description: The value of each named constant, or the whole table when no name is given.
  type: list
  elements: raw
"""

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import as_dict


class LookupModule(LookupBase):
    """Serve constants by name."""

    def run(self, terms, variables=None, **kwargs):
        table = as_dict()
        if not terms:
            return [table]
        out = []
        for term in terms:
            key = str(term).lower()
            if key not in table:
                raise AnsibleLookupError("llamafleet.cluster.constants: unknown constant %r (known: %s)"
                                         % (term, ", ".join(sorted(table))))
            value = table[key]
            out.append(list(value) if isinstance(value, tuple) else value)
        return out
