# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller side of llamafleet.cluster.model_receive (its documentation: plugins/modules/model_receive.py).

Asks the host what it holds of the file, checks its disk, then streams the controller's verified copy from the
offset the host's ``.part`` is good to, straight into it (module_utils/receive_stream.py on the host writes and
hashes it), and has the module publish it once the whole file has the pinned sha256.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from ansible.errors import AnsibleActionFail

from ansible_collections.llamafleet.cluster.plugins.module_utils import receive_stream
from ansible_collections.llamafleet.cluster.plugins.module_utils.cache_share import RECEIVE_OPTIONS
from ansible_collections.llamafleet.cluster.plugins.plugin_utils.share_transfer import (
    ControllerSend,
    Progress,
    check_space,
    cut,
    display,
    module_result,
    open_stream,
    put,
    remote_dir,
)

MODULE = "llamafleet.cluster.model_receive"
with open(receive_stream.__file__, encoding="utf-8") as _source:
    RECEIVER = _source.read()
BLOCK = 8 << 20


def answers(text: str, host: str) -> list[dict[str, Any]]:
    """The receiver's answers in its output (AnsibleActionFail with its error, naming ``host``)."""
    found = [json.loads(line[len(receive_stream.TAG):]) for line in text.splitlines()
             if line.startswith(receive_stream.TAG)]
    for answer in found:
        if "error" in answer:
            raise AnsibleActionFail("%s: %s" % (host, answer["error"]))
    return found


class ActionModule(ControllerSend):
    """Copy one verified file from the controller to the host, resumably."""

    OPTIONS = dict(RECEIVE_OPTIONS, src=dict(type="path", required=True))
    WHAT = "the model file"

    def sources(self, args: dict[str, Any]) -> list[str]:
        return [args["src"]]

    def act(self, host: str, args: dict[str, Any], sources: list[str], task_vars: dict[str, Any]) -> dict[str, Any]:
        src = sources[0]
        size = os.path.getsize(src)
        if args["piece_mib"] <= 0:
            raise AnsibleActionFail("piece_mib must be positive, got %d" % args["piece_mib"])
        base = {k: args[k] for k in ("dest", "sha256", "piece_mib", "owner", "group", "mode")}
        base.update(size=size, src=src)
        state = module_result(self, MODULE, {**base, "action": "inspect"}, task_vars)
        result = {"changed": state["changed"], "sent_bytes": 0, "seconds": 0.0}
        if state["verified"]:
            return result
        check_space(host, "the model file", state["missing_bytes"], state["free_bytes"],
                    os.path.dirname(args["dest"]), args["free_margin_mib"], "point %s elsewhere" % args["label"])
        result.update(changed=True, sent_bytes=size - state["offset"])
        if self._task.check_mode:
            return result
        command = [state["python"], "-c", RECEIVER, args["dest"] + ".part", str(size), args["sha256"].lower(),
                   str(args["piece_mib"] << 20)]
        progress, last = self._stream(host, src, size, command)
        result.update(sent_bytes=last["offset"] - progress.first, seconds=progress.seconds())
        if not last.get("ok"):
            raise AnsibleActionFail("%s: %s put together has sha256 %s, the pinned one is %s; it was removed and is "
                                    "sent again on the next run" % (host, args["dest"], last.get("sha256"),
                                                                    args["sha256"]))
        result["changed"] = module_result(self, MODULE, {**base, "action": "publish"}, task_vars)["changed"]
        return result

    def _stream(self, host: str, src: str, size: int, command: list[str]) -> tuple[Progress, dict[str, Any]]:
        """Send ``src`` from where the host's ``.part`` is good to; (the progress, the receiver's last answer)."""
        proc = open_stream(self, shlex.join(command + ["stream"]))
        if proc is None:
            return self._ranges(host, src, size, command)
        progress, out = None, ""
        try:
            line = proc.stdout.readline().decode("utf-8", "replace")
            while line and not line.startswith(receive_stream.TAG):
                line = proc.stdout.readline().decode("utf-8", "replace")
            if line:
                progress = self._progress(host, src, size, answers(line, host))
                with open(src, "rb") as handle:
                    handle.seek(progress.first)
                    for block in iter(lambda: handle.read(BLOCK), b""):
                        proc.stdin.write(block)
                        progress.add(len(block))
        except BrokenPipeError:  # the receiver stopped: its answer says why
            pass
        finally:
            if progress is None:
                proc.kill()
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
            out = proc.stdout.read().decode("utf-8", "replace")
            proc.wait()
            proc.stderr_file.seek(0)
            stderr = proc.stderr_file.read().decode("utf-8", "replace").strip()
            proc.stderr_file.close()
        rest = answers(out, host)
        if proc.returncode != 0 or not rest or progress is None:
            raise AnsibleActionFail("%s: the receiver of %s stopped (rc %s): %s"
                                    % (host, command[3], proc.returncode, stderr[-2000:]))
        progress.add(0, force=True)
        return progress, rest[-1]

    def _ranges(self, host: str, src: str, size: int, command: list[str]) -> tuple[Progress, dict[str, Any]]:
        """The same over a connection that cannot stream (paramiko, a password to type): each piece put on the host
        as a file (the connection's own transfer), then fed to the receiver."""
        piece = int(command[-1])
        probe = self._low_level_execute_command(shlex.join(command + ["probe"]))
        progress = self._progress(host, src, size, answers(probe["stdout"], host))
        offset, last = progress.first, {"offset": progress.first}
        folder = remote_dir(self, os.path.dirname(command[3]))
        while offset < size:
            length = min(piece, size - offset)
            local = cut(src, offset, length)[0]
            try:
                remote = shlex.quote(put(self, local, folder, ".%s.at-%d" % (os.path.basename(command[3]), offset)))
            finally:
                os.unlink(local)
            done = self._low_level_execute_command("%s < %s; rc=$?; rm -f %s; exit $rc" % (
                shlex.join(command + ["at:%d" % offset]), remote, remote))
            found = answers(done["stdout"], host)
            if done["rc"] != 0 or len(found) < 2:
                raise AnsibleActionFail("%s: the receiver of %s stopped (rc %s): %s"
                                        % (host, command[3], done["rc"], done["stderr"][-2000:]))
            last = found[-1]
            offset += length
            progress.add(length, force=offset == size)
        return progress, last

    @staticmethod
    def _progress(host: str, src: str, size: int, first: list[dict[str, Any]]) -> Progress:
        if not first:
            raise AnsibleActionFail("%s: the receiver of the model file did not answer" % host)
        progress = Progress(host, os.path.basename(src), size - first[0]["offset"], first=first[0]["offset"])
        if first[0].get("repaired"):
            display.warning("%s: the .part of %s is not what was sent from byte %d on; that part is sent again"
                            % (host, os.path.basename(src), progress.first))
        return progress
