# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""llamafleet.cluster.await_progress (its documentation: plugins/modules/await_progress.py).

Waits on the controller for an async job or an HTTP answer on the host, with one progress line every few seconds
instead of a task that retries (and prints each retry); fails naming the host and the variable of the timeout.
"""

from __future__ import annotations

import shlex
import time
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.llamafleet.cluster.plugins.module_utils.await_progress import (
    SAFE_GLOB,
    answer_of,
    duration,
    failure_message,
    job_failed,
    job_timed_out,
    parse_records,
    phase_of,
    pick_estimate,
    progress_line,
    timeout_message,
    transfer_of,
)

display = Display()

# A job gets this much longer than its timeout: Ansible's async wrapper stops it at the timeout, and says so.
JOB_GRACE = 30

ARGUMENT_SPEC = dict(
    what=dict(type="str", required=True),
    jid=dict(type="str"),
    url=dict(type="str"),
    status_code=dict(type="list", elements="int", default=[200]),
    validate_certs=dict(type="bool", default=True),
    request_timeout=dict(type="int", default=10),
    timeout=dict(type="int", required=True),
    timeout_var=dict(type="str", default=""),
    poll=dict(type="int", default=5),
    every=dict(type="int", default=30),
    phase_log=dict(type="str"),
    phase_marker=dict(type="str", default="==> "),
    progress_file=dict(type="str"),
    host=dict(type="str"),
    estimate=dict(type="float"),
    history=dict(type="str"),
    history_match=dict(type="dict", default={}),
    history_key=dict(type="str", default="build_seconds"),
    diagnose=dict(type="list", elements="str"),
    hint=dict(type="str", default=""),
)


class ActionModule(ActionBase):
    """Wait for a job or a URL on the host, showing progress."""

    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        _validated, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC,
                                                       mutually_exclusive=[("jid", "url")],
                                                       required_one_of=[("jid", "url")])
        host = task_vars.get("inventory_hostname", "")
        host = args["host"] or self._task.delegate_to or host
        if args["timeout"] <= 0 or args["poll"] <= 0 or args["every"] <= 0:
            raise AnsibleActionFail("%s: timeout, poll and every must be positive (timeout %s, set by %s)"
                                    % (host, args["timeout"], args["timeout_var"] or "timeout"))
        if self._task.check_mode:
            result.update(skipped=True, changed=False,
                          msg="check mode: %s would be awaited (up to %s)" % (args["what"], duration(args["timeout"])))
            return result
        try:
            result.update(self._wait(host, args, task_vars))
        finally:
            self.cleanup()
        return result

    def _wait(self, host: str, args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        estimate = args["estimate"] or self._estimate(args)
        deadline = args["timeout"] + (JOB_GRACE if args["jid"] else 0)
        start = time.monotonic()
        shown = None
        while True:
            done, state, last = self._check(args, task_vars)
            elapsed = time.monotonic() - start
            if done:
                break
            if elapsed >= deadline:
                raise AnsibleActionFail(timeout_message(host, args["what"], args["timeout"], args["timeout_var"],
                                                        last, args["hint"], self._diagnose(args)))
            if shown is None:
                shown = time.monotonic()
                display.display("%s: %s: waiting up to %s (%s)%s" % (
                    host, args["what"], duration(args["timeout"]), args["timeout_var"] or "timeout",
                    ", the last run took %s" % duration(estimate) if estimate else ""))
            elif time.monotonic() - shown >= args["every"]:
                shown = time.monotonic()
                display.display(progress_line(host, args["what"], elapsed, self._phase(args) or last, estimate))
            time.sleep(min(args["poll"], max(deadline - elapsed, 0.1)))
        state.update(elapsed=round(elapsed, 1), estimate=estimate)
        if args["jid"] and job_timed_out(state):
            raise AnsibleActionFail(timeout_message(host, args["what"], args["timeout"], args["timeout_var"],
                                                    self._phase(args) or "", args["hint"], self._diagnose(args)))
        if args["jid"] and job_failed(state):
            failed = dict(state, failed=True, changed=False)
            failed["msg"] = failure_message(host, args["what"], state, elapsed, args["hint"], self._diagnose(args))
            return failed
        if shown is not None:
            display.display("%s: %s: done in %s" % (host, args["what"], duration(elapsed)))
        return state

    def _check(self, args: dict[str, Any], task_vars: dict[str, Any]) -> tuple[bool, dict[str, Any], str]:
        """(done, what the host said, the last state in words)."""
        if args["jid"]:
            async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))
            job = self._execute_module(module_name="ansible.legacy.async_status", task_vars=task_vars,
                                       module_args={"jid": args["jid"], "_async_dir": async_dir})
            if job.get("failed") and job.get("msg") == "could not find job":
                job["msg"] = "no async job %s on the host (its status file is gone)" % args["jid"]
            job = {k: v for k, v in job.items()
                   if not k.startswith("_ansible") and k not in ("results_file", "exception")}
            return bool(job.get("finished")), job, "running"
        answer = self._execute_module(module_name="ansible.legacy.uri", task_vars=task_vars,
                                      module_args={"url": args["url"], "status_code": args["status_code"],
                                                   "validate_certs": args["validate_certs"],
                                                   "timeout": args["request_timeout"], "return_content": True})
        status = answer.get("status", -1)
        if status in args["status_code"]:
            return True, {"status": status, "changed": False}, "HTTP %s" % status
        return False, {"status": status}, answer_of(status, str(answer.get("content") or ""),
                                                    str(answer.get("msg") or ""))

    def _shell(self, command: str) -> str:
        """stdout of a read-only shell command on the host ("" when it fails)."""
        res = self._low_level_execute_command(command)
        return res.get("stdout", "") if res.get("rc") == 0 else ""

    def _phase(self, args: dict[str, Any]) -> str | None:
        if args["progress_file"]:
            transfer = transfer_of(self._shell("cat %s" % shlex.quote(args["progress_file"])))
            if transfer or not args["phase_log"]:
                return transfer
        if not args["phase_log"]:
            return None
        return phase_of(self._shell("tail -c 8192 %s" % shlex.quote(args["phase_log"])), args["phase_marker"])

    def _estimate(self, args: dict[str, Any]) -> float | None:
        glob = args["history"]
        if not glob:
            return None
        if not SAFE_GLOB.match(glob):
            display.vvv("await_progress: no estimate, history %r has characters other than _./*?@+-" % glob)
            return None
        text = self._shell('for f in %s; do [ -f "$f" ] && cat "$f" && echo; done; true' % glob)
        return pick_estimate(parse_records(text), args["history_match"], args["history_key"])

    def _diagnose(self, args: dict[str, Any]) -> str:
        if not args["diagnose"]:
            return ""
        res = self._low_level_execute_command(shlex.join(args["diagnose"]))
        return ("%s:\n%s" % (shlex.join(args["diagnose"]), (res.get("stdout", "") + res.get("stderr", "")).rstrip()))
