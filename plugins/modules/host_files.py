#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Installs a set of small files and their directories on a host in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: host_files
short_description: Install a set of small text files and their directories in one step
version_added: "0.4.0"
description:
  - Makes the given directories and files exist with the given content, owner, group and mode, all in one module run
    on the host, so a deploy that changes nothing pays one round trip for the set instead of one per file (the roles
    install the gate's modules, the host helpers and their package this way).
  - A file is written only when its content differs, through a temporary file in the same directory moved over it,
    so a reader never sees half a file. Owner, group and mode are fixed where they differ.
  - Each file's content is either given (O(files[].content)) or read on the controller from O(files[].src) by the
    action plugin of the same name; files must be UTF-8 text.
  - Supports check mode and diff mode (one diff per changed file).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  directories:
    description: Directories to create (with their parents) or fix, before the files.
    type: list
    elements: dict
    default: []
    suboptions:
      path:
        description: Absolute path of the directory.
        type: path
        required: true
      owner:
        description: Owner of the directory.
        type: str
        default: root
      group:
        description: Group of the directory.
        type: str
        default: root
      mode:
        description: Mode of the directory, as an octal string.
        type: str
        default: "0755"
  files:
    description: Files to install. Their directories must exist or be listed in O(directories).
    type: list
    elements: dict
    default: []
    suboptions:
      dest:
        description: Absolute path of the file on the host.
        type: path
        required: true
      src:
        description: Path of the file on the controller (read by the action plugin). Exactly one of O(files[].src)
          and O(files[].content).
        type: path
      content:
        description: The file's content. Exactly one of O(files[].src) and O(files[].content).
        type: str
      owner:
        description: Owner of the file.
        type: str
        default: root
      group:
        description: Group of the file.
        type: str
        default: root
      mode:
        description: Mode of the file, as an octal string.
        type: str
        default: "0644"
      force:
        description: Replace the file when its content differs. C(false) writes it only where it is missing (owner,
          group and mode are still fixed).
        type: bool
        default: true
      validate:
        description: A command run on the new content before it replaces the file, C(%s) standing for the path of
          that temporary file (as in M(ansible.builtin.copy)); a non-zero exit fails the task and leaves the file as it
          was. Not run in check mode.
        type: str
  absent:
    description: Paths to remove (a file, a link or a whole directory), after the files are written. A path that is
      not there is no change; one that is removed is reported in RV(changed_paths).
    type: list
    elements: path
    default: []
  purge:
    description: Directories whose files matching O(purge[].pattern) are removed unless O(files) lists them (the
      files a set replaces as a whole, such as one per worker), after the files are written; each removal is reported
      in RV(changed_paths). A directory that is not there is skipped.
    type: list
    elements: dict
    default: []
    suboptions:
      path:
        description: Absolute path of the directory.
        type: path
        required: true
      pattern:
        description: Shell pattern of the file names to consider (C(fnmatch)).
        type: str
        default: "*"
author:
  - llamafleet maintainers (@llamafleet)
"""

EXAMPLES = r"""
- name: Install the host package
  llamafleet.cluster.host_files:
    directories:
      - path: /usr/local/lib/llamafleet/llamafleet_host
    files:
      - dest: /usr/local/lib/llamafleet/llamafleet_host/__init__.py
        content: ""
      - dest: /usr/local/lib/llamafleet/llamafleet_host/rpc_proto.py
        src: "{{ role_path }}/../../plugins/module_utils/rpc_proto.py"

- name: Install a checked configuration and remove what is no longer asked for
  llamafleet.cluster.host_files:
    files:
      - dest: /etc/example/config.json
        content: "{{ config | to_nice_json }}"
        validate: /usr/bin/python3 -m json.tool %s
    absent:
      - /etc/example/old-template.jinja
"""

RETURN = r"""
changed_paths:
  description: The directories and files created or changed (content, owner, group or mode) and the paths removed, in
    the order given (directories, files, purge, absent).
  returned: always
  type: list
  elements: str
"""

import fnmatch
import os
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule

DIRECTORY_SPEC = dict(
    path=dict(type="path", required=True),
    owner=dict(type="str", default="root"),
    group=dict(type="str", default="root"),
    mode=dict(type="str", default="0755"),
)
FILE_SPEC = dict(
    dest=dict(type="path", required=True),
    src=dict(type="path"),
    content=dict(type="str"),
    owner=dict(type="str", default="root"),
    group=dict(type="str", default="root"),
    mode=dict(type="str", default="0644"),
    force=dict(type="bool", default=True),
    validate=dict(type="str"),
)
PURGE_SPEC = dict(
    path=dict(type="path", required=True),
    pattern=dict(type="str", default="*"),
)
# Files larger than this are not shown in a diff (the diff says so instead).
DIFF_LIMIT = 64 * 1024


def _attributes(module, path, item):
    return module.load_file_common_arguments(dict(owner=item["owner"], group=item["group"], mode=item["mode"]),
                                             path=path)


def _read(path):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _diff_text(data):
    if data is None:
        return ""
    if len(data) > DIFF_LIMIT:
        return "(%d bytes, not shown)\n" % len(data)
    return data.decode("utf-8", "replace")


def _fix_attributes(module, path, item, changed, diffs):
    """Owner, group and mode put right where they differ; True when anything changed."""
    diff = dict(before={}, after={}, before_header=path, after_header=path)
    changed = module.set_fs_attributes_if_different(_attributes(module, path, item), changed, diff)
    if diff["before"] != diff["after"]:
        diffs.append(diff)
    return changed


def ensure_directory(module, item, diffs):
    path = item["path"]
    changed = False
    if os.path.lexists(path) and not os.path.isdir(path):
        module.fail_json(msg="%s exists and is not a directory (host_files directories)" % path)
    if not os.path.isdir(path):
        changed = True
        diffs.append(dict(before_header=path, after_header=path, before={"state": "absent"},
                          after={"state": "directory"}))
        if module.check_mode:
            return True
        os.makedirs(path)
    return _fix_attributes(module, path, item, changed, diffs)


def ensure_file(module, item, diffs):
    dest = item["dest"]
    if item["content"] is None:
        module.fail_json(msg="%s: give content or src (src is read on the controller by the action plugin)" % dest)
    data = item["content"].encode("utf-8")
    if os.path.isdir(dest):
        module.fail_json(msg="%s is a directory (host_files files)" % dest)
    parent = os.path.dirname(dest)
    current = _read(dest)
    changed = current != data and (item["force"] or current is None)
    if changed:
        diffs.append(dict(before_header=dest, after_header=dest, before=_diff_text(current), after=_diff_text(data)))
    if module.check_mode:
        if changed or not os.path.exists(dest):
            return True
        return module.set_fs_attributes_if_different(_attributes(module, dest, item), False)
    if changed:
        if not os.path.isdir(parent):
            module.fail_json(msg="%s: its directory %s does not exist (list it in host_files directories)"
                             % (dest, parent))
        handle, tmp = tempfile.mkstemp(dir=parent, prefix=".%s." % os.path.basename(dest))
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            module.set_fs_attributes_if_different(_attributes(module, tmp, item), False)
            _validate(module, item, tmp)
            module.atomic_move(tmp, dest, unsafe_writes=False)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return _fix_attributes(module, dest, item, changed, diffs)


def _validate(module, item, tmp):
    command = item["validate"]
    if not command:
        return
    if "%s" not in command:
        module.fail_json(msg="%s: validate must contain %%s (the path of the new content): %s" % (item["dest"], command))
    rc, out, err = module.run_command(command % tmp)
    if rc != 0:
        module.fail_json(msg="%s: the new content failed validation (%s, exit %d): %s"
                         % (item["dest"], command, rc, (err or out).strip()))


def remove_path(module, path, diffs):
    """Removes a file, link or directory tree; True when something was there."""
    if not os.path.lexists(path):
        return False
    is_dir = os.path.isdir(path) and not os.path.islink(path)
    diffs.append(dict(before_header=path, after_header=path,
                      before={"state": "directory" if is_dir else "file"}, after={"state": "absent"}))
    if not module.check_mode:
        if is_dir:
            shutil.rmtree(path)
        else:
            os.unlink(path)
    return True


def purge_paths(directory, pattern, wanted):
    """The files (and links) in ``directory`` whose names match ``pattern`` and that are not ``wanted``, sorted."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if fnmatch.fnmatch(name, pattern) and path not in wanted and not (os.path.isdir(path)
                                                                          and not os.path.islink(path)):
            found.append(path)
    return found


def main():
    module = AnsibleModule(
        argument_spec=dict(
            directories=dict(type="list", elements="dict", default=[], options=DIRECTORY_SPEC),
            files=dict(type="list", elements="dict", default=[], options=FILE_SPEC,
                       mutually_exclusive=[("src", "content")]),
            absent=dict(type="list", elements="path", default=[]),
            purge=dict(type="list", elements="dict", default=[], options=PURGE_SPEC),
        ),
        supports_check_mode=True,
    )
    changed_paths = []
    diffs = []
    for item in module.params["directories"]:
        if ensure_directory(module, item, diffs):
            changed_paths.append(item["path"])
    for item in module.params["files"]:
        if ensure_file(module, item, diffs):
            changed_paths.append(item["dest"])
    wanted = set(item["dest"] for item in module.params["files"])
    for item in module.params["purge"]:
        for path in purge_paths(item["path"], item["pattern"], wanted):
            if remove_path(module, path, diffs):
                changed_paths.append(path)
    for path in module.params["absent"]:
        if remove_path(module, path, diffs):
            changed_paths.append(path)
    result = dict(changed=bool(changed_paths), changed_paths=changed_paths)
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
