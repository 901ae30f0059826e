# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller side of llamafleet.cluster.rpc_cache_share (its documentation: plugins/modules/rpc_cache_share.py).

Delegated to a worker: works out the worker's share from the manifest of the controller's verified model and the
plan, asks the worker what it holds, checks its disk, sends each missing tensor as a file and has the worker
verify and publish it; or checks the share is there; or prunes what no share needs.
"""

from __future__ import annotations

import os
from typing import Any

from ansible.errors import AnsibleActionFail

from ansible_collections.llamafleet.cluster.plugins.module_utils.cache_share import SHARE_OPTIONS, SHARE_REQUIRED
from ansible_collections.llamafleet.cluster.plugins.module_utils.fnv import hash_ranges
from ansible_collections.llamafleet.cluster.plugins.module_utils.model_share import (
    fleet_shares,
    load_or_build_manifest,
    mib,
    share_entries,
)
from ansible_collections.llamafleet.cluster.plugins.plugin_utils.share_transfer import (
    ControllerSend,
    Progress,
    check_space,
    controller_hasher,
    cut,
    display,
    module_result,
    put,
    remote_dir,
)

MODULE = "llamafleet.cluster.rpc_cache_share"
# Files sent before the worker verifies and publishes them (a stopped run sends these again at most).
BATCH_FILES = 8
BATCH_BYTES = 1 << 30


class ActionModule(ControllerSend):
    """Send, check or prune one worker's share of the model."""

    OPTIONS = SHARE_OPTIONS
    REQUIRED = SHARE_REQUIRED
    WHAT = "the share"

    def target(self, args: dict[str, Any], task_vars: dict[str, Any]) -> str:
        return args["host"]

    def sources(self, args: dict[str, Any]) -> list[str]:
        return args["model"]

    def act(self, host: str, args: dict[str, Any], sources: list[str], task_vars: dict[str, Any]) -> dict[str, Any]:
        return self._act(args, self._share(args, sources), task_vars)

    def _share(self, args: dict[str, Any], model: list[str]) -> dict[str, Any]:
        """The manifest's entries for this worker: ``plan`` (the plan's), ``extra`` (the degraded plans')."""
        helper = controller_hasher(args["hasher"], os.path.join(os.path.dirname(os.path.dirname(model[0])), ".tools"))
        if helper is None:
            display.warning("no llamafleet-fnv1a64 helper or C compiler on the controller: the model's manifest is "
                            "hashed in Python (about 12 MB/s), once")
        manifest, built = load_or_build_manifest(
            model, args["sha256"], args["threshold"],
            hasher=lambda path, ranges: hash_ranges(path, ranges, helper=helper, jobs=os.cpu_count() or 1))
        shares = fleet_shares(manifest, args["plan"], args["workers"], args["degraded"])
        mine = shares.get(args["host"], {"plan": [], "degraded": []})
        names = mine["plan"] + (mine["degraded"] if args["degraded_ahead"] else [])
        entries = share_entries(manifest, names)
        extra = {e["name"] for e in share_entries(manifest, mine["degraded"])} - \
            {e["name"] for e in share_entries(manifest, mine["plan"])}
        return {"manifest": manifest, "built": built, "entries": entries, "model": model,
                "degraded_bytes": sum(e["size"] for e in entries if e["name"] in extra)}

    def _module(self, args: dict[str, Any], task_vars: dict[str, Any], **extra: Any) -> dict[str, Any]:
        base = {"cache_dir": args["cache_dir"], "owner": args["owner"], "group": args["group"]}
        return module_result(self, MODULE, {**base, **extra}, task_vars)

    def _act(self, args: dict[str, Any], share: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        entries = share["entries"]
        out: dict[str, Any] = {
            "changed": False, "share": {e["name"]: e["tensors"] for e in entries},
            "share_bytes": sum(e["size"] for e in entries), "manifest_built": share["built"],
            "present": [], "sent": [], "sent_bytes": 0, "seconds": 0.0, "pruned_files": [], "settled": False,
        }
        host = args["host"]
        if args["state"] == "absent_others":
            pruned = self._module(args, task_vars, action="prune", keep=[e["name"] for e in entries])
            out.update(changed=pruned["changed"], pruned_files=pruned["pruned_files"],
                       pruned_bytes=pruned["pruned_bytes"])
            return out
        listed = [{k: e[k] for k in ("name", "size", "sha256", "tensors")} for e in entries]
        seen = self._module(args, task_vars, action="inspect", entries=listed)
        out["present"] = seen["present"]
        out["settled"] = seen["settled"]
        missing = [e for e in entries if e["name"] in set(seen["missing"])]
        if args["state"] == "checked":
            if missing:
                raise AnsibleActionFail("%s: the rpc-server cache %s lacks %d tensors of its share (%s MiB): %s"
                                        % (host, args["cache_dir"], len(missing), mib(sum(e["size"] for e in missing)),
                                           ", ".join(t for e in missing for t in e["tensors"])))
            return out
        if missing:
            check_space(host, "the share", seen["missing_bytes"], seen["free_bytes"], args["cache_dir"],
                        args["free_margin_mib"], "lower the share (%s: false leaves out the degraded plans' %s MiB; "
                        "fewer layers on %s)" % (args["label"], mib(share["degraded_bytes"]), host))
        out["sent"] = [e["name"] for e in missing]
        out["sent_bytes"] = sum(e["size"] for e in missing)
        out["changed"] = bool(missing) or seen["changed"]
        if missing and not self._task.check_mode:
            out["seconds"] = self._send(args, share, missing, seen["incoming"], task_vars)
        return out

    def _send(self, args: dict[str, Any], share: dict[str, Any], missing: list[dict[str, Any]], incoming: str,
              task_vars: dict[str, Any]) -> float:
        folder = remote_dir(self, incoming)
        progress = Progress(args["host"], "rpc-server cache share", sum(e["size"] for e in missing))
        batch: list[dict[str, Any]] = []
        for position, entry in enumerate(missing):
            local, digest = cut(share["model"][entry["file"]], entry["offset"], entry["size"])
            try:
                if digest != entry["sha256"]:
                    raise AnsibleActionFail("%s: the controller's copy of tensor %s has sha256 %s, its manifest %s"
                                            % (args["host"], entry["tensors"][0], digest, entry["sha256"]))
                remote = put(self, local, folder, entry["name"])
            finally:
                os.unlink(local)
            batch.append({"path": remote, **{k: entry[k] for k in ("name", "size", "sha256", "tensors")}})
            progress.add(entry["size"], force=position == len(missing) - 1)
            if len(batch) >= BATCH_FILES or sum(b["size"] for b in batch) >= BATCH_BYTES or \
                    position == len(missing) - 1:
                self._module(args, task_vars, action="install", files=batch, worker_hasher=args["worker_hasher"])
                batch = []
        return progress.seconds()
