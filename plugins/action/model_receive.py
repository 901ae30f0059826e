# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller side of llamafleet.cluster.model_receive (its documentation: plugins/modules/model_receive.py).

Asks the host what it holds of the file, checks its disk, then sends the missing pieces of the controller's verified
copy, a few at a time, and has the host check, write and finally publish them.
"""

from __future__ import annotations

import os
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

from ansible_collections.llamafleet.cluster.plugins.module_utils.cache_share import RECEIVE_OPTIONS, pieces_of
from ansible_collections.llamafleet.cluster.plugins.module_utils.model_share import mib
from ansible_collections.llamafleet.cluster.plugins.plugin_utils.share_transfer import (
    Progress,
    cut,
    module_result,
    put,
    remote_dir,
)

MODULE = "llamafleet.cluster.model_receive"
BATCH_PIECES = 4


class ActionModule(ActionBase):
    """Copy one verified file from the controller to the host, resumably."""

    TRANSFERS_FILES = True
    _supports_check_mode = True

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        _validated, args = self.validate_argument_spec(argument_spec=dict(RECEIVE_OPTIONS, src=dict(type="path", required=True)))
        host = task_vars.get("inventory_hostname", "")
        delegated = self._task.delegate_to or host
        src = os.path.expanduser(args["src"])
        if not os.path.isfile(src) and self._task.check_mode:
            result.update(changed=True, msg="%s would be copied once the controller has fetched it" % src)
            return result
        if not os.path.isfile(src):
            raise AnsibleActionFail("%s: %s is not on the controller: run the model role first" % (delegated, src))
        size = os.path.getsize(src)
        piece = args["piece_mib"] << 20
        if piece <= 0:
            raise AnsibleActionFail("piece_mib must be positive, got %d" % args["piece_mib"])
        base = {k: args[k] for k in ("dest", "sha256", "piece_mib", "owner", "group", "mode")}
        base.update(size=size, src=src)
        try:
            state = module_result(self, MODULE, {**base, "action": "inspect"}, task_vars)
            result.update(changed=state["changed"], sent_bytes=0, seconds=0.0)
            if state["verified"]:
                return result
            need = state["missing_bytes"] + args["free_margin_mib"] * 1048576
            if need > state["free_bytes"]:
                raise AnsibleActionFail("%s: the model file needs %s MiB in %s (+%d MiB margin), %s MiB free; free "
                                        "space or point %s elsewhere" % (delegated, mib(state["missing_bytes"]),
                                                                         os.path.dirname(args["dest"]),
                                                                         args["free_margin_mib"],
                                                                         mib(state["free_bytes"]), args["label"]))
            todo = [p for p in pieces_of(size, piece) if p["index"] in set(state["missing"])]
            result.update(changed=True, sent_bytes=sum(p["size"] for p in todo))
            if self._task.check_mode:
                return result
            result["seconds"] = self._send(delegated, src, base, todo, task_vars)
        finally:
            self.cleanup()
        return result

    def _send(self, host: str, src: str, base: dict[str, Any], todo: list[dict[str, int]],
              task_vars: dict[str, Any]) -> float:
        folder = remote_dir(self, os.path.dirname(base["dest"]))
        progress = Progress(host, os.path.basename(src), sum(p["size"] for p in todo))
        batch: list[dict[str, Any]] = []
        stem = "." + os.path.basename(base["dest"]) + ".piece-"
        for position, piece in enumerate(todo):
            last = position == len(todo) - 1
            local, digest = cut(src, piece["offset"], piece["size"])
            try:
                remote = put(self, local, folder, "%s%d" % (stem, piece["index"]))
            finally:
                os.unlink(local)
            batch.append({"path": remote, "index": piece["index"], "sha256": digest})
            progress.add(piece["size"], force=last)
            if len(batch) >= BATCH_PIECES or last:
                module_result(self, MODULE, {**base, "action": "install", "pieces": batch, "final": last}, task_vars)
                batch = []
        if not todo:  # every piece was there: the .part only needs its check and publishing
            module_result(self, MODULE, {**base, "action": "install", "pieces": [], "final": True}, task_vars)
        return progress.seconds()
