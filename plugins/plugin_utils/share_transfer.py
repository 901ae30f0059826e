# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the controller-side action plugins rpc_cache_share and model_receive share: their preamble
(:class:`ControllerSend`: the arguments, the host, the controller's files, the errors), the disk-space check,
cutting byte ranges of the controller's model into files and putting them on the host, a command on the host
that reads a stream of bytes from the controller (:func:`open_stream`), the progress line, and the FNV helper
on the controller.

Controller only (Ansible's connection and display).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from typing import Any

from ansible import constants as C
from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.llamafleet.cluster.plugins.module_utils.fnv import HELPER_NAME, HashError, find_helper
from ansible_collections.llamafleet.cluster.plugins.module_utils.model_share import ShareError, mib
from ansible_collections.llamafleet.cluster.plugins.module_utils.rpc_cache import CacheError

display = Display()
_CHUNK = 8 << 20
# The helper's source, in the collection (the hosts compile the same file in role llamacpp_build).
HELPER_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "roles", "llamacpp_build", "files", HELPER_NAME + ".c")


def controller_hasher(explicit: str | None, cache_dir: str) -> str | None:
    """The FNV helper on the controller: ``explicit``, else ``$LLAMAFLEET_FNV_HELPER`` or PATH, else the
    collection's C source compiled once into ``cache_dir`` with the controller's C compiler; None when there is
    no compiler either (hashing then runs in Python, about 12 MB/s)."""
    try:
        found = find_helper(explicit or None)
    except HashError as exc:
        raise AnsibleActionFail(str(exc)) from None
    if found:
        return found
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler or not os.path.isfile(HELPER_SOURCE):
        return None
    with open(HELPER_SOURCE, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:12]
    target = os.path.join(cache_dir, "%s-%s" % (HELPER_NAME, digest))
    if os.access(target, os.X_OK):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    tmp = "%s.%d.tmp" % (target, os.getpid())
    done = subprocess.run([compiler, "-O2", "-pthread", "-o", tmp, HELPER_SOURCE], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        display.warning("compiling %s on the controller failed (%s); hashing in Python instead"
                        % (HELPER_SOURCE, done.stderr.strip()[-300:]))
        return None
    os.replace(tmp, target)
    return target


class ControllerSend(ActionBase):
    """An action plugin that sends (part of) the controller's verified model to the host it is delegated to.

    :meth:`run` validates the arguments against :attr:`OPTIONS` (and :attr:`REQUIRED`), finds the host and the
    controller's files (:meth:`target`, :meth:`sources`), answers check mode while the controller has not fetched
    them yet, fails when it has not outside check mode, then calls :meth:`act`; its errors name the host.
    """

    TRANSFERS_FILES = True
    _supports_check_mode = True
    OPTIONS: dict[str, dict[str, Any]] = {}
    REQUIRED: tuple[str, ...] = ()
    WHAT = "the model"

    def target(self, args: dict[str, Any], task_vars: dict[str, Any]) -> str:
        """The host the files go to (in errors and progress lines)."""
        return self._task.delegate_to or task_vars.get("inventory_hostname", "")

    def sources(self, args: dict[str, Any]) -> list[str]:
        """The controller's files that are sent."""
        raise NotImplementedError

    def act(self, host: str, args: dict[str, Any], sources: list[str], task_vars: dict[str, Any]) -> dict[str, Any]:
        """The task's result."""
        raise NotImplementedError

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        _validated, args = self.validate_argument_spec(argument_spec=self.OPTIONS)
        unset = [name for name in self.REQUIRED if args.get(name) is None]
        if unset:
            raise AnsibleActionFail("missing required arguments: %s" % ", ".join(unset))
        host = self.target(args, task_vars)
        sources = [os.path.expanduser(p) for p in self.sources(args)]
        missing = [p for p in sources if not os.path.isfile(p)]
        if missing and self._task.check_mode:
            result.update(changed=True, msg="%s: %s is sent once the controller has fetched the model"
                          % (host, self.WHAT))
            return result
        if missing:
            raise AnsibleActionFail("%s: the model is not in the controller's cache (%s): run the model role first"
                                    % (host, ", ".join(missing)))
        try:
            result.update(self.act(host, args, sources, task_vars))
        except (ShareError, CacheError, OSError) as exc:
            raise AnsibleActionFail("%s: %s" % (host, exc)) from None
        finally:
            self.cleanup()
        return result


def check_space(host: str, what: str, missing: int, free: int, folder: str, margin_mib: int, hint: str) -> None:
    """Fail before anything is sent when ``missing`` bytes and the margin do not fit in ``free``."""
    if missing + margin_mib * 1048576 > free:
        raise AnsibleActionFail("%s: %s needs %s MiB in %s (+%d MiB margin), %s MiB free; free space or %s"
                                % (host, what, mib(missing), folder, margin_mib, mib(free), hint))


def ssh_uncompressed(argv: list[Any]) -> list[Any]:
    """An ssh command line without compression and outside the connection's multiplexing master: Ansible's default
    ``ssh_args`` (``-C``) compress, which holds a model's bytes to about 24 MB/s (zlib, one core), and a session
    through the master inherits the master's compression. ssh takes the first value given for an option, so the
    ones put first here win over the same options later on the line."""
    rest = [a for a in argv[1:] if a not in (b"-C", "-C")]
    return [argv[0], b"-o", b"Compression=no", b"-o", b"ControlPath=none", b"-o", b"ControlMaster=no", *rest]


def open_stream(action: Any, command: str) -> subprocess.Popen | None:
    """Start ``command`` on the host (with the task's become) through the connection's own transport, its stdin,
    stdout and stderr (a temporary file, as ``stderr_file``) on the controller, to stream bytes to it; None for a
    connection that cannot (not Ansible's own ssh or local, or a password to type: ssh's or become's), which then runs
    commands one at a time through ``_low_level_execute_command``."""
    conn = action._connection
    transport = conn.transport.rsplit(".", 1)[-1]
    if transport not in ("ssh", "local") or transport == "ssh" and conn.get_option("password"):
        return None
    if transport == "ssh" and not hasattr(conn, "_build_command"):
        return None  # a connection that calls itself ssh but is not Ansible's (Mitogen's, for one)
    ruser, buser = action._get_remote_user(), action.get_become_option("become_user")
    if conn.become and (C.BECOME_ALLOW_SAME_USER or buser != ruser or not any((ruser, buser))):
        command = conn.become.build_become_command(command, conn._shell)
        if conn.become.expect_prompt():
            return None
    shell = action._play_context.executable or "/bin/sh"
    if transport == "local":
        argv = [shell, "-c", command]
    else:  # a connection of its own, uncompressed (see ssh_uncompressed)
        argv = ssh_uncompressed(conn._build_command(conn.get_option("ssh_executable"), "ssh",
                                                    conn.get_option("host") or action._play_context.remote_addr,
                                                    "%s -c %s" % (shell, shlex.quote(command))))
    errors = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
    proc.stderr_file = errors  # type: ignore[attr-defined]
    return proc


def cut(path: str, offset: int, size: int) -> tuple[str, str]:
    """Copy ``size`` bytes at ``offset`` of ``path`` into a temporary file; (its path, the bytes' sha256)."""
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix="llamafleet-piece-")
    try:
        with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
            src.seek(offset)
            left = size
            while left:
                block = src.read(min(_CHUNK, left))
                if not block:
                    raise AnsibleActionFail("%s ended at byte %d, inside the range %d:%d"
                                            % (path, src.tell(), offset, size))
                digest.update(block)
                dst.write(block)
                left -= len(block)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp, digest.hexdigest()


class Progress:
    """One host's transfer: a line ``HOST: what, X of Y MiB (P%), Z MB/s`` at most every ``every`` seconds;
    ``first``: the offset it starts from (a resumed transfer's)."""

    def __init__(self, host: str, what: str, total: int, every: float = 2.0, first: int = 0) -> None:
        self.host, self.what, self.total, self.every, self.first = host, what, total, every, first
        self.done = 0
        self.start = time.monotonic()
        self.last = 0.0

    def add(self, nbytes: int, force: bool = False) -> None:
        self.done += nbytes
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            display.display(self.line())

    def seconds(self) -> float:
        return round(time.monotonic() - self.start, 2)

    def line(self) -> str:
        rate = self.done / max(time.monotonic() - self.start, 1e-6) / 1e6
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return "%s: %s, %.1f of %.1f MiB (%.0f%%), %.1f MB/s" % (self.host, self.what, self.done / 1048576.0,
                                                                 self.total / 1048576.0, pct, rate)


def remote_dir(action: Any, direct: str) -> str:
    """Where files go on the host: ``direct`` (a folder beside their destination) when the connection's user writes
    there itself (no become, or connected as root); else the action's temporary folder, readable by the become user,
    from which the module copies them in."""
    context = action._play_context
    if not context.become or (context.remote_user or "") == "root":
        return direct
    if not action._connection._shell.tmpdir:
        action._make_tmp_path()
    return action._connection._shell.tmpdir


def put(action: Any, local: str, folder: str, name: str) -> str:
    """Put the controller file ``local`` on the host as ``folder/name`` (readable by the become user); its path."""
    remote = action._connection._shell.join_path(folder, name)
    action._connection.put_file(local, remote)
    if folder == action._connection._shell.tmpdir:
        action._fixup_perms2([remote], execute=False)
    return remote


def module_result(action: Any, name: str, args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
    """Run module ``name`` with ``args`` on the host; its result (AnsibleActionFail with its message when it failed)."""
    result = action._execute_module(module_name=name, module_args=args, task_vars=task_vars)
    if result.get("failed"):
        raise AnsibleActionFail(result.get("msg", "%s failed" % name), result=result)
    return result
