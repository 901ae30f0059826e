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

import importlib
import os

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import as_dict

# Every play of the collection's playbooks names its hosts with this lookup, so it loads in the controller's main
# process before any task runs. Ansible runs each task of each host in a worker forked from that process, and a
# worker loads a filter plugin on first use: for a collection it compiles the source again (no bytecode cache), in
# every worker. Importing the filter plugins here lets the workers inherit them. Measured on a no-change deploy of
# the 3-host lab (session 32): 2.8 s less controller CPU, 44.5 s against 47.1 s (three runs each).
FILTER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "filter")
FILTER_MODULES = tuple(sorted(name[:-3] for name in (os.listdir(FILTER_DIR) if os.path.isdir(FILTER_DIR) else ())
                              if name.endswith(".py") and not name.startswith("_")))


def _warm_filters() -> None:
    for name in FILTER_MODULES:
        try:
            importlib.import_module("ansible_collections.llamafleet.cluster.plugins.filter." + name)
        except Exception:  # pylint: disable=broad-except
            pass  # the task that uses the filter loads it again and reports the error where it belongs
    for name in ("ansible.plugins.filter.core", "ansible.plugins.test.core"):
        importlib.import_module(name)


_warm_filters()


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
