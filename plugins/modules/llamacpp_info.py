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
from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import RPC_SERVER_BINARIES
from ansible_collections.llamafleet.cluster.plugins.module_utils.llama_flags import (
    LLAMA_SERVER_BINARIES,
    FlagError,
    detect_features,
    pick_binary,
)


def run_module(module: AnsibleModule) -> dict:
    bin_dir = module.params["bin_dir"] or os.path.join(module.params["prefix"], "bin")
    if not os.path.isdir(bin_dir):
        module.fail_json(msg="bin_dir %s is not a directory (build llama.cpp first)" % bin_dir)
    names = [n for n in os.listdir(bin_dir) if os.access(os.path.join(bin_dir, n), os.X_OK)]
    server_name = pick_binary(names, LLAMA_SERVER_BINARIES)
    rpc_name = pick_binary(names, RPC_SERVER_BINARIES)
    missing = [what for what, found in (("llama_server", server_name), ("rpc_server", rpc_name))
               if what in module.params["require"] and not found]
    if missing:
        module.fail_json(msg="%s has no %s (looked for %s)" % (
            bin_dir, " and no ".join(missing),
            ", ".join((LLAMA_SERVER_BINARIES if m == "llama_server" else RPC_SERVER_BINARIES)[0] for m in missing)))

    def output(path: str, flag: str) -> str:
        # rpc-server prints its usage to stderr; llama-server --version prints to stderr too.
        rc, out, err = module.run_command([path, flag], environ_update={"LC_ALL": "C"})
        if rc != 0:
            module.fail_json(msg="%s %s failed (rc=%d): %s" % (path, flag, rc, (err or out).strip()[-500:]))
        return out + err

    server_path = os.path.join(bin_dir, server_name) if server_name else None
    rpc_path = os.path.join(bin_dir, rpc_name) if rpc_name else None
    try:
        features = detect_features(
            server_help=output(server_path, "--help") if server_path else None,
            rpc_help=output(rpc_path, "--help") if rpc_path else None,
            version_text=output(server_path, "--version") if server_path else None,
        )
    except FlagError as exc:
        module.fail_json(msg=str(exc))
    version = features["version"] or {}
    return {
        "changed": False,
        "bin_dir": bin_dir,
        "llama_server": server_name,
        "llama_server_path": server_path,
        "rpc_server": rpc_name,
        "rpc_server_path": rpc_path,
        "features": features,
        "version": version.get("version") or (str(version["build"]) if version.get("build") else None),
        "commit": version.get("commit"),
    }


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
