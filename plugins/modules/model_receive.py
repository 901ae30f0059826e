#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_receive
short_description: Copy a verified model file from the controller's cache to a host, resumably, in one stream
version_added: "0.3.0"
description:
  - The action plugin of the same name (on the controller) asks the host whether O(dest) holds the file with its
    pinned O(sha256); if not, it streams O(src) through the connection (ssh, in a session of its own without
    compression, or local; other connections and a password to type get each piece put as a file and fed in)
    straight into the host's C(.part) file, from the offset that file is good to, hashing it as it is written, and
    shows progress (bytes done and total, MB/s) on the controller.
    The file is renamed into place only once all of it has the pinned sha256, with the same marker
    M(llamafleet.cluster.model_fetch) leaves, so either module finds it verified later; a whole file with another
    sha256 is removed and the task fails.
  - A run that stops midway resumes after the last whole piece written; the pieces already there are read once
    and checked against the sha256 each had when it was written, and from the first that differs on, the file
    is sent again.
  - The disk space is checked before anything is sent.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
  - llamafleet.cluster.controller_send
options:
  src:
    description: The verified file on the controller (the action plugin's).
    type: path
  dest:
    description: The file's path on the host.
    type: path
    required: true
  sha256:
    description: Its pinned sha256.
    type: str
    required: true
  size:
    description: Its size in bytes (set by the action plugin).
    type: int
  piece_mib:
    description: The size of the pieces whose sha256 the host records; a stopped run sends again at most one piece.
    type: int
    default: 256
  owner:
    description: Owner of the file.
    type: str
  group:
    description: Its group.
    type: str
  mode:
    description: Its mode.
    type: raw
    default: "0644"
  label:
    description: The variable the disk-space error names.
    type: str
    default: model_dir
  action:
    description: The host-side step the action plugin asks for (V(inspect), V(publish)).
    type: str
    choices: [inspect, publish]
seealso:
  - module: llamafleet.cluster.model_fetch
"""

EXAMPLES = r"""
- name: Copy the model from the controller's cache to the orchestrator
  llamafleet.cluster.model_receive:
    src: ~/.cache/llamafleet/models/gemma/gemma-3-270m-q4_k_m.gguf
    dest: /var/lib/llamafleet/models/gemma/gemma-3-270m-q4_k_m.gguf
    sha256: "{{ model_files[0].sha256 }}"
"""

RETURN = r"""
sent_bytes:
  description: Bytes sent (or, in check mode, that would be).
  returned: success
  type: int
seconds:
  description: Time spent sending.
  returned: success
  type: float
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.cache_share import (
    RECEIVE_OPTIONS,
    publish_received,
    receive_state,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.rpc_cache import CacheError


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            RECEIVE_OPTIONS,
            size=dict(type="int"),
            action=dict(type="str", choices=["inspect", "publish"]),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if not params["action"] or params["size"] is None:
        module.fail_json(msg="model_receive runs through its action plugin (on the controller), which sets action")
    piece = params["piece_mib"] << 20
    try:
        if params["action"] == "inspect":
            result = receive_state(params["dest"], params["size"], params["sha256"].lower(), piece, module.check_mode)
        else:
            result = publish_received(params["dest"], params["size"], params["sha256"].lower(), piece)
    except CacheError as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg="%s: %s" % (exc.filename or params["dest"], exc.strerror or exc))
    changed = bool(result.get("published"))
    if result.get("verified") or result.get("published"):
        file_args = module.load_file_common_arguments(
            {"path": params["dest"], "owner": params["owner"], "group": params["group"], "mode": params["mode"]})
        changed = module.set_fs_attributes_if_different(file_args, changed)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
