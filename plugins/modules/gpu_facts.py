#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_facts
short_description: Detect a host's GPUs and memory for llama.cpp split planning
version_added: "0.1.0"
description:
  - Runs the device tools the host has (C(nvidia-smi), C(amd-smi) or C(rocm-smi), C(vulkaninfo))
    and reads C(/proc/meminfo), and returns one device list with total and free memory in MiB.
  - Linux only (macOS hosts are not supported as workers or orchestrator in this release).
  - A missing tool is not an error (the host simply has no such GPU). A tool that fails or prints
    something unreadable is reported in RV(errors) and as a warning, or fails the task with O(strict).
  - Inventory overrides win over detected figures, for hosts whose tools report nothing useful
    (unified-memory GPUs) or whose memory must be capped (shared hosts, lab containers).
  - With O(rpc_server), the built rpc-server binary itself lists the devices it would serve, which is
    exactly what llama-server will see through RPC.
  - The CPU entry's figures are the tighter of C(/proc/meminfo) and the cgroup limits above the service's units
    (O(units)), such as a container's or a slice's C(memory.max) (cgroup v2) or C(memory.limit_in_bytes) (v1), less
    what the others in it use; what the units themselves hold counts as theirs. C(total_source) and C(free_source) say
    which figure won.
  - What a unit holds is its own memory cgroup's charge less its page cache. Where the unit has no memory cgroup of its
    own (an nspawn host on a cgroup v1 or hybrid machine sees the memory controller read-only), it is the resident
    memory (C(RssAnon) + C(RssShmem) of C(/proc/PID/status)) of the processes its C(cgroup.procs) lists in systemd's
    hierarchy (unified, or v1's C(name=systemd)), or where none lists them C(systemctl show)'s C(MainPID) and its
    children; C(free_source) then says C(by unit RSS), and the CPU device's
    C(memory.units) lists each unit's C(source), C(own_mib) and C(pids).
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.read_only
options:
  backends:
    description:
      - Which backends to probe. V(auto) probes C(cuda), C(rocm), C(vulkan) and C(cpu).
    type: list
    elements: str
    default: [auto]
  overrides:
    description:
      - Figures that replace or limit detected ones. Later entries win.
    type: list
    elements: dict
    default: []
    suboptions:
      match:
        description:
          - Which devices the entry applies to. V(all) or V(*); a backend (V(cuda), V(cpu));
            V(backend:index) (V(cuda:1)); an index (any backend); a llama.cpp device name (V(CUDA1));
            or a case-insensitive glob on the device name (V(*4090*)).
        type: raw
        required: true
      total_mib:
        description: Total memory of the device, MiB.
        type: int
      free_mib:
        description: Free memory of the device, MiB.
        type: int
      reserve_mib:
        description: Memory to leave unused on the device, MiB.
        type: int
      max_mib:
        description: The most the split planner may use on the device, MiB.
        type: int
  cpu_reserve_mib:
    description: Default reserve for CPU devices (room for the OS and other services), MiB.
    type: int
    default: 1024
  rpc_server:
    description:
      - Path to the host's built rpc-server. When given, it lists llama.cpp's own view of the devices
        (its C(-d) option with a name that does not exist makes it print them and exit without
        binding a port), and RV(rpc_devices) follows that.
    type: path
  units:
    description:
      - The systemd units of the service the memory is for (an rpc-server's, llama-server's), in C(system.slice);
        the cgroups above them are read, and what they hold already counts as free for them (their cgroup's charge,
        or their processes' resident memory where the unit has no memory cgroup).
      - Empty reads the cgroups above this module's own process.
    type: list
    elements: str
    default: []
  memory_max_mib:
    description:
      - The C(MemoryMax=) the service's unit gets (RV(memory_max_mib)), MiB. V(auto) is the CPU device's planning
        ceiling (an override's C(max_mib), never above the host's memory less the reserve) on a CPU build, none on a
        GPU build (its weights are in VRAM); V(0) none; a number as given.
      - A number above the host's memory (the tighter of MemTotal and the cgroup limits) fails the task, as does an
        override C(free_mib) or C(total_mib) above it. The CPU devices get it as C(limit_mib), which caps what the
        planner may use.
    type: raw
    default: "0"
  names:
    description:
      - How failure messages name things, for the role that calls the module (V({host, memory_max_mib, overrides})
        with the host's and the variables' names).
    type: dict
    default: {}
  strict:
    description: Fail the task when a tool fails or prints unreadable output.
    type: bool
    default: false
notes:
  - llama.cpp's CPU device reports the machine's total RAM as free. The CPU entry here uses
    C(MemAvailable) instead.
  - C(nvidia-smi) numbers GPUs in PCI bus order, CUDA (and so llama.cpp's C(CUDA0), C(CUDA1)) fastest first
    unless C(CUDA_DEVICE_ORDER=PCI_BUS_ID) is set. On hosts with different GPUs, set that variable for
    rpc-server and llama-server, or use O(rpc_server), which reports llama.cpp's own order.
"""

EXAMPLES = r"""
- name: Detect devices
  llamafleet.cluster.gpu_facts:

- name: Detect, capping a lab host's CPU device at 2 GiB and keeping 1 GiB free on GPU 0
  llamafleet.cluster.gpu_facts:
    rpc_server: /opt/llamafleet/llama.cpp/bin/ggml-rpc-server
    overrides:
      - match: cpu
        max_mib: 2048
      - match: "cuda:0"
        reserve_mib: 1024

- name: Show what the planner will get
  ansible.builtin.debug:
    var: ansible_facts.llamafleet_rpc_devices
"""

RETURN = r"""
devices:
  description: Every detected device after overrides. Figures in MiB; C(total_mib)/C(free_mib) may be null
    when a tool cannot tell (then give an override).
  returned: always
  type: list
  elements: dict
  sample:
    - {backend: cuda, index: 0, name: NVIDIA GeForce RTX 4090, total_mib: 24564, free_mib: 24108,
       integrated: false, source: nvidia-smi, reserve_mib: 0, overridden: []}
    - {backend: cpu, index: 0, name: AMD EPYC, total_mib: 3072, free_mib: 2710, integrated: false,
       source: /proc/meminfo + cgroup2, total_source: cgroup / memory.max,
       free_source: "cgroup / memory.max (3072 MiB, 362 MiB used by others)", reserve_mib: 1024, overridden: []}
rpc_devices:
  description: The devices an rpc-server on this host serves, in its order (the GPUs of RV(backend), else the CPU).
  returned: always
  type: list
  elements: dict
backend:
  description: The GPU backend to build for (V(cuda), V(rocm), V(vulkan)), or V(cpu).
  returned: always
  type: str
  sample: cuda
memory_max_mib:
  description: The C(MemoryMax=) for the service's unit, MiB (O(memory_max_mib) resolved); 0 for none.
  returned: always
  type: int
  sample: 2048
tools:
  description: Each probed tool and what happened (V(ok), V(missing), V(failed), V(unparsed)).
  returned: always
  type: dict
  sample: {nvidia-smi: ok, amd-smi: missing, rocm-smi: missing, vulkaninfo: missing}
errors:
  description: Tools that failed or printed output this module could not read.
  returned: always
  type: list
  elements: str
ansible_facts:
  description: The same lists as facts.
  returned: always
  type: dict
  contains:
    llamafleet_devices:
      description: Same as RV(devices).
      type: list
      elements: dict
    llamafleet_rpc_devices:
      description: Same as RV(rpc_devices).
      type: list
      elements: dict
    llamafleet_gpu_backend:
      description: Same as RV(backend).
      type: str
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_devices import (
    ParseError,
    apply_overrides,
    unmatched_overrides,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_memory import check_memory
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_probe import collect_devices, read_text_file

PROBE_TIMEOUT_S = 60


def run_module(module: AnsibleModule) -> dict:
    params = module.params
    timeout_bin = module.get_bin_path("timeout")

    def run(argv: list) -> tuple:
        if timeout_bin:
            argv = [timeout_bin, str(PROBE_TIMEOUT_S)] + list(argv)
        rc, out, err = module.run_command(argv, environ_update={"LC_ALL": "C"})
        if timeout_bin and rc == 124:
            err = "timed out after %d s" % PROBE_TIMEOUT_S
        return rc, out, err

    if params["rpc_server"] and not os.access(params["rpc_server"], os.X_OK):
        module.fail_json(msg="rpc_server %s is not an executable file" % params["rpc_server"])
    try:
        found = collect_devices(run, module.get_bin_path, read_text_file, backends=params["backends"],
                                rpc_server=params["rpc_server"], environ=os.environ, units=params["units"])
        overrides = [{k: v for k, v in o.items() if v is not None} for o in params["overrides"]]
        devices = apply_overrides(found["devices"], overrides, params["cpu_reserve_mib"], require_match=False)
        rpc_devices = apply_overrides(found["rpc_devices"], overrides, params["cpu_reserve_mib"], require_match=False)
    except ParseError as exc:
        module.fail_json(msg=str(exc))
    names = params["names"] or {}
    serves_cpu = any(d["backend"] == "cpu" for d in rpc_devices)
    memory_max, problems = check_memory(found["devices"], serves_cpu, params["memory_max_mib"], overrides,
                                        params["cpu_reserve_mib"], names.get("memory_max_mib", "memory_max_mib"),
                                        names.get("overrides", "overrides"))
    if problems:
        prefix = "%s: " % names["host"] if names.get("host") else ""
        module.fail_json(msg=prefix + "; ".join(problems), memory_max_mib=memory_max)
    for dev in devices + rpc_devices:
        if memory_max and dev["backend"] == "cpu":
            dev.update(limit_mib=memory_max, limit_source="%s (the unit's MemoryMax)"
                       % names.get("memory_max_mib", "memory_max_mib"))
    unmatched = unmatched_overrides([devices, rpc_devices], overrides)
    if unmatched:
        module.fail_json(msg="; ".join(unmatched))
    if found["errors"] and params["strict"]:
        module.fail_json(msg="device probes failed: " + "; ".join(found["errors"]), errors=found["errors"],
                         tools=found["tools"])
    for message in found["errors"] + found["warnings"]:
        module.warn(message)
    return {
        "changed": False,
        "devices": devices,
        "rpc_devices": rpc_devices,
        "memory_max_mib": memory_max,
        "backend": found["backend"],
        "tools": found["tools"],
        "errors": found["errors"],
        "ansible_facts": {
            "llamafleet_devices": devices,
            "llamafleet_rpc_devices": rpc_devices,
            "llamafleet_gpu_backend": found["backend"],
        },
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            backends=dict(type="list", elements="str", default=["auto"]),
            overrides=dict(
                type="list",
                elements="dict",
                default=[],
                options=dict(
                    match=dict(type="raw", required=True),
                    total_mib=dict(type="int"),
                    free_mib=dict(type="int"),
                    reserve_mib=dict(type="int"),
                    max_mib=dict(type="int"),
                ),
            ),
            cpu_reserve_mib=dict(type="int", default=1024),
            rpc_server=dict(type="path"),
            units=dict(type="list", elements="str", default=[]),
            memory_max_mib=dict(type="raw", default="0"),
            names=dict(type="dict", default={}),
            strict=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    module.exit_json(**run_module(module))


if __name__ == "__main__":
    main()
