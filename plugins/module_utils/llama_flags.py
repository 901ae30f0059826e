# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Detect what a llama.cpp build supports, and render its command lines.

llama.cpp renames and removes flags between versions (``--no-mmap``/``--mlock``
became ``-lm/--load-mode``; rpc-server lost ``-m/--mem`` and gained
``-d/--device``; the binary was renamed, see ``constants.RPC_SERVER_BINARIES``).
So flags are detected from the build's own ``--help``, never assumed from a
version number, and argv lists are rendered from what was detected. Rendering
returns argv *lists*; ``systemd_unit`` quotes them for ``ExecStart=``.

Stdlib only; shared by the Ansible modules and ``llamafleet.core.llama_flags``.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

from .constants import RPC_SERVER_BINARIES

# Newest name first: the first one found in a prefix's bin/ wins.
LLAMA_SERVER_BINARIES = ("llama-server", "server")

# Feature name -> the flag spellings that provide it (any one is enough).
SERVER_FEATURES: dict[str, tuple[str, ...]] = {
    "rpc": ("--rpc",),
    "tensor_split": ("-ts", "--tensor-split"),
    "split_mode": ("-sm", "--split-mode"),
    "n_gpu_layers": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "device": ("-dev", "--device"),
    "fit": ("-fit", "--fit"),
    "load_mode": ("-lm", "--load-mode"),
    "no_mmap": ("--no-mmap",),
    "mlock": ("--mlock",),
    "metrics": ("--metrics",),
    "api_key_file": ("--api-key-file",),
    "ctx_size": ("-c", "--ctx-size"),
    "parallel": ("-np", "--parallel"),
    "n_predict": ("-n", "--predict", "--n-predict"),
    # A build can have --kv-unified without the negative spelling, which came with automatic slots.
    "kv_unified": ("-kvu", "--kv-unified"),
    "no_kv_unified": ("-no-kvu", "--no-kv-unified"),
    "chat_template": ("--chat-template",),
    "chat_template_file": ("--chat-template-file",),
    # Builds from late 2025 use Jinja by default and have --no-jinja; older ones need --jinja to use it.
    "jinja": ("--jinja",),
    "no_jinja": ("--no-jinja",),
    "alias": ("-a", "--alias"),
    "cache_type_k": ("-ctk", "--cache-type-k"),
    "cache_type_v": ("-ctv", "--cache-type-v"),
    "host": ("--host",),
    "port": ("--port",),
    "log_verbosity": ("-lv", "--verbosity", "--log-verbosity"),
    "list_devices": ("--list-devices",),
}
RPC_FEATURES: dict[str, tuple[str, ...]] = {
    "host": ("-H", "--host"),
    "port": ("-p", "--port"),
    "threads": ("-t", "--threads"),
    "device": ("-d", "--device"),
    "cache": ("-c", "--cache"),
    "mem": ("-m", "--mem"),
}

LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")


class FlagError(ValueError):
    """A requested option cannot be expressed with this build's flags."""


# ---------------------------------------------------------------------------
# --help and --version
# ---------------------------------------------------------------------------

_FLAG_TOKEN = re.compile(r"(?:^|[\s,])(--?[A-Za-z][A-Za-z0-9_+.-]*)")


def parse_help_flags(text: str) -> list[str]:
    """Every flag spelling that a ``--help`` text defines, in order of appearance.

    Option lines start (after at most 8 spaces of indentation) with a flag; the
    flag column ends where a column separator (two or more spaces) is followed
    by something that is not a flag, i.e. the description. Flags that appear
    only inside descriptions ("Complements --cpu-mask-batch") are not counted.
    Works for llama-server's layout (``-c,    --ctx-size N   size of ...``),
    rpc-server's (``  -d, --device <dev1,...>   comma-separated ...``) and the
    older aligned one (``  -m MEM,  --mem MEM   backend memory size``).
    """
    flags: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        stripped = line.strip()
        if indent > 8 or not stripped.startswith("-"):
            continue
        spec_parts = []
        for segment in re.split(r"\s{2,}|\t+", stripped):
            if not segment.startswith("-"):
                break
            spec_parts.append(segment)
        for flag in _FLAG_TOKEN.findall(" ".join(spec_parts)):
            flag = flag.rstrip(",.")
            if flag not in seen:
                seen.add(flag)
                flags.append(flag)
    return flags


def _features(flags: Iterable[str], table: Mapping[str, Sequence[str]]) -> dict[str, bool]:
    present = set(flags)
    return {feature: any(spelling in present for spelling in spellings) for feature, spellings in table.items()}


