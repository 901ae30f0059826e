#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llamacpp_source_facts
short_description: Read the RPC weight-cache threshold and RPC protocol version from a llama.cpp source tree
version_added: "0.1.0"
description:
  - Reads C(HASH_THRESHOLD) from C(ggml/src/ggml-rpc/ggml-rpc.cpp) (weight tensors larger than this are announced
    by hash first, so a worker's rpc-server cache can serve them) and C(RPC_PROTO_MAJOR_VERSION) from
    C(ggml/include/ggml-rpc.h).
  - The C(llamacpp_build) role runs it on the builder before compiling and records both in the build's
    C(BUILDINFO.json), so cache seeding and the RPC HELLO check follow the llama.cpp version actually built.
  - A value the source does not define is returned as V(null); a definition the module cannot read fails,
    naming the file, rather than guessing.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
options:
  src:
    description: The llama.cpp source tree (the directory holding its top C(CMakeLists.txt)).
    type: path
    required: true
attributes:
  check_mode:
    support: full
    details: Read-only.
  diff_mode:
    support: none
  platform:
    platforms: posix
  idempotent:
    description: Reads files only.
    support: full
seealso:
  - module: llamafleet.cluster.rpc_cache_seed
  - module: llamafleet.cluster.rpc_hello
"""

EXAMPLES = r"""
- name: Read the RPC constants of the unpacked source
  llamafleet.cluster.llamacpp_source_facts:
    src: /var/cache/llamafleet/build/src-0c1e57098bba-cpu-cc8d0a3f18
  register: source
"""

RETURN = r"""
rpc_hash_threshold:
  description: HASH_THRESHOLD in bytes, or V(null) when the source has no RPC weight cache.
  returned: success
  type: int
  sample: 10485760
rpc_protocol:
  description: RPC_PROTO_MAJOR_VERSION, or V(null) when the source does not define it.
  returned: success
  type: int
  sample: 7
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.llamacpp_source import (
    SourceFactsError,
    read_source_facts,
)


def main() -> None:
    module = AnsibleModule(argument_spec=dict(src=dict(type="path", required=True)), supports_check_mode=True)
    try:
        facts = read_source_facts(module.params["src"])
    except SourceFactsError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, **facts)


if __name__ == "__main__":
    main()
