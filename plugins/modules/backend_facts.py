#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: backend_facts
short_description: Tell whether a host can run a llama.cpp backend, before anything is built
version_added: "0.1.0"
description:
  - Reads what the host has for each GPU backend, without running the vendor tools, and says whether it
    can run O(backend). The llamacpp_build role's preflight asserts on RV(problem).
  - C(cuda) needs the NVIDIA kernel driver (C(/proc/driver/nvidia/version)) and C(nvidia-smi). C(vulkan)
    needs a Vulkan loader (C(libvulkan.so.1) in C(ldconfig -p) or a usual library directory). C(rocm)
    needs C(/dev/kfd) and, when C(/sys/class/drm) lists GPUs, an AMD one (PCI vendor C(0x1002)).
    C(metal) is refused (macOS hosts are not supported in this release). C(cpu) needs nothing.
  - O(groups) are checked too. A host in an inventory group C(llamafleet_backend_<backend>) must have
    that backend, and may be in one such group only.
  - Build hosts need more (toolkits, headers); the role checks the Vulkan headers itself.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.read_only
options:
  backend:
    description: The backend the host is to build and run (the llamacpp_build role's C(llamacpp_build_backend)).
    type: str
    required: true
  groups:
    description: The host's inventory groups (C(group_names)), for the backend group check.
    type: list
    elements: str
    default: []
seealso:
  - module: llamafleet.cluster.gpu_facts
"""

EXAMPLES = r"""
- name: Read what this host has for its backend
  llamafleet.cluster.backend_facts:
    backend: "{{ llamacpp_build_backend }}"
    groups: "{{ group_names }}"
  register: backend_check

- name: Stop before any change when it cannot run the backend
  ansible.builtin.assert:
    that: backend_check.problem is none
    fail_msg: "{{ inventory_hostname }}: {{ backend_check.problem }}"
"""

RETURN = r"""
facts:
  description: What the host has.
  returned: always
  type: dict
  contains:
    nvidia_driver:
      description: Whether C(/proc/driver/nvidia/version) exists.
      type: bool
    nvidia_smi:
      description: Path of C(nvidia-smi), or null.
      type: str
    vulkan_loader:
      description: Path of the Vulkan loader C(libvulkan.so.1), or null.
      type: str
    kfd:
      description: Whether C(/dev/kfd) exists.
      type: bool
    gpu_vendors:
      description: PCI vendor ids of the GPUs in C(/sys/class/drm) (V(0x1002) AMD, V(0x10de) NVIDIA, V(0x8086) Intel).
      type: list
      elements: str
  sample: {nvidia_driver: false, nvidia_smi: null, vulkan_loader: /lib/x86_64-linux-gnu/libvulkan.so.1,
           kfd: false, gpu_vendors: ["0x8086"]}
problem:
  description: Why the host cannot run O(backend) (names the variable C(llamacpp_build_backend)), or null.
  returned: always
  type: str
  sample: >-
    llamacpp_build_backend=cuda needs the NVIDIA driver, and this host has no NVIDIA kernel driver
    (/proc/driver/nvidia/version is missing) and no nvidia-smi on the PATH. Install the NVIDIA driver
    (and the CUDA toolkit on build hosts), or choose another backend.
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llamafleet.cluster.plugins.module_utils.backend_checks import check_this_host


def run_module(module: AnsibleModule) -> dict:
    def run(argv: list) -> tuple:
        return module.run_command(argv, environ_update={"LC_ALL": "C"})

    return dict(check_this_host(module.params["backend"], module.params["groups"], run, module.get_bin_path),
                changed=False)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            backend=dict(type="str", required=True),
            groups=dict(type="list", elements="str", default=[]),
        ),
        supports_check_mode=True,
    )
    module.exit_json(**run_module(module))


if __name__ == "__main__":
    main()