def server_features(help_text: str) -> dict[str, bool]:
    """Which llama-server features (see ``SERVER_FEATURES``) a ``llama-server --help`` shows."""
    return _features(parse_help_flags(help_text), SERVER_FEATURES)


def rpc_server_features(help_text: str) -> dict[str, bool]:
    """Which rpc-server flags (host, port, threads, device, cache, mem) its ``--help`` shows."""
    return _features(parse_help_flags(help_text), RPC_FEATURES)


_VERSION_NEW = re.compile(r"version:\s*(?P<version>\S+)\s+\(build\s+(?P<build>\d+),\s*commit\s+(?P<commit>[^)\s]+)\)")
_VERSION_OLD = re.compile(r"version:\s*(?P<build>\d+)\s+\((?P<commit>[^)\s]+)\)")
_BUILT_WITH = re.compile(r"built with\s+(?P<compiler>.+?)\s+for\s+(?P<target>.+?)\s*$", re.M)


def parse_version(text: str) -> dict[str, Any]:
    """Parse ``llama-server --version``.

    Current builds print ``version: 0.5.0-dev (build 0, commit unknown)``;
    older ones ``version: 4589 (1a24c462)``. Returns ``{"version", "build",
    "commit", "compiler", "target"}``; ``commit`` is None when the build did
    not know it (built outside a git checkout, e.g. from a release archive).
    """
    info: dict[str, Any] = {"version": None, "build": None, "commit": None, "compiler": None, "target": None}
    match = _VERSION_NEW.search(text)
    if match:
        info["version"] = match.group("version")
        info["build"] = int(match.group("build"))
        info["commit"] = match.group("commit")
    else:
        match = _VERSION_OLD.search(text)
        if not match:
            raise FlagError("not llama.cpp --version output: %r" % text.strip()[:200])
        info["build"] = int(match.group("build"))
        info["commit"] = match.group("commit")
    if info["commit"] == "unknown":
        info["commit"] = None
    built = _BUILT_WITH.search(text)
    if built:
        info["compiler"] = built.group("compiler")
        info["target"] = built.group("target")
    return info


def pick_binary(names: Iterable[str], candidates: Sequence[str] = RPC_SERVER_BINARIES) -> str | None:
    """The first of ``candidates`` among the file ``names`` of a bin directory (None if none)."""
    present = set(names)
    for candidate in candidates:
        if candidate in present:
            return candidate
    return None


def detect_features(server_help: str | None = None, rpc_help: str | None = None,
                    version_text: str | None = None) -> dict[str, Any]:
    """Everything the renderers need to know about one build, from its ``--help``/``--version`` texts.

    Returns ``{"llama_server": {feature: bool}, "rpc_server": {feature: bool},
    "version": {...} | None}``; a side that was not given is an empty dict.
    """
    return {
        "llama_server": server_features(server_help) if server_help is not None else {},
        "rpc_server": rpc_server_features(rpc_help) if rpc_help is not None else {},
        "version": parse_version(version_text) if version_text else None,
    }


# ---------------------------------------------------------------------------
# argv rendering
# ---------------------------------------------------------------------------

def _need(features: Mapping[str, bool], feature: str, what: str, binary: str) -> None:
    if not features.get(feature):
        raise FlagError("%s of this build has no flag for %s (%s): upgrade llama.cpp or do not set it"
                        % (binary, what, "/".join(SERVER_FEATURES.get(feature) or RPC_FEATURES.get(feature, ()))))


