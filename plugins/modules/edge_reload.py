#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Reloads HAProxy and fails when it did not load the new configuration."""

from __future__ import annotations

DOCUMENTATION = r"""
module: edge_reload
short_description: Reload HAProxy and check that it loaded the new configuration
version_added: "0.4.0"
description:
  - Reloads the edge's C(haproxy.service) (C(systemctl reload)), then reads the HAProxy master's process list on its
    master CLI (C(show proc)) until the reload has finished, and fails when HAProxy reports it failed.
  - C(systemctl reload) returns as soon as the master has its signal. A configuration that passes C(haproxy -c) can
    still fail to load (a port another program took, a file the master cannot open); HAProxy then logs
    C(Loading failure!) and its old workers keep serving the previous configuration. Without this check a deploy
    would report success while the old key, certificate or ports stay in force.
  - The failure names the unit and quotes the end of its journal. Where the master CLI socket does not exist (the
    unit's C(EXTRAOPTS) changed), the module reloads and warns that the outcome could not be read.
  - Supports check mode (reports the reload it would do).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
attributes:
  check_mode:
    support: full
    details: Reports a change and reloads nothing.
  diff_mode:
    support: none
options:
  unit:
    description: The HAProxy unit.
    type: str
    default: haproxy.service
  master_socket:
    description: The HAProxy master CLI socket (Debian's unit starts HAProxy with C(-S /run/haproxy-master.sock)).
    type: path
    default: /run/haproxy-master.sock
  timeout:
    description: Seconds to wait for the master to finish the reload.
    type: int
    default: 30
author:
  - llamafleet maintainers (@llamafleet)
"""

EXAMPLES = r"""
- name: Reload the edge
  llamafleet.cluster.edge_reload:
    unit: haproxy.service
"""

RETURN = r"""
reloads:
  description: The master's reload count after this reload (C(show proc)), or null where the master CLI was not
    there to read.
  returned: success
  type: int
failed_reloads:
  description: The master's count of failed reloads after this reload (HAProxy 2.6 counts those since the last
    reload that loaded), or null where it could not be read.
  returned: success
  type: int
"""

import os
import re
import socket
import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.systemd_show import journal_tail_argv

# The master's line of `show proc`, for example "18047  master  1 [failed: 1]  0d00h00m07s  2.6.12-1+deb12u3".
MASTER_LINE = re.compile(r"^\s*\d+\s+master\s+(\d+)\s+\[failed:\s*(\d+)\]", re.MULTILINE)


def parse_show_proc(text):
    """The master's (reloads, failed reloads) from the master CLI's ``show proc``; ValueError when absent."""
    found = MASTER_LINE.search(text or "")
    if not found:
        raise ValueError("no master line in the master CLI's show proc: %r" % (text or "")[:200])
    return int(found.group(1)), int(found.group(2))


def reload_outcome(before, after):
    """None while the reload has not finished (the count has not moved), else True when it loaded, False when the
    master counted it failed. A reload that loads sets HAProxy 2.6's failed count back to 0."""
    if after[0] <= before[0]:
        return None
    return after[1] <= before[1]


def show_proc(path, timeout=2.0):
    """``show proc`` on the master CLI; OSError when the master does not answer (it re-executes while it reloads)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(path)
        conn.sendall(b"show proc\n")
        conn.shutdown(socket.SHUT_WR)  # one command: the CLI answers, ends with an empty line, and closes
        answer = bytearray()
        while not answer.endswith(b"\n\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    return parse_show_proc(answer.decode("utf-8", "replace"))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str", default="haproxy.service"),
            master_socket=dict(type="path", default="/run/haproxy-master.sock"),
            timeout=dict(type="int", default=30),
        ),
        supports_check_mode=True,
    )
    unit, path = module.params["unit"], module.params["master_socket"]
    if module.check_mode:
        module.exit_json(changed=True, reloads=None, failed_reloads=None)

    def journal():
        return module.run_command(journal_tail_argv(unit))[1].strip()

    before = None
    if os.path.exists(path):
        try:
            before = show_proc(path)
        except (OSError, ValueError) as exc:
            module.warn("could not read %s's master CLI (%s) before the reload: %s" % (unit, path, exc))
    rc, out, err = module.run_command(["systemctl", "reload", "--", unit])
    if rc != 0:
        module.fail_json(msg="%s did not reload: %s\n%s" % (unit, (err or out).strip(), journal()))
    if before is None:
        module.warn("%s reloaded, but whether HAProxy loaded the new configuration could not be read: no master CLI "
                    "at %s" % (unit, path))
        module.exit_json(changed=True, reloads=None, failed_reloads=None)
    deadline = time.monotonic() + module.params["timeout"]
    after, outcome = before, None
    while outcome is None:
        time.sleep(0.2)
        try:
            after = show_proc(path)
            outcome = reload_outcome(before, after)
        except (OSError, ValueError):
            pass  # the master re-executes itself while it reloads: its CLI is away for a moment
        if outcome is None and time.monotonic() > deadline:
            module.fail_json(msg="%s: HAProxy did not finish the reload within %d s (timeout); its master reports "
                                 "%d reloads, %d failed\n%s" % (unit, module.params["timeout"], after[0], after[1],
                                                                journal()))
    if not outcome:
        module.fail_json(msg="%s: HAProxy could not load the new configuration (Loading failure!) and keeps serving "
                             "the previous one; its journal:\n%s" % (unit, journal()),
                         reloads=after[0], failed_reloads=after[1])
    module.exit_json(changed=True, reloads=after[0], failed_reloads=after[1])


if __name__ == "__main__":
    main()
