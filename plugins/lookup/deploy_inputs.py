# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Lookup plugin: the digest of a deploy's inputs, for the deploy stamp (module_utils/deploy_stamp.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: deploy_inputs
author: llamafleet maintainers (@llamafleet)
short_description: The digest of everything the controller feeds a deploy
description:
  - One sha256 over the collection's playbooks, roles, plugins and metadata, every fleet host's variables (the
    inventory's, group and host variables, extra vars; templated where they can be before facts are gathered, as
    written where not), the variables of the play that takes it (the task's own view), each host's groups, Ansible's
    version, and the content of every controller file whose absolute path a variable holds (a certificate, a key, a
    local model file; by size and mtime above 64 MiB).
  - Left out, because they do not choose what a deploy makes, are how the run was started (check mode, tags, limit,
    verbosity, forks, the paths it ran from), facts and the roles' private facts (names that start with C(_)), and
    C(llamafleet_skip_when_in_sync).
  - Take it before the roles run, which add facts of their own (C(deploy.yml) takes it in its first play).
options: {}
"""

EXAMPLES = r"""
- name: Take the digest of this deploy's inputs
  ansible.builtin.set_fact:
    _llamafleet_deploy_inputs: "{{ lookup('llamafleet.cluster.deploy_inputs') }}"
  run_once: true
"""

RETURN = r"""
_raw:
  description: The digest (hex sha256), one item.
  type: list
  elements: str
"""

import os

from ansible.plugins.lookup import LookupBase

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import GROUP_FLEET
from ansible_collections.llamafleet.cluster.plugins.module_utils.deploy_stamp import (
    canonical,
    collection_files,
    input_variable,
    inputs_digest,
)

COLLECTION_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The task's own view holds these besides the variables (the other hosts' are taken from the inventory).
NOT_VARIABLES = frozenset(("hostvars", "vars", "environment"))


def _value(template, raw, name):
    """A variable templated where it can be (facts are not gathered yet), else as written."""
    try:
        return canonical(template(name))
    except Exception:  # pylint: disable=broad-except
        return canonical(raw[name])


class LookupModule(LookupBase):
    """Digest the deploy's inputs."""

    def run(self, terms, variables=None, **kwargs):
        variables = variables or {}
        hostvars = variables["hostvars"]
        hosts = {}
        for host in sorted((variables.get("groups") or {}).get(GROUP_FLEET, [])):
            raw = hostvars.raw_get(host)
            facts = raw.get("ansible_facts") or {}
            templated = hostvars[host]
            hosts[host] = {name: _value(templated.__getitem__, raw, name)
                           for name in raw if input_variable(name, facts)}
        # the play's and the imports' variables too (bench.yml imports deploy.yml), as this task sees them
        facts = variables.get("ansible_facts") or {}
        view = {name: _value(lambda key: self._templar.template(variables[key]), variables, name)
                for name in variables if name not in NOT_VARIABLES and input_variable(name, facts)}
        return [inputs_digest(collection_files(COLLECTION_ROOT), dict(hosts, **{"": view}),
                              variables.get("ansible_version"))]