def render_rpc_server_argv(binary: str, features: Mapping[str, bool], host: str = "127.0.0.1",
                           port: int = 50052, threads: int | None = None,
                           devices: Sequence[str] | None = None, cache: bool = False) -> list[str]:
    """argv for rpc-server: ``[binary, -H host, -p port, (-t n), (-d A,B), (-c)]``.

    ``features`` is :func:`rpc_server_features` of this binary's ``--help``.
    An option the build lacks raises FlagError rather than being dropped
    (an unknown flag makes rpc-server print its usage and exit 0, which
    systemd would take for a clean stop).
    """
    name = binary.rsplit("/", 1)[-1]
    argv = [binary]
    _need(features, "host", "the bind address", name)
    _need(features, "port", "the port", name)
    argv += ["-H", str(host), "-p", str(int(port))]
    if threads is not None:
        if int(threads) < 1:
            raise FlagError("rpc-server threads must be at least 1, got %r" % (threads,))
        _need(features, "threads", "CPU threads", name)
        argv += ["-t", str(int(threads))]
    if devices:
        _need(features, "device", "choosing devices", name)
        bad = [d for d in devices if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", str(d))]
        if bad:
            raise FlagError("rpc-server device names %s are not llama.cpp device names (e.g. CUDA0, Vulkan1)"
                            % ", ".join(repr(b) for b in bad))
        argv += ["-d", ",".join(str(d) for d in devices)]
    if cache:
        _need(features, "cache", "the local tensor cache", name)
        argv.append("-c")
    return argv


def load_mode_args(load_mode: str | None, features: Mapping[str, bool]) -> list[str]:
    """Flags for a load mode: ``-lm MODE`` on builds that have it, else the older
    ``--no-mmap``/``--mlock`` equivalents. ``auto`` or None renders nothing."""
    if load_mode in (None, "", "auto"):
        return []
    if load_mode not in LOAD_MODES:
        raise FlagError("load_mode %r is not one of %s" % (load_mode, ", ".join(LOAD_MODES)))
    if features.get("load_mode"):
        return ["-lm", load_mode]
    legacy = {
        "mmap": [],
        "none": ["--no-mmap"],
        "mlock": ["--no-mmap", "--mlock"],
        "mmap+mlock": ["--mlock"],
    }
    if load_mode not in legacy:
        raise FlagError("load_mode %r needs -lm/--load-mode, which this llama-server lacks" % load_mode)
    args = legacy[load_mode]
    for flag in args:
        if not features.get(flag.lstrip("-").replace("-", "_")):
            raise FlagError("load_mode %r needs %s, which this llama-server lacks" % (load_mode, flag))
    return list(args)


def kv_unified_args(kv_unified: bool | None, slots: int, features: Mapping[str, bool], binary: str) -> list[str]:
    """``--kv-unified`` or ``--no-kv-unified`` for ``slots`` server slots, or nothing.

    Nothing for one slot (both layouts are then one stream of ``-c`` cells) or
    a plan that does not say (older plans). A unified cache on a build without
    ``--kv-unified`` raises FlagError naming ``llama_server_kv_unified``. A cache
    per slot is rendered explicitly where the build can say so; builds without
    ``--no-kv-unified`` only unify when asked.
    """
    if kv_unified is None or slots <= 1:
        return []
    if kv_unified:
        if not features.get("kv_unified"):
            raise FlagError("llama_server_kv_unified (kv_unified) asks for one KV cache shared by the %d slots, but "
                            "%s of this build has no --kv-unified: upgrade llama.cpp, or set llama_server_kv_unified "
                            "false (each slot then gets ctx_size / %d tokens)" % (slots, binary, slots))
        return ["--kv-unified"]
    return ["--no-kv-unified"] if features.get("no_kv_unified") else []


def chat_template_args(template: str | None, jinja: bool | None, template_file: str | None,
                       features: Mapping[str, bool], name: str = "llama-server") -> list[str]:
    """llama-server's chat template flags on this build.

    ``jinja`` True renders ``--jinja`` (Jinja templates: the model's own, or ``template_file``); False renders
    ``--no-jinja`` where the build has it (older builds do without Jinja unless told), None leaves the build's
    default. ``template`` is a built-in template's name (``--chat-template``), ``template_file`` a Jinja
    template file (``--chat-template-file``, which needs Jinja); at most one of them.
    """
    if template and template_file:
        raise FlagError("llama_server_chat_template (%s) and llama_server_chat_template_file (%s) both name a "
                        "template: set one of them" % (template, template_file))
    if template_file and jinja is False:
        raise FlagError("llama_server_chat_template_file (%s) is a Jinja template, and llama_server_jinja is false: "
                        "set llama_server_jinja true, or name a built-in template in llama_server_chat_template"
                        % template_file)
    argv: list[str] = []
    if jinja:
        _need(features, "jinja", "Jinja chat templates (llama_server_jinja)", name)
        argv.append("--jinja")
    elif jinja is False and features.get("no_jinja"):
        argv.append("--no-jinja")
    return argv + _valued_flags(features, name, ("chat_template", "--chat-template", template, "the chat template"),
                                ("chat_template_file", "--chat-template-file", template_file,
                                 "a chat template file (llama_server_chat_template_file)"))


def _valued_flags(features: Mapping[str, bool], name: str, *items: tuple[str, str, Any, str]) -> list[str]:
    """``[flag, value]`` for each ``(feature, flag, value, what)`` whose value is set, the build checked for it."""
    argv: list[str] = []
    for feature, flag, value, what in items:
        if value:
            _need(features, feature, what, name)
            argv += [flag, str(value)]
    return argv


def render_llama_server_argv(binary: str, plan: Mapping[str, Any], features: Mapping[str, bool],
                             model_path: str | Sequence[str], host: str = "127.0.0.1", port: int = 8080,
                             ctx_size: int | None = None, n_parallel: int | None = None,
                             metrics: bool = False, api_key_file: str | None = None,
                             chat_template: str | None = None, load_mode: str | None = None,
                             pin_devices: bool = False, log_verbosity: int | None = None,
                             extra_args: Sequence[str] = (), alias: str | None = None,
                             jinja: bool | None = None, chat_template_file: str | None = None) -> list[str]:
    """argv for the orchestrator's llama-server running ``plan`` (from :func:`split_plan.plan_split`).

    Renders ``-m``, ``--rpc`` (before ``--device``, which names RPC devices
    that only exist once ``--rpc`` has connected), ``-ngl``, ``-sm layer``,
    ``-ts`` and, on builds that have it, ``--fit off`` (the plan sets the split;
    ``--fit`` would otherwise probe every device over the network first). A
    plan without ``tensor_split`` (split policy fit) renders neither ``-ngl``,
    ``-ts`` nor ``--fit off``, so llama.cpp's own fit decides.
    ``ctx_size``/``n_parallel`` default to the plan's; the plan's ``kv_unified``
    renders as :func:`kv_unified_args` says, its ``max_tokens`` (above 0) as
    ``-n``. With ``pin_devices``,
    ``--device`` lists the plan's devices so the order cannot drift (only use
    it when the local device names in the plan match the build's backend).
    ``log_verbosity`` renders ``-lv N`` (4 shows the devices and buffer sizes,
    5 also the layer each device holds; see log_parse). ``alias`` renders
    ``--alias`` (the model's id in ``/v1/models``, which clients may send);
    ``jinja`` and ``chat_template_file`` as :func:`chat_template_args` says.
    """
    name = binary.rsplit("/", 1)[-1]
    model = model_path if isinstance(model_path, str) else model_path[0]
    argv = [binary, "-m", str(model)]
    if plan.get("rpc"):
        _need(features, "rpc", "RPC workers", name)
        argv += ["--rpc", ",".join(plan["rpc"])]
    if pin_devices:
        _need(features, "device", "pinning devices", name)
        argv += ["--device", ",".join(plan["device_names"])]
    planned = plan.get("tensor_split") is not None  # None: policy fit, llama.cpp's --fit sets -ngl and -ts
    if not planned and not features.get("fit"):
        raise FlagError("split policy fit needs --fit, which %s lacks: choose another split policy" % name)
    if planned:
        _need(features, "n_gpu_layers", "GPU layers", name)
        argv += ["-ngl", str(int(plan["ngl"]))]
    if features.get("split_mode"):
        argv += ["-sm", plan.get("split_mode", "layer")]
    if planned and len(plan["devices"]) > 1:
        _need(features, "tensor_split", "the tensor split", name)
        argv += ["-ts", ",".join(_number(v) for v in plan["tensor_split"])]
    if planned and features.get("fit"):
        argv += ["--fit", "off"]
    _need(features, "ctx_size", "the context size", name)
    argv += ["-c", str(int(plan["ctx_size"] if ctx_size is None else ctx_size))]
    slots = plan.get("n_parallel") if n_parallel is None else n_parallel
    if slots is not None:
        _need(features, "parallel", "server slots", name)
        argv += ["-np", str(int(slots))]
        argv += kv_unified_args(plan.get("kv_unified"), int(slots), features, name)
    if plan.get("max_tokens"):
        _need(features, "n_predict", "a bound on generations without max_tokens (llama_server_max_tokens)", name)
        argv += ["-n", str(int(plan["max_tokens"]))]
    for key, flag in (("cache_type_k", "-ctk"), ("cache_type_v", "-ctv")):
        value = plan.get(key)
        if value and value != "f16":
            _need(features, key, "the KV cache type", name)
            argv += [flag, value]
    argv += ["--host", str(host), "--port", str(int(port))]
    if metrics:
        _need(features, "metrics", "the metrics endpoint", name)
        argv.append("--metrics")
    argv += _valued_flags(features, name, ("api_key_file", "--api-key-file", api_key_file, "an API key file"),
                          ("alias", "--alias", alias, "a model alias (llama_server_alias)"))
    argv += chat_template_args(chat_template, jinja, chat_template_file, features, name)
    argv += load_mode_args(load_mode, features)
    if log_verbosity is not None:
        _need(features, "log_verbosity", "the log verbosity", name)
        argv += ["-lv", str(int(log_verbosity))]
    argv += [str(a) for a in extra_args]
    return argv


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
