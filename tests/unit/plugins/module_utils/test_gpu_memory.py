"""gpu_memory: cgroup limits read from file trees as the kernel writes them, and the CPU device's figures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ansible_collections.llamafleet.cluster.plugins.module_utils import gpu_memory
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_devices import usable_mib
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_memory import (
    ancestors,
    check_memory,
    memory_figures,
    memory_max_mib,
    parse_limit,
    parse_proc_cgroup,
    parse_stat_file_bytes,
    read_memory_limits,
    systemd_root,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_probe import collect_devices, read_text_file

MIB = 1024 * 1024
# /proc/self/cgroup of a shell in an nspawn container on a unified host, and of this kind of machine (hybrid)
UNIFIED = "0::/user.slice/user-0.slice/session-3.scope\n"
HYBRID = ("9:name=systemd:/\n8:pids:/\n4:memory:/process_api/44de96bf18a55f336a1c254ee2f6a4b0\n3:cpuset:/\n"
          "0::/\n")
# memory.stat of a v2 cgroup (the lines that matter, and some around them, as the kernel prints them)
STAT_V2 = ("anon 157286400\nfile 3221225472\nkernel 20971520\nshmem 4096\nfile_mapped 1048576\n"
           "active_anon 150000000\ninactive_anon 7286400\nactive_file 1073741824\ninactive_file 2147483648\n"
           "unevictable 0\n")
STAT_V1 = ("cache 104857600\nrss 52428800\ntotal_cache 2147483648\ntotal_rss 314572800\n"
           "total_inactive_file 1610612736\ntotal_active_file 536870912\n")
MEMINFO = "MemTotal:       24684092 kB\nMemFree:        19873476 kB\nMemAvailable:   23555296 kB\n"


def tree(root: Path, files: dict[str, str]):
    """Write ``files`` (absolute paths) under ``root``; the reader of that tree (None where a file is missing)."""
    for path, text in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return lambda path: read_text_file(str(root / path.lstrip("/")))


def container_v2(tmp_path: Path, unit_current: int = 0, others: int = 300 * MIB) -> dict[str, str]:
    """An nspawn host with its own cgroup namespace on a unified host: the container's root limited to 3 GiB
    (memory.max of the namespace's root), rpc-server's unit running under system.slice."""
    unit = "/sys/fs/cgroup/system.slice/llamafleet-rpc-server.service"
    return {
        "/proc/self/cgroup": UNIFIED,
        "/proc/1/cgroup": "0::/init.scope\n",
        "/sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
        "/sys/fs/cgroup/memory.max": "3221225472\n",
        "/sys/fs/cgroup/memory.high": "max\n",
        "/sys/fs/cgroup/memory.current": "%d\n" % (others + unit_current + 3 * 1024 * MIB),
        "/sys/fs/cgroup/memory.stat": STAT_V2,
        "/sys/fs/cgroup/system.slice/memory.max": "max\n",
        "/sys/fs/cgroup/system.slice/memory.high": "max\n",
        "/sys/fs/cgroup/system.slice/memory.current": "%d\n" % (unit_current + 200 * MIB),
        "/sys/fs/cgroup/system.slice/memory.stat": "active_file 0\ninactive_file 0\n",
        unit + "/memory.max": "2147483648\n",
        unit + "/memory.current": "%d\n" % unit_current,
        unit + "/memory.stat": "anon %d\nactive_file 0\ninactive_file 0\n" % unit_current,
    }


def test_proc_cgroup_lines() -> None:
    assert parse_proc_cgroup(UNIFIED) == {"cgroup2": "/user.slice/user-0.slice/session-3.scope", "cgroup1": None}
    assert parse_proc_cgroup(HYBRID) == {"cgroup2": "/", "cgroup1": "/process_api/44de96bf18a55f336a1c254ee2f6a4b0"}
    assert parse_proc_cgroup("") == {"cgroup2": None, "cgroup1": None}


def test_limits_max_and_v1_no_limit_are_none() -> None:
    assert parse_limit("3221225472\n") == 3221225472
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712\n") is None  # v1's "no limit" on 4 KiB pages
    assert parse_limit(None) is None and parse_limit("") is None


def test_reclaimable_page_cache_from_memory_stat() -> None:
    assert parse_stat_file_bytes(STAT_V2, ("active_file", "inactive_file")) == 3 * 1024 * MIB
    assert parse_stat_file_bytes(STAT_V1, ("total_active_file", "total_inactive_file")) == 2048 * MIB
    # "file" itself includes tmpfs and shared memory, which cannot be dropped: not counted
    assert parse_stat_file_bytes("file 999\n", ("active_file", "inactive_file")) == 0


def test_systemd_root_and_ancestors() -> None:
    assert systemd_root("/init.scope") == "/"
    assert systemd_root("/machine.slice/machine-lab2.scope/init.scope") == "/machine.slice/machine-lab2.scope"
    assert systemd_root("/") == "/"
    chain = ["/machine.slice/lab2/system.slice", "/machine.slice/lab2", "/machine.slice", "/"]
    assert ancestors("/machine.slice/lab2/system.slice") == chain
    assert ancestors("/") == ["/"]


def test_container_limit_wins_over_meminfo(tmp_path: Path) -> None:
    read = tree(tmp_path, container_v2(tmp_path))
    limits = read_memory_limits(read, ["llamafleet-rpc-server.service"])
    assert limits["hierarchy"] == "cgroup2"
    assert [c["path"] for c in limits["cgroups"]] == ["/system.slice", "/"]
    root = limits["cgroups"][1]
    assert (root["limit_bytes"], root["limit_file"], root["cache_bytes"]) == (3 * 1024 * MIB, "memory.max", 3 * 1024 * MIB)
    figures = memory_figures(24105, 23003, limits)
    # 3 GiB less the 300 MiB the others hold (the 3 GiB of page cache can be dropped)
    assert figures["total_mib"] == 3072 and figures["total_source"] == "cgroup / memory.max"
    assert figures["free_mib"] == 2772
    assert figures["free_source"] == "cgroup / memory.max (3072 MiB, 300 MiB used by others)"
    assert figures["cgroups"] == [{"path": "/", "file": "memory.max", "limit_mib": 3072, "used_mib": 300,
                                   "headroom_mib": 2772}]


def test_what_the_unit_holds_counts_as_its_own(tmp_path: Path) -> None:
    """A second deploy, rpc-server holding 1.5 GiB of weights: the same free figure as before it loaded."""
    read = tree(tmp_path, container_v2(tmp_path, unit_current=1536 * MIB))
    figures = memory_figures(24105, 23003 - 1536, read_memory_limits(read, ["llamafleet-rpc-server.service"]))
    assert figures["own_mib"] == 1536
    assert figures["free_mib"] == 2772
    # without naming the unit, its memory is someone else's
    alone = memory_figures(24105, 23003 - 1536, read_memory_limits(read))
    assert alone["free_mib"] == 2772 - 1536


def test_memory_high_is_a_limit_too(tmp_path: Path) -> None:
    files = container_v2(tmp_path)
    files["/sys/fs/cgroup/system.slice/memory.high"] = "%d\n" % (2048 * MIB)
    figures = memory_figures(24105, 23003, read_memory_limits(tree(tmp_path, files), ["llamafleet-rpc-server.service"]))
    assert figures["free_source"].startswith("cgroup /system.slice memory.high (2048 MiB")
    assert figures["total_mib"] == 2048


def test_hybrid_host_reads_the_v1_memory_controller(tmp_path: Path) -> None:
    """An nspawn host on a hybrid machine without a cgroup namespace: full paths, the limit on the container."""
    base = "/sys/fs/cgroup/memory/machine/lab2"
    read = tree(tmp_path, {
        "/proc/self/cgroup": "4:memory:/machine/lab2/user.slice\n0::/machine/lab2/user.slice\n",
        "/proc/1/cgroup": "4:memory:/machine/lab2/init.scope\n0::/machine/lab2/init.scope\n",
        "/sys/fs/cgroup/cgroup.controllers": "",  # not mounted there: a hybrid host
        "/sys/fs/cgroup/unified/cgroup.controllers": "\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "/sys/fs/cgroup/memory/machine/memory.limit_in_bytes": "9223372036854771712\n",
        base + "/memory.limit_in_bytes": "%d\n" % (3072 * MIB),
        base + "/memory.usage_in_bytes": "%d\n" % (2560 * MIB + 512 * MIB),
        base + "/memory.stat": STAT_V1,
        base + "/system.slice/memory.limit_in_bytes": "9223372036854771712\n",
    })
    limits = read_memory_limits(read, ["llamafleet-rpc-server.service"])
    assert limits["hierarchy"] == "cgroup1"
    assert [c["path"] for c in limits["cgroups"]] == ["/machine/lab2/system.slice", "/machine/lab2", "/machine", "/"]
    figures = memory_figures(24105, 23003, limits)
    assert figures["free_mib"] == 2048  # 3072 - (3072 charged - 2048 page cache)
    assert figures["free_source"] == "cgroup /machine/lab2 memory.limit_in_bytes (3072 MiB, 1024 MiB used by others)"


def test_no_limit_anywhere_keeps_meminfo(tmp_path: Path) -> None:
    read = tree(tmp_path, {"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/cgroup.controllers": "memory\n"})
    figures = memory_figures(24105, 23003, read_memory_limits(read))
    assert (figures["total_mib"], figures["free_mib"]) == (24105, 23003)
    assert (figures["total_source"], figures["free_source"]) == ("/proc/meminfo MemTotal", "/proc/meminfo MemAvailable")


def test_probe_gives_the_cpu_device_the_limited_figures(tmp_path: Path) -> None:
    files = container_v2(tmp_path)
    files["/proc/meminfo"] = MEMINFO
    found = collect_devices(lambda argv: (1, "", ""), lambda name: None, tree(tmp_path, files), backends=["cpu"],
                            units=["llamafleet-rpc-server.service"])
    (cpu,) = found["rpc_devices"]
    assert (cpu["total_mib"], cpu["free_mib"], cpu["source"]) == (3072, 2772, "/proc/meminfo + cgroup2")
    assert cpu["free_source"].startswith("cgroup / memory.max")


def test_this_machines_own_cgroups() -> None:
    """Against /sys/fs/cgroup here: the hierarchy that holds the memory controller, each limit as the kernel says."""
    self_cgroup = read_text_file("/proc/self/cgroup")
    if self_cgroup is None:
        pytest.skip("no /proc/self/cgroup")
    limits = read_memory_limits(read_text_file)
    paths = parse_proc_cgroup(self_cgroup)
    v2_memory = "memory" in (read_text_file("/sys/fs/cgroup/cgroup.controllers") or "").split()
    expected = "cgroup2" if paths["cgroup2"] is not None and v2_memory else "cgroup1" if paths["cgroup1"] else None
    assert limits["hierarchy"] == expected
    if expected is None:
        return
    mount = "/sys/fs/cgroup" if expected == "cgroup2" else "/sys/fs/cgroup/memory"
    assert [c["path"] for c in limits["cgroups"]] == ancestors(paths[expected])
    for entry in limits["cgroups"]:
        folder = mount + entry["path"].rstrip("/")
        if not os.path.isdir(folder):
            continue
        name = "memory.max" if expected == "cgroup2" else "memory.limit_in_bytes"
        raw = read_text_file(folder + "/" + name)
        if raw is not None and entry["limit_file"] == name:
            assert entry["limit_bytes"] == int(raw)


def test_memory_max_setting() -> None:
    assert memory_max_mib("auto", 3072, 1024) == 2048
    assert memory_max_mib("auto", 3072, 1024, max_mib=4096) == 2048  # a cap never above the host
    assert memory_max_mib("auto", 24105, 1024, max_mib=4096) == 4096
    assert memory_max_mib(0, 3072, 1024) == 0 and memory_max_mib("2500", 3072, 1024) == 2500
    for bad in ("lots", -1, True):
        with pytest.raises(ValueError, match="expected auto, 0 or a number of MiB"):
            memory_max_mib(bad, 3072, 1024)


CPU = {"backend": "cpu", "index": 0, "name": "AMD EPYC", "total_mib": 3072, "free_mib": 2772,
       "total_source": "cgroup / memory.max"}


def test_a_cap_above_the_hosts_memory_is_refused() -> None:
    limit, problems = check_memory([CPU], True, 4096, [], 1024, "rpc_server_memory_max_mib")
    assert problems == ["rpc_server_memory_max_mib is 4096 MiB, above this host's memory: 3072 MiB "
                        "(cgroup / memory.max); lower it, auto (the planning figure) or 0 (no limit)"]
    assert check_memory([CPU], True, 3000, [], 1024) == (3000, [])
    assert check_memory([CPU], True, "auto", [{"match": "cpu", "max_mib": 4096}], 1024) == (2048, [])
    assert check_memory([CPU], True, "auto", [{"match": "cpu", "reserve_mib": 256}], 1024) == (2816, [])
    # a GPU build: auto sets no MemoryMax (its weights are in VRAM), a number still applies
    assert check_memory([CPU], False, "auto", [], 1024) == (0, [])
    assert check_memory([CPU], False, 1024, [], 1024) == (1024, [])


def test_an_override_claiming_more_than_the_cgroup_allows_is_refused() -> None:
    dummy, problems = check_memory([CPU], True, "auto", [{"match": "cuda", "free_mib": 99999},
                                                         {"match": "cpu", "free_mib": 8192}], 1024,
                                   overrides_name="rpc_server_device_overrides")
    assert problems == ["rpc_server_device_overrides[1].free_mib is 8192 MiB, more than this host can give a service: "
                        "3072 MiB (cgroup / memory.max); lower it or leave it out (max_mib caps without claiming "
                        "memory)"]


def test_the_units_memory_max_caps_what_the_planner_uses() -> None:
    assert usable_mib({"free_mib": 2772, "reserve_mib": 256, "limit_mib": 2048}) == 2048
    assert usable_mib({"free_mib": 2772, "reserve_mib": 1024, "limit_mib": 2048}) == 1748
    assert gpu_memory.MIB == MIB
