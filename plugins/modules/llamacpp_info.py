#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llamacpp_info
short_description: Detect the binaries, flags and version of a llama.cpp build
version_added: "0.1.0"
description:
  - Finds llama-server and the RPC server (V(ggml-rpc-server), or the older V(llama-rpc-server) and
    V(rpc-server)) in a build's C(bin) directory, runs them with C(--help) and C(--version), and
    returns which flags they have.
  - Flags are detected from the build's own help text, never assumed from a version number, so the
    command lines rendered by M(llamafleet.cluster.rpc_plan) only use flags the build has.
  - Read-only.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.read_only
options:
  prefix:
    description: The build's install prefix; the binaries are looked for in its C(bin) directory.
    type: path
  bin_dir:
    description: Directory holding the binaries, instead of O(prefix) (e.g. a CMake C(build/bin)).
    type: path
  require:
    description:
      - Binaries that must be present; the task fails naming what is missing.
    type: list
    elements: str
    choices: [llama_server, rpc_server]
    default: []
"""

EXAMPLES = r"""
- name: Inspect the build
  llamafleet.cluster.llamacpp_info:
    prefix: /opt/llamafleet/llama.cpp/b6000-cuda
    require: [rpc_server]
  register: __llamacpp

- name: Fail early when the build cannot do RPC
  ansible.builtin.assert:
    that: __llamacpp.features.llama_server.rpc
    fail_msg: llama-server was built without -DGGML_RPC=ON
"""

RETURN = r"""
bin_dir:
  description: The directory searched.
  returned: always
  type: str
llama_server:
  description: File name of llama-server in RV(bin_dir), or null when the build has none.
  returned: always
  type: str
  sample: llama-server
llama_server_path:
  description: Path of llama-server, or null.
  returned: always
  type: str
rpc_server:
  description: File name of the RPC server (V(ggml-rpc-server), V(llama-rpc-server) or V(rpc-server)), or null.
  returned: always
  type: str
  sample: ggml-rpc-server
rpc_server_path:
  description: Path of the RPC server, or null.
  returned: always
  type: str
features:
  description: Flag support, from the C(--help) texts.
  returned: always
  type: dict
  contains:
    llama_server:
      description: Feature -> bool for rpc, tensor_split, split_mode, n_gpu_layers, device, fit, load_mode,
        no_mmap, mlock, metrics, api_key_file, ctx_size, parallel, kv_unified, no_kv_unified, chat_template,
        cache_type_k, cache_type_v, host, port, log_verbosity, list_devices.
      type: dict
    rpc_server:
      description: Feature -> bool for host, port, threads, device, cache, mem.
      type: dict
    version:
      description: Parsed C(llama-server --version).
      type: dict
  sample:
    llama_server: {rpc: true, tensor_split: true, fit: true, load_mode: true, no_mmap: false, mlock: false}
    rpc_server: {host: true, port: true, threads: true, device: true, cache: true, mem: false}
    version: {version: 0.5.0-dev, build: 0, commit: null, compiler: GNU 12.2.0, target: Linux x86_64}
version:
  description: llama.cpp version string (V(0.5.0-dev)), or the build number on older builds; null if unknown.
  returned: always
  type: str
commit:
  description: The commit the build was made from, or null when the build did not record it.
  returned: always
  type: str
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llamafleet.cluster.plugins.module_utils.llamacpp_host import (
    BuildInspectError,
    inspect_bin_dir,
)


def run_module(module: AnsibleModule) -> dict:
    bin_dir = module.params["bin_dir"] or os.path.join(module.params["prefix"], "bin")

    def run(argv: list) -> tuple:
        return module.run_command(argv, environ_update={"LC_ALL": "C"})

    try:
        found = inspect_bin_dir(bin_dir, run, module.params["require"])
    except BuildInspectError as exc:
        module.fail_json(msg=str(exc))
    return dict(found, changed=False)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            prefix=dict(type="path"),
            bin_dir=dict(type="path"),
            require=dict(type="list", elements="str", choices=["llama_server", "rpc_server"], default=[]),
        ),
        required_one_of=[("prefix", "bin_dir")],
        mutually_exclusive=[("prefix", "bin_dir")],
        supports_check_mode=True,
    )
    module.exit_json(**run_module(module))


if __name__ == "__main__":
    main()
