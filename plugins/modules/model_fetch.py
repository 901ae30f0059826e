#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_fetch
short_description: Fetch pinned GGUF model files, resumably, verified by sha256
version_added: "0.1.0"
description:
  - Downloads each model file (a single GGUF or every shard of a split GGUF) from its URL into O(dest),
    through a C(.part) file that a later run resumes with an HTTP range request.
  - Verifies every file against its pinned sha256. A file already in place is verified where it lies
    and never downloaded again; a marker next to it lets later runs skip the hash.
  - Checks that the URLs answer and that the destination has room for what is missing before anything
    is written, so bad input fails before the host changes.
  - Before that, reads the start of every file it must fetch with HTTP range requests (growing the range until
    the GGUF tensor table is parsed, at most 64 MiB) and refuses a file that is not GGUF (a login or error page
    served with 200, named by its media type and first bytes), one shorter than its header says (truncated at the
    source, which a sha256 pinned for that file does not catch) and an architecture the planner does not know.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  files:
    description: Model files in shard order.
    type: list
    elements: dict
    required: true
    suboptions:
      url:
        description: Where to download the file from (a Hugging Face resolve URL, a mirror, ...).
        type: str
        required: true
      sha256:
        description: The file's sha256, 64 hex digits.
        type: str
        required: true
      name:
        description: File name in O(dest); defaults to the last component of the URL path.
        type: str
  dest:
    description: Directory for the model files; created if missing.
    type: path
    required: true
  owner:
    description: Owner of the files.
    type: str
  group:
    description: Group of the files.
    type: str
  mode:
    description: Mode of the files.
    type: raw
    default: "0644"
  free_margin_mib:
    description: Free space to leave on the destination's file system beyond the model.
    type: int
    default: 1024
  timeout:
    description: Network timeout in seconds for each request.
    type: int
    default: 60
  label:
    description: How errors name O(files), e.g. V(model_files) gives C(model_files[0]).
    type: str
    default: files
"""

EXAMPLES = r"""
- name: Fetch a split model
  llamafleet.cluster.model_fetch:
    dest: /var/lib/llamafleet/models/big
    files:
      - url: https://huggingface.co/org/repo/resolve/0123abc/model-00001-of-00002.gguf
        sha256: "5d1cf0b2ad0fa8c7c3dd0bd1d1a8f4c4c0e21aa6f7f9a8f4bfae9a1c0f1e2d3a"
      - url: https://huggingface.co/org/repo/resolve/0123abc/model-00002-of-00002.gguf
        sha256: "9a3e8c1d7f2b4a6e0c5d8f1a3b7e9c2d4f6a8b0c1e3d5f7a9b2c4e6f8a0b1c3d"
"""

RETURN = r"""
paths:
  description: Absolute paths of the model files, in shard order.
  returned: always
  type: list
  elements: str
fetched:
  description: Names of the files downloaded (or, in check mode, that would be).
  returned: always
  type: list
  elements: str
bytes_needed:
  description: Bytes that had to be (or would be) downloaded.
  returned: always
  type: int
free_bytes:
  description: Free bytes on the destination before downloading.
  returned: always
  type: int
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.fetch import (
    FetchError,
    FileSpec,
    check_headers,
    check_space,
    download,
    plan,
)


def run(module: AnsibleModule) -> dict:
    params = module.params
    dest = params["dest"]
    try:
        specs = [FileSpec(url=f["url"], sha256=f["sha256"], name=f.get("name") or "") for f in params["files"]]
        if not specs:
            raise FetchError("no model files given")
        states = plan(specs, dest, timeout=params["timeout"], record=not module.check_mode)
        check_headers(states, params["label"], timeout=params["timeout"])
        needed, free = check_space(states, dest, params["free_margin_mib"] * 1024 * 1024)
    except FetchError as exc:
        module.fail_json(msg=str(exc))
    todo = [s for s in states if s.action != "none"]
    result = {
        "changed": bool(todo),
        "paths": [s.path for s in states],
        "fetched": [s.spec.name for s in todo],
        "bytes_needed": needed,
        "free_bytes": free,
        "warnings_": [n for s in states for n in s.notes],
        "diff": {
            "before": "".join(f"{s.spec.name}: {'verified' if s.verified else 'missing'}\n" for s in states),
            "after": "".join(f"{s.spec.name}: {s.spec.sha256}\n" for s in states),
        },
    }
    if module.check_mode:
        return result
    if todo and not os.path.isdir(dest):
        os.makedirs(dest, mode=0o755, exist_ok=True)
    for state in todo:
        try:
            download(state, timeout=params["timeout"])
        except FetchError as exc:
            module.fail_json(msg=str(exc), fetched=[s.spec.name for s in todo if os.path.isfile(s.path)])
    for state in states:
        file_args = module.load_file_common_arguments(
            {"path": state.path, "owner": params["owner"], "group": params["group"], "mode": params["mode"]}
        )
        result["changed"] = module.set_fs_attributes_if_different(file_args, result["changed"])
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            files=dict(
                type="list",
                elements="dict",
                required=True,
                options=dict(
                    url=dict(type="str", required=True),
                    sha256=dict(type="str", required=True, no_log=False),
                    name=dict(type="str"),
                ),
            ),
            dest=dict(type="path", required=True),
            owner=dict(type="str"),
            group=dict(type="str"),
            mode=dict(type="raw", default="0644"),
            free_margin_mib=dict(type="int", default=1024),
            timeout=dict(type="int", default=60),
            label=dict(type="str", default="files"),
        ),
        supports_check_mode=True,
    )
    result = run(module)
    for note in result.pop("warnings_"):
        module.warn(note)
    if not module._diff:
        result.pop("diff")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
