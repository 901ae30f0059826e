# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The systemd units of llama-server and rpc-server: one renderer, one device policy per backend.

Both services get the same hardening. What differs by llama.cpp backend is
which device nodes the service may open, and that is decided in one place,
:func:`device_policy`, from systemd's own rules (systemd.exec(5) and
systemd.resource-control(5), systemd 252):

* ``PrivateDevices=yes`` mounts a private ``/dev`` without physical devices
  and sets ``DevicePolicy=closed``.
* ``ProtectClock=yes`` implies ``DeviceAllow=char-rtc r``; with the default
  ``DevicePolicy=auto`` any ``DeviceAllow=`` entry turns the policy into an
  allow-list (that entry plus the pseudo devices ``/dev/null``, ``/dev/zero``
  ...), which hides ``/dev/nvidia*``, ``/dev/kfd`` and ``/dev/dri``.
* ``DevicePolicy=closed``/``strict`` close it too.
* ``ProtectKernelLogs=``, ``ProtectKernelModules=``, ``ProtectKernelTunables=``,
  ``ProtectControlGroups=`` and ``ProtectHostname=`` imply no device rule
  (ProtectKernelLogs only makes ``/dev/kmsg`` and ``/proc/kmsg`` inaccessible).

So a CPU build gets ``PrivateDevices=yes`` and ``ProtectClock=yes``; a GPU
build gets neither and no ``DeviceAllow=``: its device policy stays open, so
its GPUs are reachable whatever the driver names its nodes or loads them
(an allow-list of device groups is resolved when the unit starts, before
``nvidia-uvm`` may have been loaded). File permissions still apply: the
roles put the service users in ``video`` and ``render`` for ``/dev/dri`` and
``/dev/kfd``. Metal builds run on macOS, which has no systemd (and is not supported).

Stdlib only; shared by the Ansible modules and ``llamafleet.core.systemd_unit``.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from .backends import BACKENDS, LINUX_BACKENDS
from .constants import (DEGRADED_PLANS_DIR, GATE_CONFIG_PATH, GATE_RUNTIME_DIR, GATE_MODULE, HOST_PYTHON,
                        LLAMA_SERVER_UNIT, LLAMA_SERVER_USER, MACOS_UNSUPPORTED, PLAN_DROPIN_PATH, PLAN_REQUEST_PATH, PLAN_SWITCH_UNIT,
                        RPC_CACHE_SUBDIR, RPC_FIREWALL_UNIT, RPC_SERVER_HOME, RPC_SERVER_USER)

# Seconds a live client may wait behind a dead one before the worker's guard restarts rpc-server
# (rpc_guard.DEFAULT_GUARD_STALE; role default rpc_server_guard_stale).
GUARD_STALE = 20
from .llama_flags import FlagError


class UnitError(FlagError):
    """A unit cannot be rendered as asked (a FlagError, so callers of both catch one class)."""


# The device nodes each Linux backend's llama.cpp opens (globs; for the unit's comment and the tests), from
# module_utils/backends.py.
BACKEND_DEVICE_NODES: dict[str, tuple[str, ...]] = {name: BACKENDS[name].device_nodes for name in LINUX_BACKENDS}
# Directives that close the device policy (see the module docstring): only for backends without device nodes.
CLOSED_DEVICE_POLICY = ("PrivateDevices=yes", "ProtectClock=yes")


# The hardening of every llamafleet service (systemd.exec(5)), in the order the units list it: the units of
# llama-server, rpc-server, the gate and the guard take it with their device policy after PrivateTmp=
# (render_systemd_unit); the plan switch (render_plan_switch_units) and the rpc-server metrics writer
# (roles/rpc_server/templates/rpc-metrics.service.j2, through the unit_hardening filter) with their own
# differences, each spelled where the unit is.
HARDENING: tuple[tuple[str, str], ...] = (
    ("NoNewPrivileges", "yes"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "yes"),
    ("PrivateTmp", "yes"),
    ("ProtectKernelTunables", "yes"),
    ("ProtectKernelModules", "yes"),
    ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"),
    ("ProtectHostname", "yes"),
    ("RestrictSUIDSGID", "yes"),
    ("RestrictRealtime", "yes"),
    ("RestrictNamespaces", "yes"),
    ("LockPersonality", "yes"),
    ("SystemCallArchitectures", "native"),
    ("CapabilityBoundingSet", ""),
    ("AmbientCapabilities", ""),
    ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX AF_NETLINK"),
    ("UMask", "0077"),
)


