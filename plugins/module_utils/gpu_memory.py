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

What a unit holds is its own cgroup's charge less its page cache. Where the memory controller gives the unit no
cgroup of its own (an nspawn host on a v1 or hybrid machine sees that controller read-only, so systemd inside
cannot make one; a v2 host whose ``system.slice`` has the controller off), it is the resident memory of the
unit's processes instead ("unit RSS"): the PIDs in the unit's ``cgroup.procs`` in the hierarchy where systemd
keeps its units (unified, or v1's ``name=systemd``), each one's ``RssAnon`` + ``RssShmem`` from
``/proc/PID/status`` (``VmRSS`` on kernels before 4.5). Mapped files are left out, as from the charge: they are
page cache the kernel can drop.

Parsing is pure (:func:`parse_proc_cgroup`, :func:`parse_limit`, :func:`parse_stat_file_bytes`,
:func:`parse_status_rss`, :func:`parse_pids`, :func:`memory_figures`); :func:`read_memory_limits` reads a host
through a ``read_text(path)`` callable.
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
MainPid = Callable[[str], int]  # a unit's name -> its MainPID as systemd reports it (0: none)

# (limit files in order, charge file, the memory.stat keys of reclaimable page cache) per hierarchy
_FILES = {
    "cgroup2": (("memory.max", "memory.high"), "memory.current", ("active_file", "inactive_file")),
    "cgroup1": (("memory.limit_in_bytes",), "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
}


def parse_named_cgroup(text: str, name: str = "name=systemd") -> str | None:
    """``/proc/PID/cgroup``: the path in the v1 hierarchy of controller ``name`` (``name=systemd``: systemd's own
    on a legacy or hybrid host; ``""``: the unified hierarchy's line, ``0::``)."""
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        if (parts[0] == "0" and parts[1] == "") if name == "" else name in parts[1].split(","):
            return parts[2]
    return None


def parse_proc_cgroup(text: str) -> dict[str, str | None]:
    """``/proc/PID/cgroup``: ``{"cgroup2": path of the unified line, "cgroup1": path of the v1 memory controller}``."""
    return {"cgroup2": parse_named_cgroup(text, ""), "cgroup1": parse_named_cgroup(text, "memory")}


def parse_pids(text: str | None) -> list[int]:
    """A ``cgroup.procs`` file's process ids."""
    return [int(word) for word in (text or "").split() if word.isdigit()]


def parse_status_rss(text: str | None) -> int | None:
    """The bytes a process holds that are not page cache, from ``/proc/PID/status``: ``RssAnon`` + ``RssShmem``, or
    ``VmRSS`` where the kernel (before 4.5) splits nothing. None without either (a kernel thread, a process gone)."""
    fields = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition(":")
        words = value.split()
        if sep and len(words) == 2 and words[1] == "kB" and words[0].isdigit():
            fields[key.strip()] = int(words[0]) * 1024
    if "RssAnon" in fields:
        return fields["RssAnon"] + fields.get("RssShmem", 0)
    return fields.get("VmRSS")


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


def unit_procs_files(init_cgroup: str, unit: str, root: str = CGROUP_ROOT) -> list[str]:
    """The ``cgroup.procs`` files that may list ``unit``'s processes, from PID 1's ``/proc/1/cgroup``: the unified
    hierarchy at the cgroup root (v2) or at ``unified`` (hybrid), and v1's ``name=systemd`` at ``systemd``."""
    unified = parse_proc_cgroup(init_cgroup)["cgroup2"]
    files = []
    for mount, path in ((root, unified), (_join(root, "unified"), unified),
                        (_join(root, "systemd"), parse_named_cgroup(init_cgroup))):
        if path is not None:
            files.append(_join(mount, _join(_join(systemd_root(path), SYSTEM_SLICE), unit)) + "/cgroup.procs")
    return files


def process_tree(read_text: ReadText, pid: int) -> list[int]:
    """``pid`` and its descendants, by ``/proc/PID/task/PID/children`` (the children its main thread started)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        if current > 0 and current not in found:
            found.add(current)
            todo.extend(parse_pids(read_text("/proc/%d/task/%d/children" % (current, current))))
    return sorted(found)


def read_unit_rss(read_text: ReadText, init_cgroup: str, unit: str, root: str = CGROUP_ROOT,
                  main_pid: MainPid | None = None) -> dict[str, Any]:
    """What ``unit``'s processes hold resident (:func:`parse_status_rss`), for a unit without a memory cgroup.

    The processes are those its ``cgroup.procs`` lists (:func:`unit_procs_files`); where no hierarchy has that file,
    ``main_pid(unit)`` (systemd's ``MainPID``, 0 for none) and its descendants. Returns ``{"unit", "source": "unit
    RSS", "procs_files": the cgroup.procs files read, "main_pid", "pids", "rss_bytes"}``; ``pids`` is empty when
    the unit is not running.
    """
    files, pids, main = [], set(), 0
    for path in unit_procs_files(init_cgroup, unit, root):
        text = read_text(path)
        if text is not None:
            files.append(path)
            pids.update(parse_pids(text))
    if not files and main_pid is not None:
        main = main_pid(unit)
        pids.update(process_tree(read_text, main) if main > 0 else [])
    rss = sum(parse_status_rss(read_text("/proc/%d/status" % pid)) or 0 for pid in pids)
    return {"unit": unit, "source": "unit RSS", "procs_files": files, "main_pid": main, "pids": sorted(pids),
            "rss_bytes": rss}


def read_memory_limits(read_text: ReadText, units: Sequence[str] = (), root: str = CGROUP_ROOT,
                       main_pid: MainPid | None = None) -> dict[str, Any]:
    """The cgroups above a service's unit on this host, and what the service's own units hold.

    ``units`` are the systemd units of the service (an rpc-server's, llama-server's); their cgroups are
    ``<systemd root>/system.slice/<unit>``. Without units, the chain starts at this process's own cgroup.
    A unit whose memory cgroup has no charge to read (none of its own: see the module's notes) holds the resident
    memory of its processes (:func:`read_unit_rss`, which asks ``main_pid`` where no hierarchy lists them).
    Returns ``{"hierarchy": "cgroup2" | "cgroup1" | None, "cgroups": [read_cgroup entries, innermost first],
    "own_bytes": what the units hold, "units": [their entries, each with its ``unit`` and ``source``]}``.
    """
    result: dict[str, Any] = {"hierarchy": None, "cgroups": [], "own_bytes": 0, "units": []}
    self_paths = parse_proc_cgroup(read_text("/proc/self/cgroup") or "")
    init_cgroup = read_text("/proc/1/cgroup") or ""
    hierarchy, mount = _hierarchy(read_text, self_paths, root)
    result["hierarchy"] = hierarchy
    base = "/"
    if hierarchy is not None:
        init_path = parse_proc_cgroup(init_cgroup)[hierarchy]
        base = systemd_root(init_path or "/") if units else (self_paths[hierarchy] or "/")
        chain = ancestors(_join(base, SYSTEM_SLICE) if units else base)
        result["cgroups"] = [read_cgroup(read_text, mount, path, hierarchy) for path in chain]
    for unit in units:
        entry: dict[str, Any] = {"current_bytes": None}
        if hierarchy is not None:
            entry = read_cgroup(read_text, mount, _join(_join(base, SYSTEM_SLICE), unit), hierarchy)
            entry.update(unit=unit, source="cgroup %s" % entry["path"])
        if entry["current_bytes"] is None:
            processes = read_unit_rss(read_text, init_cgroup, unit, root, main_pid)
            entry.update(processes, current_bytes=processes["rss_bytes"], cache_bytes=0)
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
    limited cgroups (``path``, ``file``, ``limit_mib``, ``used_mib`` by others, ``headroom_mib``); ``units`` what
    each unit holds (``unit``, ``source``: its cgroup or ``unit RSS``, ``own_mib``, ``pids`` where read by RSS).
    """
    limits = limits or {}
    own = int(limits.get("own_bytes") or 0)
    # where what the service holds was read from its processes, the sources say so
    by_rss = sum(int(u.get("rss_bytes") or 0) for u in limits.get("units") or [] if u.get("source") == "unit RSS")
    total, total_source = int(total_mib), "/proc/meminfo MemTotal"
    free, free_source = int(available_mib) + _mib(own), "/proc/meminfo MemAvailable"
    if own:
        free_source += " + %d MiB the service holds" % _mib(own)
    if by_rss:
        free_source += " (%d MiB of it by unit RSS)" % _mib(by_rss)
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
            free, free_source = _mib(headroom), "%s (%d MiB, %d MiB used by others%s)" % (
                where, _mib(entry["limit_bytes"]), _mib(others),
                ", %d MiB the service holds by unit RSS" % _mib(by_rss) if by_rss else "")
    return {"total_mib": total, "total_source": total_source, "free_mib": min(free, total),
            "free_source": free_source, "own_mib": _mib(own), "cgroups": limited,
            "hierarchy": limits.get("hierarchy"),
            "units": [{"unit": u.get("unit"), "source": u.get("source"), "own_mib": _mib(in_use(u)),
                       "pids": u.get("pids", [])} for u in limits.get("units") or []]}


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
