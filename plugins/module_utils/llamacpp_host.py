# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a host has of llama.cpp: a build's binaries and flags, its installed versions, its packages.

:func:`inspect_build` is what the ``llamacpp_info`` module returns about a ``bin`` directory, and the
``llamacpp_build_facts`` module returns it for the build a host should run (one module run reads all the
llamacpp_build role needs). The rest are parsers of what those modules read: ``dpkg-query``'s status lines,
the Vulkan header's version, the versions under the build root.

Stdlib only: shared by the Ansible modules (module_utils) and ``llamafleet.core.llamacpp_host``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from .constants import RPC_SERVER_BINARIES
from .llama_flags import LLAMA_SERVER_BINARIES, detect_features, pick_binary

# (path, flag) -> the binary's stdout and stderr together; raises BuildInspectError when it fails.
RunFlag = Callable[[str, str], str]
# argv -> (rc, stdout, stderr), as AnsibleModule.run_command answers.
Runner = Callable[[list], tuple]

DPKG_QUERY_FORMAT = "${Package} ${db:Status-Status}\n"
VK_HEADER_VERSION = re.compile(r"^#define VK_HEADER_VERSION ([0-9]+)\s*$", re.M)


class BuildInspectError(Exception):
    """A build's bin directory that cannot be read as a llama.cpp build; the message says why."""


def inspect_build(bin_dir: str, names: Iterable[str], run: RunFlag,
                  require: Sequence[str] = ()) -> dict[str, Any]:
    """The binaries of ``bin_dir`` (``names``: its executables) and the flags their ``--help`` shows.

    ``require`` (``llama_server``, ``rpc_server``) names the binaries that must be there.
    """
    names = list(names)
    server_name = pick_binary(names, LLAMA_SERVER_BINARIES)
    rpc_name = pick_binary(names, RPC_SERVER_BINARIES)
    missing = [what for what, found in (("llama_server", server_name), ("rpc_server", rpc_name))
               if what in require and not found]
    if missing:
        raise BuildInspectError("%s has no %s (looked for %s)" % (
            bin_dir, " and no ".join(missing),
            ", ".join((LLAMA_SERVER_BINARIES if m == "llama_server" else RPC_SERVER_BINARIES)[0] for m in missing)))
    server_path = os.path.join(bin_dir, server_name) if server_name else None
    rpc_path = os.path.join(bin_dir, rpc_name) if rpc_name else None
    try:
        features = detect_features(
            server_help=run(server_path, "--help") if server_path else None,
            rpc_help=run(rpc_path, "--help") if rpc_path else None,
            version_text=run(server_path, "--version") if server_path else None,
        )
    except ValueError as exc:  # llama_flags.FlagError
        raise BuildInspectError(str(exc)) from exc
    version = features["version"] or {}
    return {
        "bin_dir": bin_dir,
        "llama_server": server_name,
        "llama_server_path": server_path,
        "rpc_server": rpc_name,
        "rpc_server_path": rpc_path,
        "features": features,
        "version": version.get("version") or (str(version["build"]) if version.get("build") else None),
        "commit": version.get("commit"),
    }


def flag_runner(run: Runner) -> RunFlag:
    """A RunFlag over ``run``: a binary that exits non-zero is a BuildInspectError naming it."""
    def output(path: str, flag: str) -> str:
        # rpc-server prints its usage to stderr; llama-server --version prints to stderr too.
        rc, out, err = run([path, flag])
        if rc != 0:
            raise BuildInspectError("%s %s failed (rc=%d): %s" % (path, flag, rc, (err or out).strip()[-500:]))
        return out + err
    return output


def executables(bin_dir: str) -> list[str]:
    """The names in ``bin_dir`` this user may run; BuildInspectError when it is no directory."""
    if not os.path.isdir(bin_dir):
        raise BuildInspectError("bin_dir %s is not a directory (build llama.cpp first)" % bin_dir)
    return [n for n in os.listdir(bin_dir) if os.access(os.path.join(bin_dir, n), os.X_OK)]


def inspect_bin_dir(bin_dir: str, run: Runner, require: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`inspect_build` of a directory on this host, running its binaries with ``run``."""
    return inspect_build(bin_dir, executables(bin_dir), flag_runner(run), require)


def dpkg_query_argv(packages: Sequence[str]) -> list[str]:
    """``dpkg-query`` asking each package's status, one ``<name> <status>`` line each."""
    return ["dpkg-query", "-W", "-f=" + DPKG_QUERY_FORMAT, "--"] + list(packages)


def parse_dpkg_status(text: str, packages: Iterable[str]) -> dict[str, Optional[str]]:
    """Each asked package -> its dpkg status (``installed``, ``config-files``, ...), None when dpkg knows none.

    Multi-arch packages answer once per architecture (``libgomp1:amd64``); one installed line counts.
    """
    status: dict[str, Optional[str]] = {name: None for name in packages}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        name = fields[0].split(":", 1)[0] if fields[0] not in status else fields[0]
        if name in status and status[name] != "installed":
            status[name] = fields[1]
    return status


def missing_packages(wanted: Iterable[str], status: Mapping[str, Optional[str]]) -> list[str]:
    """The wanted packages that are not installed (a package never asked counts as missing)."""
    return [name for name in wanted if status.get(name) != "installed"]


def vulkan_header_version(text: str) -> int:
    """``VK_HEADER_VERSION`` of a ``vulkan_core.h``; 0 when the text has none."""
    match = VK_HEADER_VERSION.search(text)
    return int(match.group(1)) if match else 0


def version_dirs(root: str, entries: Iterable[tuple[str, bool, float]]) -> list[dict[str, Any]]:
    """The directories under the build root (``entries``: name, is a directory (not a link), mtime), newest first.

    Hidden names are left out; a link (``current``) is no version.
    """
    found = [{"path": os.path.join(root, name), "mtime": mtime}
             for name, is_dir, mtime in entries if is_dir and not name.startswith(".")]
    return sorted(found, key=lambda d: (-d["mtime"], d["path"]))
