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
    GPUs), under a split policy (O(policy)), never more than a device can hold.
  - Emits C(--tensor-split) as integer layer counts, which llama.cpp maps back to exactly the planned
    layer ranges.
  - A worker whose devices all get no layers is left out of C(--rpc) (llama-server would still connect to it
    and wait for it at start) and reported in RV(plan.excluded) and the explanation.
  - Renders the llama-server argv from the plan and the build's detected flags
    (M(llamafleet.cluster.llamacpp_info)), and a hardened systemd unit, written to O(unit_path) only
    when its content differs.
  - Runs on the orchestrator, where the model file is.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  workers:
    description:
      - rpc-server endpoints in C(--rpc) order, each V({host, address, port, devices}) (other keys are ignored).
      - C(host) is the inventory name (for messages), C(address) the IPv4 address the rpc-server listens on
        (default the host), C(port) its port (default 50052), C(devices) the devices it serves, in order
        (RV(llamafleet.cluster.gpu_facts#module:rpc_devices)), C(rtt_ms) the measured round trip to it
        (optional, overrides O(link_rtt_ms)).
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
      - Model facts as C(gguf_facts.model_facts) returns them; when given, the planner uses them instead of
        reading O(model) (which is still needed to render the command line).
    type: dict
  ctx_size:
    description: Total context (llama-server C(-c)); 0 uses the model's training context.
    type: int
    default: 0
  n_parallel:
    description:
      - Server slots (C(-np)), requests served at the same time.
      - V(0) chooses them from the context, at least 1 and at most 16, one slot per 128 tokens of a unified cache
        (O(kv_unified)) or per 512 tokens of a split one (C(MIN_SHARED_SLOT_CTX), C(MIN_SLOT_CTX) and
        C(MAX_AUTO_SLOTS) in C(module_utils/split_units.py) give the reasoning); the plan records the count.
      - With a unified cache of several slots the serving gate admits a generation only while its tokens fit the
        cache beside those in flight (the plan's C(kv_budget)), since llama-server fails every request in flight
        when the busy slots outgrow it.
      - Without O(kv_unified) each slot gets O(ctx_size) divided by the slots (rounded up to 256 tokens), and a share
        under 256 tokens is refused.
    type: int
    default: 0
  max_tokens:
    description:
      - The most tokens a generation that sets no C(max_tokens) (or C(n_predict)) may generate, llama-server's C(-n).
        The serving gate reserves that many for it in a shared cache.
      - V(0) chooses it, a quarter of a unified cache of several slots (so that four such generations share it)
        and none otherwise; V(-1) sets none (such a generation may fill the cache, so the gate runs it alone).
    type: int
    default: 0
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
    description:
      - One KV cache of O(ctx_size) tokens shared by all slots (C(--kv-unified)). Each request can use the whole
        context while the others are idle, and the cache does not grow with the slots (except sliding-window layers,
        by their window per slot, which the plan counts). V(false) gives each slot its own share of the context
        (C(--no-kv-unified) where the build has it).
      - With more than one slot and V(true), a build without C(--kv-unified) is refused.
    type: bool
    default: true
  compute_mib:
    description:
      - Memory kept free on every device that holds layers for llama.cpp's compute buffer, MiB (a device
        dict's own C(compute_mib) wins).
      - Measured compute buffers are tens of MiB for small models and a few hundred MiB for 70B-class
        models; 512 covers both (the reasoning is at C(DEFAULT_COMPUTE_MIB) in C(module_utils/split_devices.py)).
    type: int
    default: 512
    aliases: [compute_margin_mib]
  tensor_split:
    description:
      - Manual split ratios, one per device in llama.cpp's order. The plan then only checks that they fit.
      - Only with O(policy=balanced) (the default).
    type: list
    elements: float
  policy:
    description:
      - How the layers are split (the exact rules are in C(module_utils/split_policies.py)).
      - V(balanced) minimises the sum over devices of bytes squared over capacity (usable memory less the compute
        margin), the output matrix counted; that is bytes in proportion to capacity, as near as whole layers allow.
        With round trips known (O(link_rtt_ms) or a worker's C(rtt_ms)) it takes the V(fewest_hops) plan instead
        when that one's estimated time per token, bytes read over bandwidth plus one round trip per RPC device
        used, is lower by a clear margin (10% and 1 ms per token).
      - V(even) puts the same number of layers on every device (as C(-ts 1,1,...)).
      - V(fewest_hops) uses the fewest RPC devices that hold the model at this context (the orchestrator's GPUs
        first, then RPC devices with the most memory), balanced among them.
      - V(fit) renders no C(-ts) and no C(-ngl) and lets llama.cpp's C(--fit) split at load time.
    type: str
    default: balanced
    choices: [balanced, even, fewest_hops, fit]
  link_rtt_ms:
    description:
      - Measured round trip to every worker that gives no C(rtt_ms) of its own, ms. Unset, the planner knows no
        round trips and O(policy=balanced) never switches to V(fewest_hops).
      - M(llamafleet.cluster.link_rtt) measures each worker's C(rtt_ms).
    type: float
  cpu_layers:
    description:
      - Layers left on the orchestrator's CPU (C(-ngl) below the unit count; llama.cpp keeps the first layers there),
        sized from the CPU entry in O(orchestrator)'s devices (RV(llamafleet.cluster.gpu_facts#module:devices), the
        tighter of C(/proc/meminfo) and the cgroup limits above llama-server's unit) less what stays there anyway
        (input embedding, other tensors) and the compute margin.
      - V(auto) lets the CPU take part in V(balanced) and V(fewest_hops) like a device before C(RPC0) on a CPU
        fleet (no local GPU, every worker a CPU), and gives it none otherwise. V(0) none; a number exactly that
        many, refused when the CPU cannot hold them.
    type: raw
    default: auto
  recorded_plan:
    description:
      - The plan deployed now, as the role records it (RV(plan) as JSON). Its split is kept while the request is the
        same (model, context, KV types, slots, the devices in order, the settings that shape a split) and it still
        fits the memory measured now, so that free memory that moved a little between two runs moves no layer.
      - The fresh split is taken when the request changed, when the deployed split no longer fits (the explanation
        says why), or when the file is absent or cannot be read (a warning).
      - Unset, the split is always planned afresh.
    type: path
  degrade:
    description:
      - Also plan, for each worker host, the cluster without it (RV(degraded)), with llama-server's
        C(ExecStartPre) and C(ExecStart) for that plan as a unit drop-in. Needs O(binary).
    type: bool
    default: false
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
      chat_template_file:
        description: A Jinja chat template file on the host (C(--chat-template-file)); needs O(server.jinja) not false.
        type: path
      jinja:
        description:
          - V(true) renders C(--jinja), V(false) C(--no-jinja) where the build has it; unset keeps the build's default.
        type: bool
      alias:
        description: The model's name for clients (C(--alias)), the id C(/v1/models) lists; empty leaves the path.
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
          - C(-lv) level. 4 logs the devices, the offloaded layer count and the buffer sizes; 5 also each layer's
            device (and llama.cpp's debug messages). llama.cpp's default, 3, logs none of them.
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
      devices: "{{ ansible_facts.llamafleet_devices }}"
    model: [/var/lib/llamafleet/models/gemma-3-270m-q4_k_m.gguf]
    ctx_size: 8192
    n_parallel: 2
    features: "{{ __llamacpp.features }}"
    binary: /opt/llamafleet/llama.cpp/current/bin/llama-server
    server:
      host: 0.0.0.0
      metrics: true
      chat_template: gemma
    unit_path: /etc/systemd/system/llamafleet-llama-server.service
    unit_header: "{{ ansible_managed | comment }}"
    unit:
      home: /var/lib/llamafleet
  register: __plan
  notify: Restart llama-server

- name: Plan only, knowing the links' 5 ms round trip (balanced then uses fewer workers when that is faster)
  llamafleet.cluster.rpc_plan:
    workers: "{{ __workers }}"
    model: [/var/lib/llamafleet/models/gemma-3-270m-q4_k_m.gguf]
    ctx_size: 8192
    link_rtt_ms: 5
  register: __plan_slow

- name: Show the plan
  ansible.builtin.debug:
    msg: "{{ __plan.plan.explanation }}"
"""

RETURN = r"""
recorded:
  description: C(identity) and C(keep) of the plan recorded at O(recorded_plan) as this run read it (an empty
    identity and keep when it is unset, absent or unreadable), to compare with RV(plan).
  returned: always
  type: dict
plan:
  description: The split plan.
  returned: always
  type: dict
  contains:
    rpc:
      description: C(--rpc) endpoints, C(address:port), in order; only workers that hold layers (V(fit) keeps all).
      type: list
      elements: str
    policy:
      description: What made the split, V(balanced), V(even), V(fewest_hops), V(fit) or V(manual) (O(tensor_split)).
      type: str
    requested_policy:
      description: O(policy) as asked; differs from RV(plan.policy) when V(balanced) chose V(fewest_hops).
      type: str
    estimate:
      description:
        - Estimated time of one decoding step, C(compute_ms), C(hops), C(rtt_ms), C(total_ms); null unless the round
          trip to every worker used is known.
      type: dict
    excluded:
      description:
        - Workers left out of C(--rpc) because their devices got no layers, each C(host), C(endpoint), C(devices).
      type: list
      elements: dict
    devices:
      description:
        - One entry per model device in llama.cpp's order, with C(name) (V(RPC0), V(CUDA0)), C(buffer_name)
          (as the load log prints it), C(host), C(endpoint) (null for local GPUs), C(layers)
          (C(start), C(end) exclusive, C(count), C(output), C(range)), C(weights_mib), C(kv_mib),
          C(compute_mib), C(total_mib), C(usable_mib), C(free_mib), C(fill_pct); the figures of layers are null
          for V(fit).
      type: list
      elements: dict
    device_names:
      description: The device names, for C(--device).
      type: list
      elements: str
    tensor_split:
      description: C(-ts) values, the units per device; null for V(fit).
      type: list
      elements: int
    ngl:
      description: C(-ngl), the units (layers plus output) on the devices, less those left on the CPU; null for V(fit).
      type: int
    cpu_layers:
      description: Layers left on the orchestrator's CPU, the first ones (O(cpu_layers)); 0 for none.
      type: int
    keep:
      description:
        - What a later run needs to keep this split (O(recorded_plan)), C(request_key), C(counts) (units per device
          before idle endpoints are left out), C(cpu_layers), C(policy), and C(degraded) (the same for each degraded
          plan that fits, by name).
      type: dict
    cpu:
      description:
        - What the orchestrator's CPU holds when it holds layers (null otherwise), C(host), C(layers), C(weights_mib),
          C(kv_mib), C(compute_mib), C(total_mib), C(usable_mib) (after C(held_mib), what stays there anyway, the
          input embedding and the other tensors), C(fill_pct), C(source) (where its free figure came from).
      type: dict
    n_parallel:
      description: The slots (C(-np)), O(n_parallel) or the count chosen for V(0).
      type: int
    n_parallel_auto:
      description: Whether the planner chose RV(plan.n_parallel) (O(n_parallel=0)).
      type: bool
    kv_unified:
      description: Whether the slots share one KV cache (O(kv_unified)).
      type: bool
    slot_ctx:
      description:
        - Tokens one request can use, the shared cache or a slot's share of it, capped at the model's training
          context as llama-server caps it.
      type: int
    kv_budget:
      description:
        - The KV cells the slots share, which the serving gate keeps generations within (gate config C(kv_budget));
          0 without a unified cache of several slots.
      type: int
    max_tokens:
      description: The bound of a generation that sets none, C(-n) (O(max_tokens) resolved); 0 for none.
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
degraded:
  description:
    - With O(degrade), one entry per worker host, in O(workers) order. C(fits) false means the model does not
      fit on the other workers; C(reason) says why, or which split they get.
  returned: always
  type: list
  elements: dict
  sample:
    - without: lab3
      name: without-lab3
      fits: true
      reason: "fits on the other workers: split: --rpc 10.77.0.12:50052 -ts 0,1 (policy balanced)"
      rpc: [10.77.0.12:50052]
      tensor_split: [0, 1]
      dropin: "[Service]\nExecStartPre=\nExecStartPre=/usr/local/libexec/llamafleet-rpc-wait 10.77.0.12:50052\n..."
gate_degrade:
  description:
    - RV(degraded) as the serving gate's configuration takes it (C(degrade) of C(/etc/llamafleet/gate.json)).
    - C(plans) maps each worker host to the name of the plan without it, or null when the model does not fit
      without it; C(reasons) says why.
  returned: always
  type: dict
  sample:
    plans: {lab2: null, lab3: without-lab3}
    reasons: {lab2: "the model does not fit without lab2: ...", lab3: "fits on the other workers: ..."}
gate_workers:
  description:
    - The remote RPC endpoints of the plan, each once in the plan's order, as the serving gate's configuration
      takes them (C(workers) of C(/etc/llamafleet/gate.json)).
  returned: always
  type: list
  elements: dict
  sample:
    - host: lab2
      endpoint: 10.77.0.12:50052
      address: 10.77.0.12
      port: 50052
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import LLAMA_SERVER_PORT, LLAMA_SERVER_USER
from ansible_collections.llamafleet.cluster.plugins.module_utils.llama_server_plan import run_rpc_plan
from ansible_collections.llamafleet.cluster.plugins.module_utils.split_plan import (
    DEFAULT_COMPUTE_MIB,
    DEFAULT_POLICY,
    KV_TYPES,
    POLICIES,
)


def main() -> None:
    kv_types = list(KV_TYPES)
    module = AnsibleModule(
        argument_spec=dict(
            workers=dict(type="list", elements="dict", default=[]),
            orchestrator=dict(type="dict", default={}),
            model=dict(type="list", elements="path"),
            model_facts=dict(type="dict"),
            ctx_size=dict(type="int", default=0),
            n_parallel=dict(type="int", default=0),
            max_tokens=dict(type="int", default=0, no_log=False),
            cache_type_k=dict(type="str", default="f16", choices=kv_types, aliases=["cache_type"]),
            cache_type_v=dict(type="str", choices=kv_types),
            kv_unified=dict(type="bool", default=True),
            compute_mib=dict(type="int", default=DEFAULT_COMPUTE_MIB, aliases=["compute_margin_mib"]),
            tensor_split=dict(type="list", elements="float"),
            policy=dict(type="str", default=DEFAULT_POLICY, choices=list(POLICIES)),
            link_rtt_ms=dict(type="float"),
            cpu_layers=dict(type="raw", default="auto"),
            recorded_plan=dict(type="path"),
            degrade=dict(type="bool", default=False),
            features=dict(type="dict"),
            binary=dict(type="path"),
            server=dict(
                type="dict",
                default={},
                options=dict(
                    host=dict(type="str", default="127.0.0.1"),
                    port=dict(type="int", default=LLAMA_SERVER_PORT),
                    metrics=dict(type="bool", default=False),
                    api_key_file=dict(type="path"),
                    chat_template=dict(type="str"),
                    chat_template_file=dict(type="path"),
                    jinja=dict(type="bool"),
                    alias=dict(type="str"),
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
                    user=dict(type="str", default=LLAMA_SERVER_USER),
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
    module.exit_json(**run_rpc_plan(module))


if __name__ == "__main__":
    main()
