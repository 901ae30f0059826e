# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""llamafleet.cluster.host_files (its documentation: plugins/modules/host_files.py).

Reads each file given by ``src`` on the controller and runs the module once on the host with every file's content:
one round trip for the whole set, where a loop of ``copy`` tasks costs one (or two) per file.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("directories", "files", "absent", "purge"))

    def _content(self, item: dict[str, Any]) -> str:
        src = item["src"]
        path = src if src.startswith("/") else self._find_needle("files", src)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise AnsibleActionFail(f"host_files: cannot read {src} on the controller (for {item.get('dest')}): "
                                    f"{exc.strerror}") from exc
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AnsibleActionFail(f"host_files: {src} is not UTF-8 text (for {item.get('dest')})") from exc

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        files = []
        for item in args.get("files") or []:
            if not isinstance(item, dict):
                raise AnsibleActionFail(f"host_files: each of files must be a dict, got {item!r}")
            item = dict(item)
            if item.get("src") is not None:
                if item.get("content") is not None:
                    raise AnsibleActionFail(f"host_files: {item.get('dest')}: give src or content, not both")
                item["content"] = self._content(item)
                del item["src"]
            files.append(item)
        args["files"] = files
        result.update(self._execute_module(module_name="llamafleet.cluster.host_files", module_args=args,
                                           task_vars=task_vars))
        return result
