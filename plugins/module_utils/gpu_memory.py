# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The memory a llama.cpp service may really use on a host: /proc/meminfo and the cgroup limits above it.

Inside a container (systemd-nspawn, a Kubernetes pod) or under a systemd ``MemoryMax=``, ``/proc/meminfo`` shows
the whole machine, while the kernel kills the service once its cgroup, or any cgroup above it, reaches its limit.
So the CPU device's figures are the tighter of the two:

* ``MemAvailable`` plus what the service itself already holds (a second deploy must see the memory its own
  rpc-server or llama-server occupies as its own, or the plan would shrink each time);
* for every cgroup above the service's unit (``<systemd root>/system.slice`` and each ancestor up to the top of the
  hierarchy this host can see): its limit minus what the others in it use. "In use" is the charge less the page
  cache the kernel can drop (``active_file`` + ``inactive_file``), as a model file read through the cache is.

cgroup v2: ``memory.max`` and ``memory.high`` (the tighter), ``memory.current``, ``memory.stat``. cgroup v1 (a host
still on the legacy or hybrid hierarchy, whose nspawn containers are too): ``memory.limit_in_bytes``,
``memory.usage_in_bytes`` and ``memory.stat``'s ``total_active_file``/``total_inactive_file``. The service's unit
is ``<systemd root>/system.slice/<unit>``; the systemd root is PID 1's cgroup less ``/init.scope`` (``/`` inside a
container with its own cgroup namespace, the container's path on a host without one).

Parsing is pure (:func:`parse_proc_cgroup`, :func:`parse_limit`, :func:`parse_stat_file_bytes`,
:func:`memory_figures`); :func:`read_memory_limits` reads a host through a ``read_text(path)`` callable.
Stdlib only: shared by the gpu_facts module and ``llamafleet.core.gpu_memory``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .gpu_devices import override_matches

MIB = 1024 * 1024
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages); anything this large
# is no limit on any machine.
NO_LIMIT_BYTES = 1 << 60
CGROUP_ROOT = "/sys/fs/cgroup"
SYSTEM_SLICE = "system.slice"

ReadText = Callable[[str], Optional[str]]

