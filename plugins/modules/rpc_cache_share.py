#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rpc_cache_share
short_description: Put a worker's share of the model into its rpc-server weight cache, sent from the controller
version_added: "0.3.0"
description:
  - Run on the controller, the action plugin of the same name works out the worker's share of the model (the
    tensors over rpc-server's hash threshold that the plan puts on its devices, and with O(degraded_ahead)
    those the degraded plans would), asks the worker which of their cache files it holds verified, checks the
    disk space for the rest, and sends each missing tensor, cut from the controller's verified copy of the
    model, as a file of its own. Progress (bytes done and total, MB/s) is shown on the controller as it goes.
  - On the worker each received file is checked against the sha256 the controller's manifest took from the
    verified whole model (and, given O(worker_hasher), its FNV-1a 64 name), then renamed to its 16-hex cache name,
    owned by O(owner), mode C(0600), in a C(0700) directory. A run that stops midway resumes (verified files
    are kept, a half-sent one is sent again).
  - O(state=absent_others) removes the cache files that no share kept needs (after the new plan serves).
    O(state=checked) fails, naming the tensors, when the cache lacks any of the share.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
  - llamafleet.cluster.controller_send
options:
  state:
    description:
      - V(present) sends what the share lacks; V(checked) only checks the share is there; V(absent_others) prunes
        the files no share needs.
    type: str
    choices: [present, checked, absent_others]
    default: present
  host:
    description: The worker's inventory name, as the plan names it (the action plugin's).
    type: str
  model:
    description: The verified model files on the controller, in shard order (the action plugin's).
    type: list
    elements: path
  sha256:
    description: Their pinned sha256, in the same order (the action plugin's).
    type: list
    elements: str
  threshold:
    description: rpc-server's hash threshold in bytes; tensors strictly larger are cached (the action plugin's).
    type: int
    default: 10485760
  hasher:
    description: The C(llamafleet-fnv1a64) helper on the controller (the action plugin's); else found or compiled.
    type: path
  plan:
    description: The plan (RV(llamafleet.cluster.rpc_plan#module:plan)), its C(rpc) and C(tensor_split).
    type: dict
  workers:
    description: The workers' endpoints the plan was made over, each V({host, address, port, devices}).
    type: list
    elements: dict
  degraded:
    description: The degraded plans (RV(llamafleet.cluster.rpc_plan#module:degraded)).
    type: list
    elements: dict
    default: []
  degraded_ahead:
    description: Send the tensors the degraded plans would give this worker too, so that a switch sends no weights.
    type: bool
    default: true
  cache_dir:
    description: The rpc-server cache directory on the worker.
    type: path
    required: true
  owner:
    description: The rpc-server user, owner of the directory and its files.
    type: str
  group:
    description: Their group.
    type: str
  worker_hasher:
    description: The C(llamafleet-fnv1a64) helper on the worker; when given, each received file's cache name is checked.
    type: path
  label:
    description: The variable messages name for lowering the share (the disk-space error).
    type: str
    default: llama_server_share_degraded
  action:
    description: The worker-side step the action plugin asks for (V(inspect), V(install), V(prune)).
    type: str
    choices: [inspect, install, prune]
  entries:
    description: The worker-side cache files of the share, each V({name, size, sha256, tensors}).
    type: list
    elements: dict
  files:
    description: The worker-side received files, each V({path, name, size, sha256, tensors}).
    type: list
    elements: dict
  keep:
    description: The worker-side cache names V(prune) keeps.
    type: list
    elements: str
seealso:
  - module: llamafleet.cluster.rpc_cache_seed
  - module: llamafleet.cluster.rpc_plan
"""

EXAMPLES = r"""
- name: Send each worker its share of the model
  llamafleet.cluster.rpc_cache_share:
    host: "{{ item }}"
    model: "{{ model_info.controller_paths }}"
    sha256: "{{ model_info.sha256 }}"
    threshold: 10485760
    plan: "{{ __plan.plan }}"
    workers: "{{ workers }}"
    degraded: "{{ __plan.degraded }}"
    cache_dir: /var/lib/llamafleet-rpc/cache/rpc
    owner: llamafleet-rpc
    group: llamafleet-rpc
  delegate_to: "{{ item }}"
  loop: "{{ groups['llamafleet_workers'] }}"
"""

RETURN = r"""
share:
  description: The share's cache files, by name, with their tensors.
  returned: success
  type: dict
share_bytes:
  description: Bytes of the whole share.
  returned: success
  type: int
present:
  description: Cache files that were there, verified.
  returned: success
  type: list
  elements: str
settled:
  description: The whole share was there, verified before, with nothing to fix, so the same task without check
    mode would change nothing (always false with O(state=absent_others)).
  returned: success
  type: bool
sent:
  description: Cache files sent (or, in check mode, that would be).
  returned: success
  type: list
  elements: str
sent_bytes:
  description: Bytes sent (or that would be).
  returned: success
  type: int
seconds:
  description: Time spent sending.
  returned: success
  type: float
pruned_files:
  description: With O(state=absent_others), the files removed.
  returned: success
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.cache_share import (
    SHARE_OPTIONS,
    inspect_share,
    install_files,
    prune_share,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.fnv import HashError
from ansible_collections.llamafleet.cluster.plugins.module_utils.rpc_cache import CacheError, _resolve_id


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            SHARE_OPTIONS,
            action=dict(type="str", choices=["inspect", "install", "prune"]),
            entries=dict(type="list", elements="dict"),
            files=dict(type="list", elements="dict"),
            keep=dict(type="list", elements="str", no_log=False),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if not params["action"]:
        module.fail_json(msg="rpc_cache_share runs through its action plugin (on the controller), which sets action")
    try:
        uid = _resolve_id("user", params["owner"])
        gid = _resolve_id("group", params["group"])
        if params["action"] == "inspect":
            result = inspect_share(params["cache_dir"], params["entries"] or [], uid, gid, module.check_mode)
        elif params["action"] == "install":
            result = install_files(params["cache_dir"], params["files"] or [], uid, gid, params["worker_hasher"],
                                   module.check_mode)
        else:
            result = prune_share(params["cache_dir"], params["keep"] or [], uid, gid, module.check_mode)
    except (CacheError, HashError) as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg="%s: %s" % (exc.filename or params["cache_dir"], exc.strerror or exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
