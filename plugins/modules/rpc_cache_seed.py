#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rpc_cache_seed
short_description: Fill a llama.cpp rpc-server weight cache from the worker's own copy of the model
version_added: "0.1.0"
description:
  - When llama-server uploads a weight tensor larger than 10 MiB to an rpc-server, it first sends the
    FNV-1a 64 hash of the tensor's bytes. An rpc-server started with C(-c) that has a file named after
    that hash (16 lowercase hex digits) in its cache directory loads the tensor from disk instead of
    receiving it over the network.
  - This module reads the GGUF tensor table of a model the worker already holds, hashes every tensor
    larger than O(threshold), and writes each missing cache file atomically (a temporary file in the
    cache directory, its content hashed again, then renamed into place).
  - rpc-server never checks a cache file's size or content, so a file of the wrong size or content is
    detected here (by hashing it) and replaced, never kept.
  - The cache directory is created with mode C(0700) and, with O(owner)/O(group), owned by the rpc-server
    service user, since whoever can write it can change the weights.
  - With O(prune), cache files that neither O(model) nor any of O(keep_models) needs are deleted.
  - Hashing uses the C(llamafleet-fnv1a64) helper built by the C(llamacpp_build) role (about 850 MB/s per
    core); without it a pure-Python fallback gives the same hashes 50 to 100 times slower, with a warning.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  model:
    description:
      - The GGUF file, or every shard of a split model in order. A single shard named
        C(NAME-00001-of-0000N.gguf) stands for all of its shards.
    type: list
    elements: path
    required: true
  cache_dir:
    description:
      - The rpc-server cache directory itself, i.e. C($LLAMA_CACHE/rpc) of the service
        (else C($XDG_CACHE_HOME/llama.cpp/rpc), else C(~/.cache/llama.cpp/rpc)). Created if missing.
    type: path
    required: true
  threshold:
    description:
      - Tensors strictly larger than this many bytes are cached. llama.cpp's HASH_THRESHOLD is 10 MiB;
        smaller tensors are always sent over the network, so caching them is useless.
    type: int
    default: 10485760
  hasher:
    description:
      - Path of the C(llamafleet-fnv1a64) helper. When omitted, C($LLAMAFLEET_FNV_HELPER) and C(PATH)
        are searched. When it cannot be found, hashing falls back to Python with a warning.
    type: path
  jobs:
    description: Tensors the helper hashes in parallel; V(0) means one per CPU.
    type: int
    default: 0
  owner:
    description: User (name or uid) that owns the cache directory and the files written; the rpc-server user.
    type: str
  group:
    description: Group (name or gid) of the cache directory and the files written.
    type: str
  prune:
    description:
      - Delete cache files (16 hex digit names) that neither O(model) nor O(keep_models) needs,
        and temporary files an interrupted run left behind more than an hour ago.
    type: bool
    default: true
  keep_models:
    description:
      - Other GGUF files (or first shards) whose cache files O(prune) must keep, e.g. models this worker
        serves under another deployment. Their hashes are remembered in C(.llamafleet-index.json) in the
        cache directory, so unchanged files are not hashed again.
    type: list
    elements: path
    default: []
notes:
  - Every run hashes the model's large tensors and every cache file it keeps, so its cost is about
    twice the size of those tensors read from disk.
seealso:
  - module: llamafleet.cluster.rpc_hello
"""

EXAMPLES = r"""
- name: Seed the worker's rpc-server cache from its local model copy
  llamafleet.cluster.rpc_cache_seed:
    model: /var/lib/llamafleet/models/qwen2.5-7b-instruct-q4_k_m.gguf
    cache_dir: /var/cache/llamafleet/rpc-server/rpc
    hasher: /opt/llamafleet/llama.cpp/current/bin/llamafleet-fnv1a64
    owner: llamafleet-rpc
    group: llamafleet-rpc

- name: Seed a split model and keep the cache of the model served before it
  llamafleet.cluster.rpc_cache_seed:
    model:
      - /models/big-00001-of-00002.gguf
      - /models/big-00002-of-00002.gguf
    cache_dir: /var/cache/llamafleet/rpc-server/rpc
    keep_models:
      - /models/previous.gguf
  register: seeded
"""

RETURN = r"""
seeded_files:
  description: Cache files written (or, in check mode, that would be), replaced ones included.
  returned: always
  type: list
  elements: str
  sample: ["4ed75f02dd9d6910", "48cd69062f018d84"]
seeded_bytes:
  description: Bytes written to the cache (or that would be).
  returned: always
  type: int
  sample: 318767104
skipped_files:
  description: Cache files already present with the right size and content.
  returned: always
  type: list
  elements: str
replaced_files:
  description: Cache files that existed with a wrong size or content, and were (or would be) rewritten.
  returned: always
  type: list
  elements: str
pruned_files:
  description: Files deleted by O(prune) (or that would be).
  returned: always
  type: list
  elements: str
pruned_bytes:
  description: Bytes freed by O(prune) (or that would be).
  returned: always
  type: int
tensors_over_threshold:
  description: Number of the model's tensors larger than O(threshold).
  returned: always
  type: int
  sample: 14
hashes:
  description: Cache file name (FNV-1a 64 hash) of each tensor larger than O(threshold), by tensor name.
  returned: always
  type: dict
  sample: {"blk.0.ffn_up.weight": "36d5ebf95c07e3dc"}
hasher:
  description: The helper used, or V(python) for the fallback.
  returned: always
  type: str
  sample: /opt/llamafleet/llama.cpp/current/bin/llamafleet-fnv1a64
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import RPC_HASH_THRESHOLD
from ansible_collections.llamafleet.cluster.plugins.module_utils.fnv import HashError
from ansible_collections.llamafleet.cluster.plugins.module_utils.gguf import GGUFError
from ansible_collections.llamafleet.cluster.plugins.module_utils.rpc_cache import CacheError, seed_cache


def run(module: AnsibleModule) -> None:
    """Seed the cache as the parameters say and exit the module."""
    params = module.params
    try:
        result = seed_cache(
            params["model"],
            params["cache_dir"],
            threshold=params["threshold"],
            helper=params["hasher"],
            owner=params["owner"],
            group=params["group"],
            prune=params["prune"],
            keep_models=[[path] for path in params["keep_models"]],
            check_mode=module.check_mode,
            jobs=params["jobs"],
        )
    except (CacheError, GGUFError, HashError) as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg="%s: %s" % (exc.filename or params["cache_dir"], exc.strerror or exc))
    output = result.as_dict()
    for warning in output.pop("warnings"):
        module.warn(warning)
    diff = output.pop("diff")
    if module._diff:
        output["diff"] = diff
    module.exit_json(**output)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            model=dict(type="list", elements="path", required=True),
            cache_dir=dict(type="path", required=True),
            threshold=dict(type="int", default=RPC_HASH_THRESHOLD),
            hasher=dict(type="path"),
            jobs=dict(type="int", default=0),
            owner=dict(type="str"),
            group=dict(type="str"),
            prune=dict(type="bool", default=True),
            keep_models=dict(type="list", elements="path", default=[]),
        ),
        supports_check_mode=True,
    )
    run(module)


if __name__ == "__main__":
    main()