# (limit files in order, charge file, the memory.stat keys of reclaimable page cache) per hierarchy
_FILES = {
    "cgroup2": (("memory.max", "memory.high"), "memory.current", ("active_file", "inactive_file")),
    "cgroup1": (("memory.limit_in_bytes",), "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
}


def parse_proc_cgroup(text: str) -> dict[str, str | None]:
    """``/proc/PID/cgroup``: ``{"cgroup2": path of the unified line, "cgroup1": path of the v1 memory controller}``."""
    found: dict[str, str | None] = {"cgroup2": None, "cgroup1": None}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found["cgroup2"] = path
        elif "memory" in controllers.split(","):
            found["cgroup1"] = path
    return found


def parse_limit(text: str | None) -> int | None:
    """A limit file's bytes; None for ``max``, a v1 "no limit", an empty or unreadable file."""
    value = (text or "").strip()
    if not value.isdigit():
        return None
    number = int(value)
    return None if number >= NO_LIMIT_BYTES else number


def parse_count(text: str | None) -> int | None:
    """A charge file's bytes (``memory.current``, ``memory.usage_in_bytes``), None when unreadable."""
    value = (text or "").strip()
    return int(value) if value.isdigit() else None


def parse_stat_file_bytes(text: str | None, keys: Sequence[str]) -> int:
    """The sum of ``keys`` in a ``memory.stat`` (the page cache the kernel can drop); 0 when absent."""
    total = 0
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in keys and parts[1].isdigit():
            total += int(parts[1])
    return total


def systemd_root(init_cgroup: str) -> str:
    """The cgroup systemd manages as its root, from PID 1's path (systemd puts itself in ``init.scope``)."""
    path = init_cgroup.rstrip("/") or "/"
    if path.endswith("/init.scope"):
        path = path[:-len("/init.scope")] or "/"
    return path


def ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["/a/b", "/a", "/"]``."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:n]) if n else "/" for n in range(len(parts), -1, -1)]


def _join(root: str, path: str) -> str:
    return (root.rstrip("/") + "/" + path.strip("/")).rstrip("/") if path.strip("/") else root.rstrip("/")


def _hierarchy(read_text: ReadText, self_paths: dict[str, str | None], root: str) -> tuple[str | None, str]:
    """Which hierarchy holds the memory controller, and where it is mounted."""
    controllers = read_text(_join(root, "cgroup.controllers"))
    if self_paths["cgroup2"] is not None and controllers is not None and "memory" in controllers.split():
        return "cgroup2", root
    if self_paths["cgroup1"] is not None:
        return "cgroup1", _join(root, "memory")
    return None, root


def read_cgroup(read_text: ReadText, mount: str, path: str, hierarchy: str) -> dict[str, Any]:
    """One cgroup's limit (the tightest of its limit files), charge and reclaimable page cache, in bytes."""
    limit_files, charge_file, cache_keys = _FILES[hierarchy]
    folder = _join(mount, path)
    entry: dict[str, Any] = {"path": path, "limit_bytes": None, "limit_file": None,
                             "current_bytes": parse_count(read_text(folder + "/" + charge_file)), "cache_bytes": 0}
    for name in limit_files:
        limit = parse_limit(read_text(folder + "/" + name))
        if limit is not None and (entry["limit_bytes"] is None or limit < entry["limit_bytes"]):
            entry.update(limit_bytes=limit, limit_file=name)
    entry["cache_bytes"] = parse_stat_file_bytes(read_text(folder + "/memory.stat"), cache_keys)
    return entry


def in_use(entry: dict[str, Any]) -> int:
    """Bytes charged to a cgroup that the kernel cannot simply drop (charge less reclaimable page cache)."""
    return max(int(entry.get("current_bytes") or 0) - int(entry.get("cache_bytes") or 0), 0)


def read_memory_limits(read_text: ReadText, units: Sequence[str] = (), root: str = CGROUP_ROOT) -> dict[str, Any]:
    """The cgroups above a service's unit on this host, and what the service's own units hold.

    ``units`` are the systemd units of the service (an rpc-server's, llama-server's); their cgroups are
    ``<systemd root>/system.slice/<unit>``. Without units, the chain starts at this process's own cgroup.
    Returns ``{"hierarchy": "cgroup2" | "cgroup1" | None, "cgroups": [read_cgroup entries, innermost first],
    "own_bytes": what the units hold, "units": [their entries]}``.
    """
    result: dict[str, Any] = {"hierarchy": None, "cgroups": [], "own_bytes": 0, "units": []}
    self_paths = parse_proc_cgroup(read_text("/proc/self/cgroup") or "")
    hierarchy, mount = _hierarchy(read_text, self_paths, root)
    if hierarchy is None:
        return result
    result["hierarchy"] = hierarchy
    init_paths = parse_proc_cgroup(read_text("/proc/1/cgroup") or "")
    base = systemd_root(init_paths[hierarchy] or "/") if units else (self_paths[hierarchy] or "/")
    chain = ancestors(_join(base, SYSTEM_SLICE) if units else base)
    result["cgroups"] = [read_cgroup(read_text, mount, path, hierarchy) for path in chain]
    for unit in units:
        entry = read_cgroup(read_text, mount, _join(_join(base, SYSTEM_SLICE), unit), hierarchy)
        result["units"].append(entry)
        result["own_bytes"] += in_use(entry)
    return result


def _mib(nbytes: int) -> int:
    return int(nbytes // MIB)


def memory_figures(total_mib: int, available_mib: int, limits: dict[str, Any] | None) -> dict[str, Any]:
    """The CPU device's figures from ``/proc/meminfo`` and :func:`read_memory_limits`' answer.

    ``total_mib``: the host's memory, the tighter of MemTotal and every cgroup limit (what a cap may not exceed).
    ``free_mib``: the tighter of MemAvailable and each limited cgroup's limit less the others' use, plus what the
    service's own units hold in each. ``total_source``/``free_source`` say which figure won; ``cgroups`` lists the
    limited cgroups (``path``, ``file``, ``limit_mib``, ``used_mib`` by others, ``headroom_mib``).
    """
    limits = limits or {}
    own = int(limits.get("own_bytes") or 0)
    total, total_source = int(total_mib), "/proc/meminfo MemTotal"
    free, free_source = int(available_mib) + _mib(own), "/proc/meminfo MemAvailable"
    if own:
        free_source += " + %d MiB the service holds" % _mib(own)
    limited = []
    for entry in limits.get("cgroups") or []:
        if entry.get("limit_bytes") is None:
            continue
        where = "cgroup %s %s" % (entry["path"], entry["limit_file"])
        others = max(in_use(entry) - own, 0)
        headroom = max(int(entry["limit_bytes"]) - others, 0)
        limited.append({"path": entry["path"], "file": entry["limit_file"], "limit_mib": _mib(entry["limit_bytes"]),
                        "used_mib": _mib(others), "headroom_mib": _mib(headroom)})
        if _mib(entry["limit_bytes"]) < total:
            total, total_source = _mib(entry["limit_bytes"]), where
        if _mib(headroom) < free:
            free, free_source = _mib(headroom), "%s (%d MiB, %d MiB used by others)" % (
                where, _mib(entry["limit_bytes"]), _mib(others))
    return {"total_mib": total, "total_source": total_source, "free_mib": min(free, total),
            "free_source": free_source, "own_mib": _mib(own), "cgroups": limited,
            "hierarchy": limits.get("hierarchy")}


def memory_max_mib(setting: Any, total_mib: int, reserve_mib: int, max_mib: int | None = None) -> int:
    """The ``MemoryMax=`` of a CPU service unit, MiB (0: none).

    ``setting`` is the role's ``*_memory_max_mib``: ``auto`` is the device's planning ceiling, ``max_mib`` (an
    override's cap) when given, never above the host's memory less the reserve; ``0`` none; a number as given.
    ValueError for anything else.
    """
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        ceiling = max(int(total_mib) - int(reserve_mib or 0), 0)
        return min(int(max_mib), ceiling) if max_mib is not None else ceiling
    if isinstance(setting, bool):
        raise ValueError("expected auto, 0 or a number of MiB, got %r" % (setting,))
    try:
        value = int(str(setting).strip())
    except ValueError:
        raise ValueError("expected auto, 0 or a number of MiB, got %r" % (setting,)) from None
    if value < 0:
        raise ValueError("expected auto, 0 or a number of MiB, got %r" % (setting,))
    return value


def _claims(overrides: Sequence[dict[str, Any]], real: dict[str, Any], variable: str) -> list[str]:
    """Messages for override figures (``free_mib``, ``total_mib``) on the CPU device above what the host has."""
    problems = []
    for position, override in enumerate(overrides or []):
        if not override_matches(override.get("match"), real):
            continue
        for key in ("total_mib", "free_mib"):
            value = override.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > int(real["total_mib"]):
                problems.append("%s[%d].%s is %d MiB, more than this host can give a service: %d MiB (%s); "
                                "lower it or leave it out (max_mib caps without claiming memory)"
                                % (variable, position, key, value, real["total_mib"], real.get("total_source")))
    return problems


def check_memory(devices: Sequence[dict[str, Any]], serves_cpu: bool, setting: Any,
                 overrides: Sequence[dict[str, Any]] | None = None, cpu_reserve_mib: int = 0,
                 setting_name: str = "memory_max_mib", overrides_name: str = "overrides") -> tuple[int, list[str]]:
    """The unit's ``MemoryMax=`` (MiB, 0 for none) and the problems of the memory settings, before any change.

    ``devices`` are gpu_facts' devices before overrides (the CPU entry with its real figures); ``serves_cpu``:
    the unit runs a CPU build (``auto`` gives GPU units no MemoryMax: their weights are in VRAM). Problems: a
    ``setting`` above the host's memory (the tighter of MemTotal and the cgroup limits), an override claiming
    more than that.
    """
    cpus = [d for d in devices if d.get("backend") == "cpu"]
    if not cpus:
        return 0, []
    real = cpus[0]
    cap = None
    for override in overrides or []:
        if override.get("max_mib") is not None and _matches(override, real):
            cap = int(override["max_mib"])
    reserve = cpu_reserve_mib
    for override in overrides or []:
        if override.get("reserve_mib") is not None and _matches(override, real):
            reserve = int(override["reserve_mib"])
    problems = _claims(list(overrides or []), real, overrides_name)
    try:
        limit = memory_max_mib(setting, int(real["total_mib"]), reserve, cap)
    except ValueError as exc:
        return 0, problems + ["%s: %s" % (setting_name, exc)]
    is_auto = isinstance(setting, str) and setting.strip().lower() == "auto"
    if is_auto and not serves_cpu:
        return 0, problems
    if not is_auto and limit > int(real["total_mib"]):
        problems.append("%s is %d MiB, above this host's memory: %d MiB (%s); lower it, auto (the planning figure) "
                        "or 0 (no limit)" % (setting_name, limit, real["total_mib"], real.get("total_source")))
    return limit, problems


def _matches(override: dict[str, Any], dev: dict[str, Any]) -> bool:
    return override_matches(override.get("match"), dev)
