#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Makes a service's system group, system user and state directory in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: host_user
short_description: Make a service's system group, system user and state directory in one step
version_added: "0.4.0"
description:
  - Makes the system group O(name), the system user O(name) in it (shell O(shell), home O(home) not created by
    C(useradd)), a member of those of O(groups) the host has (added, never taken out of others), and the directory
    O(home) owned by the user and its group with mode O(mode), all in one module run (C(groupadd), C(useradd),
    C(usermod) only where something differs), so a deploy that changes nothing pays one round trip for the three.
  - An existing user keeps its id; its primary group, shell and home are put right.
  - Supports check mode and diff mode. The user and group leave with M(ansible.builtin.user) and
    M(ansible.builtin.group) (the roles' C(_common) C(user_absent.yml)).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  name:
    description: The user's name, and its group's.
    type: str
    required: true
  home:
    description: The user's home and state directory (made with its parents).
    type: path
    required: true
  groups:
    description: Supplementary groups for the user (the device groups of its backend); those the host lacks are
      left out.
    type: list
    elements: str
    default: []
  shell:
    description: The user's shell.
    type: str
    default: /usr/sbin/nologin
  mode:
    description: Mode of O(home), as an octal string.
    type: str
    default: "0750"
author:
  - llamafleet maintainers (@llamafleet)
"""

EXAMPLES = r"""
- name: Create the service user, its group and state directory
  llamafleet.cluster.host_user:
    name: llamafleet-rpc
    home: /var/lib/llamafleet-rpc
    groups: [video, render]
  register: service_user
"""

RETURN = r"""
gid:
  description: The group's id (null in check mode while the group does not exist yet).
  returned: always
  type: int
uid:
  description: The user's id (null in check mode while the user does not exist yet).
  returned: always
  type: int
groups:
  description: The supplementary groups of O(groups) the host has, which the user is a member of.
  returned: always
  type: list
  elements: str
commands:
  description: The command lines run (or, in check mode, that would run).
  returned: always
  type: list
  elements: list
"""

import grp
import os
import pwd

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.host_user import (
    Account,
    account_commands,
    account_state,
    device_groups,
    wanted_state,
)


def read_host(name):
    """(the group's id or None, the user as an Account or None) from the host's name services."""
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        gid = None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return gid, None
    member_of = tuple(sorted(group.gr_name for group in grp.getgrall() if name in group.gr_mem))
    return gid, Account(gid=entry.pw_gid, home=entry.pw_dir, shell=entry.pw_shell, groups=member_of)


def ensure_home(module, params, exists, diffs):
    """The state directory made, then its owner, group and mode put right; True when anything changed."""
    path = params["home"]
    if os.path.lexists(path) and not os.path.isdir(path):
        module.fail_json(msg="%s exists and is not a directory (host_user home)" % path)
    changed = not os.path.isdir(path)
    if changed:
        diffs.append(dict(before_header=path, after_header=path, before={"state": "absent"},
                          after={"state": "directory"}))
        if module.check_mode:
            return True
        os.makedirs(path)
    if not exists:
        # check mode before the user exists: its owner cannot be looked at yet
        return True
    attributes = module.load_file_common_arguments(dict(owner=params["name"], group=params["name"],
                                                        mode=params["mode"]), path=path)
    diff = dict(before={}, after={}, before_header=path, after_header=path)
    changed = module.set_fs_attributes_if_different(attributes, changed, diff)
    if diff["before"] != diff["after"]:
        diffs.append(diff)
    return changed


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            home=dict(type="path", required=True),
            groups=dict(type="list", elements="str", default=[]),
            shell=dict(type="str", default="/usr/sbin/nologin"),
            mode=dict(type="str", default="0750"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    name = params["name"]
    groups = device_groups(params["groups"], [group.gr_name for group in grp.getgrall()])
    gid, account = read_host(name)
    commands = account_commands(name, params["home"], params["shell"], groups, gid, account)
    diffs = []
    if commands:
        diffs.append(dict(before_header=name, after_header=name, before=account_state(name, gid, account),
                          after=wanted_state(name, params["home"], params["shell"], groups, account)))
        if not module.check_mode:
            for line in commands:
                rc, out, err = module.run_command(line)
                if rc != 0:
                    module.fail_json(msg="%s failed (rc %d): %s" % (" ".join(line), rc, (err or out).strip()),
                                     commands=commands)
            gid, account = read_host(name)
    home_changed = ensure_home(module, params, account is not None, diffs)
    uid = pwd.getpwnam(name).pw_uid if account is not None else None
    result = dict(changed=bool(commands) or home_changed, gid=gid, uid=uid, groups=groups, commands=commands)
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
