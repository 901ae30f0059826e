#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Checks, writes or forgets the stamp a whole deploy leaves on a host."""

from __future__ import annotations

DOCUMENTATION = r"""
module: deploy_stamp
short_description: Tell in one step whether a host is as the last whole deploy left it
version_added: "0.4.0"
description:
  - A whole run of C(playbooks/deploy.yml) (no tags, no check mode) ends by writing a stamp on every host
    (O(state=present)). The stamp holds the digest of the deploy's inputs (lookup C(llamafleet.cluster.deploy_inputs)),
    the host facts the roles plan from (system, CPUs, addresses, default routes, devices and their total memory), one
    fingerprint per file, link and folder where the roles write (C(/etc/llamafleet), HAProxy's files, llamafleet's
    units and drop-ins, C(/usr/local/libexec/llamafleet), its C(/etc/sysctl.d) file, the firewall managers' rules, and
    the folders the deployment record names), and the state of llamafleet's units.
  - The next deploy starts with O(state=check). The host is in sync when the inputs, the facts, every fingerprint and
    every unit's state are as stamped, and the clients' endpoint on the orchestrator answers C(/health) with 200.
    Otherwise RV(differences) says why, naming the path or unit. The deploy skips its roles only when every host is
    in sync.
  - O(state=absent) forgets the stamp. The preflight does it on every host before a deploy or upgrade changes
    anything, so a run that fails half way leaves no stamp behind.
  - The stamp is llamafleet's own memo, not part of what a deploy makes, so writing or removing it reports no change.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
attributes:
  check_mode:
    support: full
    details: Checks as usual; writes and removes nothing.
  diff_mode:
    support: none
options:
  state:
    description: V(check) compares the host with its stamp, V(present) writes the stamp, V(absent) removes it.
    type: str
    choices: [check, present, absent]
    default: check
  inputs:
    description: The digest of the deploy's inputs; required with V(check) and V(present).
    type: str
  paths:
    description: Folders to watch besides the fixed ones and those the deployment record names (the model folder,
      C(llamafleet_stamp_paths)).
    type: list
    elements: path
    default: []
  path:
    description: The stamp's file (root only).
    type: path
    default: /etc/llamafleet/stamp.json
  timeout:
    description: Seconds the C(/health) check waits for an answer.
    type: float
    default: 5
author:
  - llamafleet maintainers (@llamafleet)
"""

EXAMPLES = r"""
- name: Compare each host with the stamp the last whole deploy left on it
  llamafleet.cluster.deploy_stamp:
    state: check
    inputs: "{{ lookup('llamafleet.cluster.deploy_inputs') }}"
  register: stamp
"""

RETURN = r"""
in_sync:
  description: Whether the host is as the stamp says (V(check)); false for the other states.
  returned: always
  type: bool
differences:
  description: Why the host is not in sync, at most a few paths and then how many more.
  returned: always
  type: list
  elements: str
  sample: ["/etc/systemd/system/llamafleet-rpc-server.service changed since the last deploy"]
files:
  description: How many paths the stamp fingerprints.
  returned: always
  type: int
"""

import json
import os
import platform
import urllib.error

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url

from ansible_collections.llamafleet.cluster.plugins.module_utils.atomic_file import read_text, write_json_atomic
from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import DEPLOYMENT_RECORD_PATH, STAMP_PATH
from ansible_collections.llamafleet.cluster.plugins.module_utils.deploy_stamp import (
    UNIT_PROPERTIES,
    build_stamp,
    differences,
    host_facts,
    stamp_roots,
    tree_fingerprints,
    unit_names,
    unit_states,
    watched_roots,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.deployment_record import RecordError, parse
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_probe import collect_devices, read_text_file
from ansible_collections.llamafleet.cluster.plugins.module_utils.systemd_show import show_units


PING_GROUP_RANGE = "/proc/sys/net/ipv4/ping_group_range"


def read_json(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def read_record():
    try:
        return parse(read_text(DEPLOYMENT_RECORD_PATH) or "", DEPLOYMENT_RECORD_PATH)
    except (OSError, RecordError):
        return {}


def health_urls(record):
    """The clients' endpoint's /health where this host is the orchestrator."""
    endpoint = ((record.get("sections") or {}).get("llama_server") or {}).get("api_endpoint")
    return [endpoint.rstrip("/") + "/health"] if endpoint else []


def health_problems(urls, timeout):
    problems = {}
    for url in urls:
        try:
            # the endpoint's own certificate on its own host: liveness is the question here, not who it is
            with open_url(url, timeout=timeout, validate_certs=False) as answer:
                if answer.status != 200:
                    problems[url] = "answered %d" % answer.status
        except urllib.error.HTTPError as exc:
            problems[url] = "answered %d" % exc.code
        except (OSError, ValueError) as exc:
            problems[url] = "no answer (%s)" % getattr(exc, "reason", exc)
    return problems


def current_units(module, names):
    if not names:
        return {}
    try:
        return unit_states(show_units(module.run_command, names, UNIT_PROPERTIES))
    except ValueError as exc:
        module.fail_json(msg=str(exc))


def current_facts(module):
    def run(argv):
        return module.run_command(argv, environ_update={"LC_ALL": "C"})

    ip = module.get_bin_path("ip")
    addresses, routes = "[]", []
    if ip:
        addresses = run([ip, "-j", "addr", "show"])[1]
        routes = [run([ip, "-j", family, "route", "show", "default"])[1] for family in ("-4", "-6")]
    devices = collect_devices(run, module.get_bin_path, read_text_file)["devices"]
    return host_facts(read_text_file("/etc/os-release") or "", platform.machine(), len(os.sched_getaffinity(0)),
                      addresses, routes, devices, read_text_file(PING_GROUP_RANGE) or "")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["check", "present", "absent"], default="check"),
            inputs=dict(type="str"),
            paths=dict(type="list", elements="path", default=[]),
            path=dict(type="path", default=STAMP_PATH),
            timeout=dict(type="float", default=5),
        ),
        required_if=[("state", "check", ("inputs",)), ("state", "present", ("inputs",))],
        supports_check_mode=True,
    )
    params = module.params
    path, state = params["path"], params["state"]
    result = dict(changed=False, in_sync=False, differences=[], files=0)
    if state == "absent":
        if os.path.exists(path) and not module.check_mode:
            os.unlink(path)
        module.exit_json(**result)

    record = read_record()
    stamp = read_json(path) if state == "check" else None
    roots = watched_roots(record, params["paths"])
    if stamp:
        known = set(root for root, names in roots)
        roots += [(root, names) for root, names in stamp_roots(stamp) if root not in known]
    files = tree_fingerprints(roots, skip=[path])
    units = current_units(module, sorted(set(unit_names()) | set((stamp or {}).get("units") or {})))
    facts = current_facts(module)
    urls = health_urls(record)
    result["files"] = len(files)
    if state == "present":
        if not module.check_mode:
            write_json_atomic(path, build_stamp(params["inputs"], facts, files, units, roots, urls), mode=0o600)
        module.exit_json(**result)
    found = differences(stamp, params["inputs"], facts, files, units, health_problems(urls, params["timeout"]))
    result.update(in_sync=not found, differences=found)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
