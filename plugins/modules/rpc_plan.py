#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rpc_plan
short_description: Plan the layer split of a llama.cpp RPC cluster and render its llama-server
version_added: "0.1.0"
description:
  - Plans where llama-server puts each layer of a model over the RPC workers and the orchestrator's own
    GPUs, in exactly the device order llama.cpp uses (RPC devices in C(--rpc) order first, then local
    GPUs), proportional to each device's usable memory and never more than a device can hold.
  - Emits C(--tensor-split) as integer layer counts, which llama.cpp maps back to exactly the planned
    layer ranges.
  - Renders the llama-server argv from the plan and the build's detected flags
    (M(llamafleet.cluster.llamacpp_info)), and a hardened systemd unit, written to O(unit_path) only
    when its content differs.
  - Runs on the orchestrator, where the model file is.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
options:
  workers:
    description:
      - rpc-server endpoints in C(--rpc) order, each V({host, address, port, devices}) (other keys are ignored).
      - C(host) is the inventory name (for messages), C(address) the IPv4 address the rpc-server listens on
        (default the host), C(port) its port (default 50052), C(devices) the devices it serves, in order
        (RV(llamafleet.cluster.gpu_facts#module:rpc_devices)).
    type: list
    elements: dict
    default: []
  orchestrator:
    description: The llama-server host, V({host, devices}); its GPU devices are used after the RPC devices.
    type: dict
    default: {}
  model:
    description: GGUF file(s) of the model on this host (the first shard of a split model is enough).
    type: list
    elements: path
  model_facts:
    description:
      - Model facts as C(gguf.model_facts) returns them; when given, the planner uses them instead of
        reading O(model) (which is still needed to render the command line).
    type: dict
  ctx_size:
    description: Total context (llama-server C(-c)); 0 uses the model's training context.
    type: int
    default: 0
  n_parallel:
    description: Server slots (C(-np)).
    type: int
    default: 1
  cache_type_k:
    description: KV cache type for K (C(-ctk)).
    type: str
    aliases: [cache_type]
    default: f16
    choices: [f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1]
  cache_type_v:
    description: KV cache type for V (C(-ctv)); defaults to O(cache_type_k).
    type: str
    choices: [f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1]
  kv_unified:
    description: Whether llama-server runs with a unified KV cache (C(--kv-unified)).
    type: bool
    default: false
  compute_mib:
    description: Compute-buffer margin per device, MiB.
    type: int
    default: 512
    aliases: [compute_margin_mib]
  tensor_split:
    description:
      - Manual split ratios, one per device in llama.cpp's order. The plan then only checks that they fit.
    type: list
    elements: float
  features:
    description:
      - The build's features, RV(llamafleet.cluster.llamacpp_info#module:features) (or its C(llama_server) part).
        Required to render argv and unit.
    type: dict
  binary:
    description: Absolute path of llama-server on this host. Without it only the plan is returned.
    type: path
  server:
    description: llama-server options.
    type: dict
    default: {}
    suboptions:
      host:
        description: Address llama-server listens on.
        type: str
        default: 127.0.0.1
      port:
        description: Port llama-server listens on.
        type: int
        default: 8080
      metrics:
        description: Enable C(/metrics).
        type: bool
        default: false
      api_key_file:
        description: File with the API keys.
        type: path
      chat_template:
        description: Built-in chat template name (e.g. V(gemma)) or Jinja template.
        type: str
      load_mode:
        description: How to load the model (C(-lm), or C(--no-mmap)/C(--mlock) on older builds).
        type: str
        choices: [auto, none, mmap, mlock, mmap+mlock, dio]
        default: auto
      pin_devices:
        description: Also pass C(--device) with the plan's device names.
        type: bool
        default: false
      log_verbosity:
        description:
          - C(-lv) level. 3 logs the devices and buffer sizes, 5 also each layer's device (and much more).
        type: int
      extra_args:
        description: Further arguments, appended as given.
        type: list
        elements: str
        default: []
  unit_path:
    description: Where to write the llama-server systemd unit. Needs O(binary) and O(features).
    type: path
  unit_header:
    description: First lines of the unit (e.g. C({{ ansible_managed | comment }})).
    type: str
    default: ""
  unit:
    description: Unit options.
    type: dict
    default: {}
    suboptions:
      description:
        description: Unit description.
        type: str
        default: llamafleet llama-server (llama.cpp RPC orchestrator)
      user:
        description: Service user.
        type: str
        default: llamafleet
      group:
        description: Service group (default the user).
        type: str
      working_directory:
        description: Working directory.
        type: path
      home:
        description: The service's state directory; becomes the working directory (unless set) and writable.
        type: path
      wait_helper:
        description:
          - Executable run as C(ExecStartPre=) with the C(--rpc) endpoints as arguments, which must exit 0
            only once every worker answers (so a restart never aborts on a worker that is still starting).
        type: path
      build_id:
        description: llama.cpp build identifier, written as a comment in the unit (a new build changes the unit).
        type: str
      timeout_start_sec:
        description: C(TimeoutStartSec=), for slow worker waits and model loads.
        type: int
      read_write_paths:
        description: Paths the service may write (everything else is read-only).
        type: list
        elements: path
        default: []
      read_only_paths:
        description: Extra read-only paths.
        type: list
        elements: path
        default: []
      environment:
        description:
          - Environment variables. When the plan uses local CUDA GPUs, C(CUDA_DEVICE_ORDER=PCI_BUS_ID) is added
            unless set here, so that C(CUDA0), C(CUDA1) ... follow the PCI bus order that C(nvidia-smi) (and so
            M(llamafleet.cluster.gpu_facts)) reports; CUDA's own default puts the fastest GPU first.
        type: dict
        default: {}
      protect_home:
        description: C(ProtectHome=) value.
        type: str
        choices: ["yes", "read-only", "tmpfs"]
        default: "yes"
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
    details: Shows the unit before and after.
  platform:
    platforms: posix
  idempotent:
    description: A second run with the same parameters gives the same result and changes nothing.
    support: full
"""

EXAMPLES = r"""
- name: Plan and render the orchestrator
  llamafleet.cluster.rpc_plan:
    workers:
      - host: lab2
        address: 10.77.0.12
        devices: "{{ hostvars['lab2'].ansible_facts.llamafleet_rpc_devices }}"
      - host: lab3
        address: 10.77.0.13
        devices: "{{ hostvars['lab3'].ansible_facts.llamafleet_rpc_devices }}"
    orchestrator:
      host: "{{ inventory_hostname }}"
      devices: "{{ ansible_facts.llamafleet_rpc_devices }}"
    model: [/var/lib/llamafleet/models/gemma-3-270m-q4_k_m.gguf]
    ctx_size: 8192
    n_parallel: 2
    features: "{{ __llamacpp.features }}"
    binary: /opt/llamafleet/llama.cpp/build/bin/llama-server
    server:
      host: 0.0.0.0
      metrics: true
      chat_template: gemma
    unit_path: /etc/systemd/system/llamafleet-server.service
    unit_header: "{{ ansible_managed | comment }}"
    unit:
      read_write_paths: [/var/lib/llamafleet]
  register: __plan
  notify: Restart llamafleet-server

- name: Show the plan
  ansible.builtin.debug:
    msg: "{{ __plan.plan.explanation }}"
"""

RETURN = r"""
plan:
  description: The split plan.
  returned: always
  type: dict
  contains:
    rpc:
      description: C(--rpc) endpoints, C(address:port), in order.
      type: list
      elements: str
    devices:
      description:
        - One entry per model device in llama.cpp's order, with C(name) (V(RPC0), V(CUDA0)), C(buffer_name)
          (as the load log prints it), C(host), C(endpoint) (null for local GPUs), C(layers)
          (C(start), C(end) exclusive, C(count), C(output), C(range)), C(weights_mib), C(kv_mib),
          C(compute_mib), C(total_mib), C(usable_mib), C(free_mib), C(fill_pct).
      type: list
      elements: dict
    device_names:
      description: The device names, for C(--device).
      type: list
      elements: str
    tensor_split:
      description: C(-ts) values, the units per device.
      type: list
      elements: int
    ngl:
      description: C(-ngl), layers plus output.
      type: int
    totals:
      description: Weights, KV, compute, total and usable MiB.
      type: dict
    explanation:
      description: Human-readable lines.
      type: list
      elements: str
    warnings:
      description: Things that work but deserve attention (devices with no layers, ...).
      type: list
      elements: str
  sample:
    rpc: ["10.77.0.12:50052", "10.77.0.13:50052"]
    tensor_split: [11, 8]
    ngl: 19
explain:
  description: The plan's explanation lines (same as RV(plan.explanation)).
  returned: always
  type: list
  elements: str
argv:
  description: The llama-server command line as a list; empty without O(binary).
  returned: always
  type: list
  elements: str
unit:
  description: The rendered unit text; empty without O(binary).
  returned: always
  type: str
"""

import os
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_bytes
from ansible_collections.llamafleet.cluster.plugins.module_utils.gguf import GGUFError, model_facts
from ansible_collections.llamafleet.cluster.plugins.module_utils.llama_flags import (
    FlagError,
    render_llama_server_argv,
    render_systemd_unit,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.split_plan import PlanError, plan_split

UNIT_MODE = 0o644


def _server_features(features: dict) -> dict:
    return features.get("llama_server", features) if isinstance(features, dict) else {}


def _write_unit(module: AnsibleModule, path: str, text: str, result: dict) -> None:
    before = None
    if os.path.exists(path):
        with open(path, "rb") as handle:
            before = handle.read().decode("utf-8", errors="replace")
    if before != text:
        result["changed"] = True
        result["diff"] = {"before": before or "", "after": text,
                          "before_header": path if before is not None else "%s (absent)" % path,
                          "after_header": path}
        if not module.check_mode:
            directory = os.path.dirname(path) or "."
            if not os.path.isdir(directory):
                module.fail_json(msg="unit_path directory %s does not exist" % directory)
            fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(path), dir=directory)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(to_bytes(text))
                os.chmod(tmp, UNIT_MODE)
                module.atomic_move(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    if not os.path.exists(path):
        return
    if module.check_mode:
        if (os.stat(path).st_mode & 0o7777) != UNIT_MODE:
            result["changed"] = True
    else:
        result["changed"] = module.set_mode_if_different(path, "0644", result["changed"])


def run_module(module: AnsibleModule) -> dict:
    params = module.params
    if params["model_facts"] is not None:
        facts = params["model_facts"]
    else:
        try:
            facts = model_facts(params["model"])
        except (GGUFError, OSError) as exc:
            module.fail_json(msg="cannot read model %s: %s" % (", ".join(params["model"]), exc))
    try:
        plan = plan_split(
            params["workers"], params["orchestrator"] or None, facts,
            ctx_size=params["ctx_size"], n_parallel=params["n_parallel"],
            cache_type_k=params["cache_type_k"], cache_type_v=params["cache_type_v"],
            compute_mib=params["compute_mib"], tensor_split=params["tensor_split"] or None,
            kv_unified=params["kv_unified"],
        )
    except PlanError as exc:
        module.fail_json(msg=str(exc))
    result = {"changed": False, "plan": plan, "explain": plan["explanation"], "argv": [], "unit": ""}
    for warning in plan["warnings"]:
        module.warn(warning)

    if not params["binary"]:
        if params["unit_path"]:
            module.fail_json(msg="unit_path needs binary (the llama-server path) and features", plan=plan)
        return result
    if params["features"] is None:
        module.fail_json(msg="features is required to render llama-server (register llamacpp_info and pass its "
                             "features)", plan=plan)
    if not params["model"]:
        module.fail_json(msg="model (the GGUF path on this host) is required to render llama-server", plan=plan)
    server = params["server"]
    unit_opts = params["unit"]
    home = unit_opts["home"]
    read_write = list(unit_opts["read_write_paths"])
    if home and home not in read_write:
        read_write.insert(0, home)
    pre = [[unit_opts["wait_helper"]] + plan["rpc"]] if unit_opts["wait_helper"] and plan["rpc"] else []
    comments = ["llama.cpp build %s" % unit_opts["build_id"]] if unit_opts["build_id"] else []
    comments.append("split: --rpc %s -ts %s" % (",".join(plan["rpc"]) or "-", plan["tensor_split_arg"]))
    environment = dict(unit_opts["environment"])
    if any(d["local"] and d["backend"] == "cuda" for d in plan["devices"]):
        environment.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        argv = render_llama_server_argv(
            params["binary"], plan, _server_features(params["features"]), params["model"],
            host=server["host"], port=server["port"], metrics=server["metrics"],
            api_key_file=server["api_key_file"] or None, chat_template=server["chat_template"] or None,
            load_mode=server["load_mode"], pin_devices=server["pin_devices"],
            log_verbosity=server["log_verbosity"], extra_args=server["extra_args"],
        )
        unit = render_systemd_unit(
            argv, header=params["unit_header"], description=unit_opts["description"],
            user=unit_opts["user"], group=unit_opts["group"],
            working_directory=unit_opts["working_directory"] or home,
            read_write_paths=read_write, read_only_paths=unit_opts["read_only_paths"],
            environment=environment,
            limit_memlock_infinity=server["load_mode"] in ("mlock", "mmap+mlock"),
            protect_home=unit_opts["protect_home"], exec_start_pre=pre, comments=comments,
            timeout_start_sec=unit_opts["timeout_start_sec"],
        )
    except FlagError as exc:
        module.fail_json(msg=str(exc), plan=plan)
    result["argv"] = argv
    result["unit"] = unit
    if params["unit_path"]:
        _write_unit(module, params["unit_path"], unit, result)
    return result


def main() -> None:
    kv_types = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
    module = AnsibleModule(
        argument_spec=dict(
            workers=dict(type="list", elements="dict", default=[]),
            orchestrator=dict(type="dict", default={}),
            model=dict(type="list", elements="path"),
            model_facts=dict(type="dict"),
            ctx_size=dict(type="int", default=0),
            n_parallel=dict(type="int", default=1),
            cache_type_k=dict(type="str", default="f16", choices=kv_types, aliases=["cache_type"]),
            cache_type_v=dict(type="str", choices=kv_types),
            kv_unified=dict(type="bool", default=False),
            compute_mib=dict(type="int", default=512, aliases=["compute_margin_mib"]),
            tensor_split=dict(type="list", elements="float"),
            features=dict(type="dict"),
            binary=dict(type="path"),
            server=dict(
                type="dict",
                default={},
                options=dict(
                    host=dict(type="str", default="127.0.0.1"),
                    port=dict(type="int", default=8080),
                    metrics=dict(type="bool", default=False),
                    api_key_file=dict(type="path"),
                    chat_template=dict(type="str"),
                    load_mode=dict(type="str", default="auto",
                                   choices=["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"]),
                    pin_devices=dict(type="bool", default=False),
                    log_verbosity=dict(type="int"),
                    extra_args=dict(type="list", elements="str", default=[]),
                ),
            ),
            unit_path=dict(type="path"),
            unit_header=dict(type="str", default=""),
            unit=dict(
                type="dict",
                default={},
                options=dict(
                    description=dict(type="str", default="llamafleet llama-server (llama.cpp RPC orchestrator)"),
                    user=dict(type="str", default="llamafleet"),
                    group=dict(type="str"),
                    working_directory=dict(type="path"),
                    home=dict(type="path"),
                    wait_helper=dict(type="path"),
                    build_id=dict(type="str"),
                    timeout_start_sec=dict(type="int"),
                    read_write_paths=dict(type="list", elements="path", default=[]),
                    read_only_paths=dict(type="list", elements="path", default=[]),
                    environment=dict(type="dict", default={}),
                    protect_home=dict(type="str", default="yes", choices=["yes", "read-only", "tmpfs"]),
                ),
            ),
        ),
        required_one_of=[("model", "model_facts")],
        supports_check_mode=True,
    )
    result = run_module(module)
    if not module._diff:
        result.pop("diff", None)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
