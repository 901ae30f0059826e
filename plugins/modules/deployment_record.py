#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: deployment_record
short_description: Write one role's section of the host's llamafleet deployment record
version_added: "0.3.0"
description:
  - The deployment record (C(/etc/llamafleet/deployment.json)) says what the roles made on a host, that is its
    units, ports, paths, users, build, plan and API endpoint. The C(llamafleet) CLI, the benchmark and
    C(teardown.yml) read it instead of assuming the roles' defaults.
  - Each role owns one O(section) and writes it with the values it used. The record carries no timestamp, so
    a run that changes nothing writes nothing.
  - A record written by a newer llamafleet (a higher schema) is refused before anything is changed.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  section:
    description: The role's section.
    type: str
    required: true
    choices: [llamacpp_build, model, rpc_server, llama_server]
  data:
    description: What the role made (JSON-compatible); required with O(state=present).
    type: dict
  state:
    description: V(present) sets the section to O(data); V(absent) removes it (the file goes when no section is left).
    type: str
    choices: [present, absent]
    default: present
  path:
    description: The record's file.
    type: path
    default: /etc/llamafleet/deployment.json
  collection_version:
    description: The collection version to write into the record.
    type: str
    default: unknown
"""

EXAMPLES = r"""
- name: Record what the rpc_server role made
  llamafleet.cluster.deployment_record:
    section: rpc_server
    data:
      user: llamafleet-rpc
      units: [llamafleet-rpc-server.service, llamafleet-rpc-guard.service]
      endpoints: ["10.0.0.12:50052"]
"""

RETURN = r"""
record:
  description: The record after the change (in check mode, as it would be).
  returned: always
  type: dict
  sample: {"schema": 1, "collection_version": "0.3.0", "sections": {"rpc_server": {"user": "llamafleet-rpc"}}}
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.atomic_file import read_text
from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import DEPLOYMENT_RECORD_PATH
from ansible_collections.llamafleet.cluster.plugins.module_utils.deployment_record import (
    SECTIONS,
    RecordError,
    parse,
    render,
    with_section,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.llama_server_plan import write_text_file


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            section=dict(type="str", required=True, choices=list(SECTIONS)),
            data=dict(type="dict"),
            state=dict(type="str", choices=["present", "absent"], default="present"),
            path=dict(type="path", default=DEPLOYMENT_RECORD_PATH),
            collection_version=dict(type="str", default="unknown"),
        ),
        required_if=[("state", "present", ("data",))],
        supports_check_mode=True,
    )
    path, section = module.params["path"], module.params["section"]
    before = read_text(path)
    try:
        record = with_section(parse(before or "", path), section,
                              module.params["data"] if module.params["state"] == "present" else None,
                              module.params["collection_version"])
    except RecordError as exc:
        module.fail_json(msg=str(exc))
    result = {"changed": False, "record": record}
    if not record["sections"]:
        if before is not None:
            result.update(changed=True, diff={"before": before, "after": "", "before_header": path,
                                              "after_header": "%s (absent)" % path})
            if not module.check_mode:
                os.unlink(path)
        module.exit_json(**result)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory) and not module.check_mode:
        os.makedirs(directory, mode=0o755)
    write_text_file(module, path, render(record), result, before)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