def hardening(values: Mapping[str, str | None] | None = None,
              after: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """:data:`HARDENING` as ``[Service]`` lines, with one unit's differences: ``values`` gives a setting
    another value (None leaves it out), ``after`` adds lines right after a setting's place (left out or
    not). A name that is not in HARDENING raises UnitError."""
    values, after = dict(values or {}), dict(after or {})
    known = [setting[0] for setting in HARDENING]
    unknown = sorted((set(values) | set(after)) - set(known))
    if unknown:
        raise UnitError("not a hardening setting: %s (known: %s)" % (", ".join(unknown), ", ".join(known)))
    lines: list[str] = []
    for key, default in HARDENING:
        value = values.get(key, default)
        if value is not None:
            lines.append("%s=%s" % (key, value))
        lines += [str(line) for line in after.get(key, ())]
    return lines


def device_policy(backend: str | None) -> list[str]:
    """The ``[Service]`` lines that decide which device nodes a llama.cpp ``backend`` build reaches.

    ``cpu`` closes the device policy (:data:`CLOSED_DEVICE_POLICY`); a GPU
    backend, or None (backend not known), keeps every device reachable and
    says so in a comment. ``metal`` and unknown backends raise UnitError.
    """
    if backend in BACKENDS and not BACKENDS[backend].linux:
        raise UnitError("backend %r builds run on macOS, which has no systemd: there is no unit to render; %s"
                        % (backend, MACOS_UNSUPPORTED))
    if backend is not None and backend not in BACKEND_DEVICE_NODES:
        raise UnitError("backend %r has no systemd device policy; expected one of %s"
                        % (backend, ", ".join(sorted(BACKEND_DEVICE_NODES))))
    nodes = BACKEND_DEVICE_NODES[backend] if backend is not None else ()
    if backend is not None and not nodes:
        return list(CLOSED_DEVICE_POLICY)
    reach = " ".join(nodes) if nodes else "every device node (backend not given)"
    return ["# Devices: %s stay reachable: no PrivateDevices=, ProtectClock= or DeviceAllow=, which would "
            "install a device allow-list" % reach]


# ---------------------------------------------------------------------------
# Quoting
# ---------------------------------------------------------------------------

_SYSTEMD_SAFE = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def systemd_quote(arg: str) -> str:
    """Quote one argument for ``ExecStart=`` so systemd passes it through unchanged.

    systemd splits ExecStart on whitespace, honours double quotes with C-style
    backslash escapes, expands ``%`` specifiers and ``$VAR`` references; so
    ``%`` becomes ``%%``, ``$`` becomes ``$$``, and anything outside a
    conservative safe set is double-quoted with ``\\`` and ``"`` escaped.
    """
    text = str(arg).replace("%", "%%").replace("$", "$$")
    if text and _SYSTEMD_SAFE.fullmatch(text):
        return text
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\t", "\\t").replace("\r", "\\r"))
    return '"%s"' % escaped


def systemd_exec(argv: Sequence[str]) -> str:
    """An ExecStart value: the argv quoted for systemd, one option (and its value) per continued line."""
    if not argv:
        raise UnitError("empty argv")
    if not str(argv[0]).startswith("/"):
        raise UnitError("ExecStart needs an absolute path to the binary, got %r" % (argv[0],))
    lines = [systemd_quote(argv[0])]
    i = 1
    while i < len(argv):
        part = [systemd_quote(argv[i])]
        if str(argv[i]).startswith("-") and i + 1 < len(argv) and not str(argv[i + 1]).startswith("-"):
            part.append(systemd_quote(argv[i + 1]))
            i += 1
        lines.append(" ".join(part))
        i += 1
    return " \\\n    ".join(lines)


def _env_assignment(key: str, value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise UnitError("environment variable name %r is not valid" % key)
    text = ("%s=%s" % (key, value)).replace("%", "%%")
    return '"%s"' % text.replace("\\", "\\\\").replace('"', '\\"')


# ---------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------

RESTART_POLICIES = ("no", "always", "on-success", "on-failure", "on-abnormal", "on-abort", "on-watchdog")


def render_systemd_unit(argv: Sequence[str], header: str = "", description: str = "llama.cpp server",
                        user: str = "llamafleet", group: str | None = None,
                        working_directory: str | None = None,
                        read_write_paths: Sequence[str] = (), read_only_paths: Sequence[str] = (),
                        environment: Mapping[str, str] | None = None,
                        after: Sequence[str] = ("network-online.target",),
                        wants: Sequence[str] = ("network-online.target",),
                        requires: Sequence[str] = (),
                        restart: str = "on-failure", restart_sec: int = 5, limit_memlock_infinity: bool = False,
                        exec_start_pre: Sequence[Sequence[str]] = (), comments: Sequence[str] = (),
                        timeout_start_sec: int | None = None, backend: str | None = None,
                        protect_home: str = "yes", wanted_by: str = "multi-user.target",
                        runtime_directory: str | None = None, memory_max_mib: int = 0, limit_nofile: int = 0) -> str:
    """The text of a hardened systemd service unit running ``argv`` from a llama.cpp ``backend`` build.

    ``header`` (e.g. the ansible_managed comment) goes first, verbatim, each
    line made a comment if it is not one; ``comments`` are extra comment lines
    after it. Hardening: NoNewPrivileges, ProtectSystem=strict (write access
    only to ``read_write_paths``), ProtectHome, PrivateTmp, kernel, log,
    cgroup and hostname protection, no capabilities, address families limited
    to IP, UNIX and netlink sockets, and the device policy of ``backend``
    (:func:`device_policy`). ``limit_memlock_infinity`` is for
    ``--mlock``/``-lm mlock``. ``exec_start_pre`` are argv lists run before the
    server (e.g. a wait for the workers). ``runtime_directory`` is a folder
    under /run that systemd creates for the service (owned by ``user``) and
    removes when it stops. ``memory_max_mib`` (0: none) is :func:`memory_limit`'s. ``limit_nofile`` (0:
    systemd's default) is the open files the service may hold (``LimitNOFILE=``, soft and hard).
    """
    if restart not in RESTART_POLICIES:
        raise UnitError("restart %r is not one of %s" % (restart, ", ".join(RESTART_POLICIES)))
    devices = device_policy(backend)
    lines: list[str] = []
    for line in header.splitlines():
        lines.append(line if line.startswith(("#", ";")) or not line.strip() else "# " + line)
    for comment in comments:
        lines.append("# " + " ".join(str(comment).split()))
    lines += ["[Unit]", "Description=%s" % description.replace("\n", " ")]
    for key, units in (("After", after), ("Wants", wants), ("Requires", requires)):
        if units:
            lines.append("%s=%s" % (key, " ".join(units)))
    lines += ["", "[Service]", "Type=simple", "User=%s" % user, "Group=%s" % (group or user)]
    if working_directory:
        if "\n" in working_directory or not working_directory.startswith("/"):
            raise UnitError("working_directory must be an absolute path, got %r" % working_directory)
        lines.append("WorkingDirectory=%s" % working_directory.replace("%", "%%"))
    for key in sorted(environment or {}):
        lines.append("Environment=%s" % _env_assignment(key, str(environment[key])))
    for pre in exec_start_pre:
        lines.append("ExecStartPre=%s" % systemd_exec(pre))
    lines.append("ExecStart=%s" % systemd_exec(argv))
    if timeout_start_sec is not None:
        lines.append("TimeoutStartSec=%d" % int(timeout_start_sec))
    lines += ["Restart=%s" % restart, "RestartSec=%d" % int(restart_sec), ""]
    lines += hardening({"ProtectHome": protect_home}, after={"PrivateTmp": devices})
    for path in read_write_paths:
        lines.append("ReadWritePaths=%s" % systemd_quote(path))
    for path in read_only_paths:
        lines.append("ReadOnlyPaths=%s" % systemd_quote(path))
    if runtime_directory:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", runtime_directory):
            raise UnitError("runtime_directory must be one folder name under /run, got %r" % runtime_directory)
        lines += ["RuntimeDirectory=%s" % runtime_directory, "RuntimeDirectoryMode=0755"]
    if limit_memlock_infinity:
        lines.append("LimitMEMLOCK=infinity")
    if limit_nofile:
        lines.append("LimitNOFILE=%d" % int(limit_nofile))
    lines += memory_limit(memory_max_mib)
    lines += ["", "[Install]", "WantedBy=%s" % wanted_by, ""]
    return "\n".join(lines)


def memory_limit(memory_max_mib: int) -> list[str]:
    """The ``[Service]`` lines of a real memory limit (systemd.resource-control(5)); none for 0.

    ``MemoryMax=``: past it the kernel reclaims the service's page cache, then kills it, so a plan that
    overcommits fails at once, named in the journal, instead of pushing the host into swap or the OOM killer's
    choice of victim. ``MemorySwapMax=0``: rpc-server's weights and KV are anonymous buffers that every token
    reads; swapped out they would make each token wait on the disk, and the limit would no longer be RAM. No
    ``MemoryHigh=``: with no swap it can only throttle those buffers (their pages cannot be reclaimed), stalling
    every token while the usage stays put. (On a host still on the cgroup v1 memory controller systemd applies
    MemoryMax= as memory.limit_in_bytes and ignores MemorySwapMax=.)
    """
    if isinstance(memory_max_mib, bool) or not isinstance(memory_max_mib, int) or memory_max_mib < 0:
        raise UnitError("memory_max_mib is %r, expected a number of MiB (0: no limit)" % (memory_max_mib,))
    if not memory_max_mib:
        return []
    return ["MemoryMax=%dM" % memory_max_mib, "MemorySwapMax=0"]


def render_exec_dropin(argv: Sequence[str], exec_start_pre: Sequence[Sequence[str]] = (), header: str = "",
                       comments: Sequence[str] = ()) -> str:
    """A drop-in that replaces a service's ``ExecStartPre=`` and ``ExecStart=`` (each reset first), the rest of
    the unit kept: how a degraded plan runs llama-server with other workers and another split."""
    lines = [line if line.startswith(("#", ";")) or not line.strip() else "# " + line for line in header.splitlines()]
    lines += ["# " + " ".join(str(comment).split()) for comment in comments]
    lines += ["[Service]", "ExecStartPre="]
    lines += ["ExecStartPre=%s" % systemd_exec(pre) for pre in exec_start_pre]
    lines += ["ExecStart=", "ExecStart=%s" % systemd_exec(argv), ""]
    return "\n".join(lines)


# The plan switch's differences from HARDENING (values, after): root, talking to systemd over its private
# socket alone (AF_UNIX, no network, no devices), writing only the runtime drop-in folder, its files readable
# by all (UMask 0022). It never had the other settings HARDENING adds (kernel logs, hostname, SUID/SGID,
# realtime, ambient capabilities), and its lines keep the order they had before the list was shared: adding
# or moving any would change the unit on every deployed orchestrator.
PLAN_SWITCH_HARDENING: tuple[dict[str, str | None], dict[str, tuple[str, ...]]] = (
    {"ProtectKernelLogs": None, "ProtectHostname": None, "RestrictSUIDSGID": None, "RestrictRealtime": None,
     "AmbientCapabilities": None, "RestrictAddressFamilies": None, "UMask": "0022"},
    {"PrivateTmp": ("PrivateDevices=yes", "PrivateNetwork=yes"),
     "ProtectControlGroups": ("RestrictAddressFamilies=AF_UNIX",),
     "CapabilityBoundingSet": ("ReadWritePaths=-/run/systemd/system",)},
)


def render_plan_switch_units(python: Sequence[str] = HOST_PYTHON, module: str = GATE_MODULE,
                             header: str = "") -> tuple[str, str]:
    """The root service that puts the plan the gate asks for in place, and the path unit that starts it when
    the request changes: (service text, path text). The service may write only the runtime drop-in folder
    and talks to systemd over its private socket (no network)."""
    head = [line if line.startswith(("#", ";")) or not line.strip() else "# " + line for line in header.splitlines()]
    argv = [*python, module, "switch", "--request", PLAN_REQUEST_PATH, "--plans", DEGRADED_PLANS_DIR,
            "--dropin", PLAN_DROPIN_PATH, "--unit", LLAMA_SERVER_UNIT]
    service = head + [
        "# Puts the llama-server plan the serving gate asks for in place (llama_server_degrade).",
        # no ordering against llama-server: its start job may wait for a lost worker, and an ordered start job
        # of the switch would wait behind it
        "[Unit]", "Description=llamafleet: switch llama-server between its full and degraded plans",
        "", "[Service]", "Type=oneshot", "ExecStart=%s" % systemd_exec(argv)]
    service += hardening(*PLAN_SWITCH_HARDENING) + [""]
    path = head + [
        "[Unit]", "Description=llamafleet: watch the serving gate's plan request", "",
        "[Path]", "PathChanged=%s" % PLAN_REQUEST_PATH, "Unit=%s" % PLAN_SWITCH_UNIT, "",
        "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(service), "\n".join(path)


def render_rpc_server_unit(argv: Sequence[str], backend: str, port: int, user: str = RPC_SERVER_USER,
                           home: str = RPC_SERVER_HOME, build_id: str | None = None, firewall: bool = True,
                           header: str = "", environment: Mapping[str, str] | None = None,
                           memory_max_mib: int = 0) -> str:
    """The unit of one rpc-server (``argv`` from ``llama_flags.render_rpc_server_argv``).

    rpc-server writes only its weight cache, ``$LLAMA_CACHE/rpc`` under
    ``home``; it restarts always (it exits when a client's computation fails);
    with ``firewall`` it needs the worker firewall unit up first. ``environment``
    adds variables (e.g. ``GGML_VK_VISIBLE_DEVICES``); ``LLAMA_CACHE`` is the unit's own.
    ``memory_max_mib`` (0: none) is the host RAM it may use (:func:`memory_limit`).
    """
    if "LLAMA_CACHE" in (environment or {}):
        raise UnitError("LLAMA_CACHE is set by the unit (the weight cache under the service's home): "
                        "leave it out of the environment")
    firewall_units = [RPC_FIREWALL_UNIT] if firewall else []
    comments = ["llama.cpp build %s (%s)" % (build_id, backend)] if build_id else []
    return render_systemd_unit(
        argv, header=header, comments=comments,
        description="llama.cpp RPC worker for the llamafleet cluster (port %d)" % int(port),
        user=user, environment=dict(environment or {}, LLAMA_CACHE="%s/%s" % (home.rstrip("/"), RPC_CACHE_SUBDIR)),
        read_write_paths=[home], after=["network-online.target"] + firewall_units, requires=firewall_units,
        restart="always", restart_sec=2, backend=backend, memory_max_mib=memory_max_mib)


# The serving gate's open files (LimitNOFILE=, soft and hard; see GATE_LIMITS_NOTE, which its unit carries).
GATE_LIMIT_NOFILE = 65536
GATE_LIMITS_NOTE = (
    "Limits, on purpose. LimitNOFILE=%d: each client connection holds a descriptor (TLS handshakes" % GATE_LIMIT_NOFILE,
    "and heads still being read included, which max_connections does not all count) and each relayed request",
    "a second one to llama-server; systemd's default soft limit of 1024 ran out near 1,000 idle connections, and",
    "then the watchdog's own /health probe and ss failed too (asyncio polls with epoll: no cost until used).",
    "TasksMax keeps systemd's default (one process: asyncio's resolver threads, and ss, systemctl and the HELLO",
    "probe as children, a few at a time); no MemoryMax (a kill would close the clients' port to everyone:",
    "connection caps bound the gate, not a memory limit).")


def render_gate_unit(python: Sequence[str] = HOST_PYTHON, module: str = GATE_MODULE, config: str = GATE_CONFIG_PATH,
                     user: str = LLAMA_SERVER_USER, header: str = "") -> str:
    """The unit of the orchestrator's serving gate (module_utils/serving_gate.py, the entry point of the gate's
    modules, run as ``python`` + module).

    It runs as llama-server's own user, so it may signal llama-server (its
    only restart action: systemd brings llama-server back), reads the API key
    file for its canary, touches no device (the CPU device policy), writes
    nothing but its state under /run, restarts always, and may hold
    GATE_LIMIT_NOFILE open files (GATE_LIMITS_NOTE says why).
    """
    return render_systemd_unit(
        [*python, module, "--config", config], header=header,
        description="llamafleet serving gate and watchdog in front of llama-server",
        user=user, after=["network-online.target", LLAMA_SERVER_UNIT], restart="always", restart_sec=2,
        backend="cpu", runtime_directory=GATE_RUNTIME_DIR, limit_nofile=GATE_LIMIT_NOFILE,
        comments=["Clients connect here; it forwards to llama-server on loopback and answers 503 at once "
                  "while the cluster cannot serve.", *GATE_LIMITS_NOTE])


def render_rpc_guard_unit(servers: Mapping[int, str], stale: int = GUARD_STALE, python: Sequence[str] = HOST_PYTHON,
                          module: str = GATE_MODULE, user: str = RPC_SERVER_USER, header: str = "") -> str:
    """The unit of a worker's rpc-server guard (``serving_gate guard``, module_utils/rpc_guard.py), watching each
    rpc-server port of ``servers`` (port -> unit). It runs as rpc-server's own user, so it may signal it."""
    if not servers:
        raise UnitError("the guard needs at least one rpc-server (port -> unit)")
    argv = [*python, module, "guard", "--stale", str(int(stale))]
    argv += ["%d=%s" % (int(port), unit) for port, unit in sorted(servers.items())]
    return render_systemd_unit(
        argv, header=header, description="llamafleet guard of the rpc-server worker(s)", user=user,
        after=["network-online.target"] + sorted(servers.values()), restart="always", restart_sec=2, backend="cpu",
        comments=["Restarts an rpc-server that keeps a client waiting %ds behind a connection whose peer is gone."
                  % int(stale)])
