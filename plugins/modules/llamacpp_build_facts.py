#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llamacpp_build_facts
short_description: Read in one run what the llamacpp_build role needs to know of a host
version_added: "0.2.0"
description:
  - One read for the llamacpp_build role, so that a host that already runs its build costs one module run.
  - Returns what M(llamafleet.cluster.backend_facts) returns for O(backend) and O(groups); the build C(current)
    under O(root) names; whether O(build_id) is installed (C(<root>/<build_id>/BUILDINFO.json)), its build record
    and, when installed, what M(llamafleet.cluster.llamacpp_info) returns about it; the version directories under
    O(root) with their modification times; the dpkg status of O(packages); the Vulkan header version.
  - Read-only.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.read_only
options:
  backend:
    description: The backend the host is to build and run (C(llamacpp_build_backend)).
    type: str
    required: true
  groups:
    description: The host's inventory groups (C(group_names)), for the backend group check.
    type: list
    elements: str
    default: []
  root:
    description: The build root (C(llamacpp_build_root)), holding one directory per build and the C(current) link.
    type: path
    required: true
  build_id:
    description: The build the host should run (the llamacpp_build role's build id).
    type: str
    required: true
  packages:
    description: Packages whose dpkg status to read (C(dpkg-query)); empty reads none.
    type: list
    elements: str
    default: []
  vulkan_header:
    description: A C(vulkan_core.h) whose C(VK_HEADER_VERSION) to read.
    type: path
seealso:
  - module: llamafleet.cluster.backend_facts
  - module: llamafleet.cluster.llamacpp_info
"""

EXAMPLES = r"""
- name: Read this host's llama.cpp builds, backend and packages
  llamafleet.cluster.llamacpp_build_facts:
    backend: cpu
    groups: "{{ group_names }}"
    root: /opt/llamafleet/llama.cpp
    build_id: b6000-cpu-0123456789
    packages: [libgomp1, cmake]
  register: build_host
"""

RETURN = r"""
root:
  description: O(root), as asked.
  returned: always
  type: str
build_id:
  description: O(build_id), as asked.
  returned: always
  type: str
backend:
  description: What M(llamafleet.cluster.backend_facts) returns (C(facts) and C(problem)).
  returned: always
  type: dict
current:
  description: The build C(<root>/current) points at (the name of the directory it resolves to), or null when
    C(current) is no link.
  returned: always
  type: str
current_target:
  description: The link's own text (what C(ln -s) was given), or null.
  returned: always
  type: str
installed:
  description: Whether C(<root>/<build_id>/BUILDINFO.json) exists.
  returned: always
  type: bool
record:
  description: The parsed C(BUILDINFO.json) of O(build_id), or null when not installed.
  returned: always
  type: dict
info:
  description: What M(llamafleet.cluster.llamacpp_info) returns for the prefix C(<root>/<build_id>), or null
    when not installed.
  returned: always
  type: dict
versions:
  description: The directories under O(root) (hidden ones and links left out), newest first.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The directory.
      type: str
    mtime:
      description: Its modification time (seconds since the epoch).
      type: float
packages:
  description: Each of O(packages) -> its dpkg status (V(installed) when installed), null when dpkg knows none.
  returned: always
  type: dict
packages_missing:
  description: The O(packages) that are not installed.
  returned: always
  type: list
  elements: str
vulkan_header_version:
  description: C(VK_HEADER_VERSION) of O(vulkan_header); 0 when the file lacks it or is missing, null when not asked.
  returned: always
  type: int
"""

import json
import os
import stat

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llamafleet.cluster.plugins.module_utils.backend_checks import check_this_host
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_probe import read_text_file
from ansible_collections.llamafleet.cluster.plugins.module_utils.llamacpp_host import (
    BuildInspectError,
    dpkg_query_argv,
    inspect_bin_dir,
    missing_packages,
    parse_dpkg_status,
    version_dirs,
    vulkan_header_version,
)


def _entries(root: str) -> list:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            continue
        found.append((name, stat.S_ISDIR(st.st_mode), st.st_mtime))
    return found


def _record(module: AnsibleModule, path: str):
    text = read_text_file(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        module.fail_json(msg="%s is not a build record (%s); remove its build directory to build it again" % (path, exc))


def run_module(module: AnsibleModule) -> dict:
    params = module.params
    root, build_id = params["root"], params["build_id"]

    def run(argv: list) -> tuple:
        return module.run_command(argv, environ_update={"LC_ALL": "C"})

    current_link = os.path.join(root, "current")
    is_link = os.path.islink(current_link)
    prefix = os.path.join(root, build_id)
    record = _record(module, os.path.join(prefix, "BUILDINFO.json"))
    info = None
    if record is not None:
        try:
            info = inspect_bin_dir(os.path.join(prefix, "bin"), run)
        except BuildInspectError as exc:
            module.fail_json(msg=str(exc))
    status = {}
    if params["packages"] and module.get_bin_path("dpkg-query"):
        out = run(dpkg_query_argv(params["packages"]))[1]
        status = parse_dpkg_status(out, params["packages"])
    vk_version = None
    if params["vulkan_header"]:
        vk_version = vulkan_header_version(read_text_file(params["vulkan_header"]) or "")
    return {
        "changed": False,
        "root": root,
        "build_id": build_id,
        "backend": check_this_host(params["backend"], params["groups"], run, module.get_bin_path),
        "current": os.path.basename(os.path.realpath(current_link)) if is_link else None,
        "current_target": os.readlink(current_link) if is_link else None,
        "installed": record is not None,
        "record": record,
        "info": info,
        "versions": version_dirs(root, _entries(root)),
        "packages": status,
        "packages_missing": missing_packages(params["packages"], status),
        "vulkan_header_version": vk_version,
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            backend=dict(type="str", required=True),
            groups=dict(type="list", elements="str", default=[]),
            root=dict(type="path", required=True),
            build_id=dict(type="str", required=True),
            packages=dict(type="list", elements="str", default=[]),
            vulkan_header=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    module.exit_json(**run_module(module))


if __name__ == "__main__":
    main()
