"""gpu_memory: cgroup limits read from file trees as the kernel writes them, and the CPU device's figures."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from ansible_collections.llamafleet.cluster.plugins.module_utils import gpu_memory
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_devices import usable_mib
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_memory import (
    ancestors,
    check_memory,
    memory_figures,
    memory_max_mib,
    parse_limit,
    parse_named_cgroup,
    parse_pids,
    parse_proc_cgroup,
    parse_stat_file_bytes,
    parse_status_rss,
    process_tree,
    read_memory_limits,
    systemd_root,
    unit_procs_files,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.gpu_probe import collect_devices, read_text_file
from tests.unit.needs import needs

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


# --- a unit without a memory cgroup of its own: its processes' resident memory ("unit RSS") ---

RPC_UNIT = "llamafleet-rpc-server.service"


@contextlib.contextmanager
def holding_process(mib: int, cgroup_procs: str | None = None) -> Iterator[int]:
    """A python3 child that wrote ``mib`` MiB of anonymous memory and holds it until the block ends: its PID.

    With ``cgroup_procs`` the child joins that cgroup before it starts (so a cgroup with the memory controller is
    charged for what it writes)."""

    def join() -> None:
        with open(cgroup_procs, "w", encoding="ascii") as handle:  # type: ignore[arg-type]
            handle.write(str(os.getpid()))

    code = "import sys; held = b'\\x01' * (%d << 20); print('ready', flush=True); sys.stdin.read()" % mib
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             preexec_fn=join if cgroup_procs else None)  # pylint: disable=subprocess-popen-preexec-fn
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        yield child.pid
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)


@pytest.fixture(scope="module")
def held_status() -> tuple[int, str, str]:
    """The PID, /proc/PID/status and /proc/PID/statm of a real process of ours holding 64 MiB."""
    with holding_process(64) as pid:
        return pid, Path("/proc/%d/status" % pid).read_text(), Path("/proc/%d/statm" % pid).read_text()


def in_container(proc_cgroup: str, systemd_path: str) -> str:
    """This machine's /proc/PID/cgroup lines as an nspawn host with its own cgroup namespace sees them: systemd's
    hierarchies (name=systemd, unified) at ``systemd_path``, every v1 controller at its namespace's root."""
    lines = []
    for line in proc_cgroup.splitlines():
        number, controllers, dummy = line.split(":", 2)
        systemd = controllers == "name=systemd" or (number == "0" and controllers == "")
        lines.append("%s:%s:%s" % (number, controllers, systemd_path if systemd else "/"))
    return "\n".join(lines) + "\n"


def nspawn_v1(pid: int, status: str, others: int, procs: bool = True) -> dict[str, str]:
    """A lab host as the 3-host lab runs it on this (hybrid) machine, seen from inside: the memory controller is
    v1, read-only, its root the host's own cgroup with the lab's limit; systemd keeps its units in name=systemd and
    unified only, so rpc-server's unit has no memory cgroup. ``pid`` runs in the unit (when ``procs``)."""
    real = Path("/proc/self/cgroup").read_text()
    stat = Path("/sys/fs/cgroup/memory%s/memory.stat" % parse_proc_cgroup(real)["cgroup1"]).read_text()
    cache = parse_stat_file_bytes(stat, ("total_active_file", "total_inactive_file"))
    files = {
        "/proc/self/cgroup": in_container(real, "/user.slice/user-0.slice/session-4.scope"),
        "/proc/1/cgroup": in_container(real, "/init.scope"),
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "%d\n" % (4096 * MIB),
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": "%d\n" % (others + parse_status_rss(status) + cache),
        "/sys/fs/cgroup/memory/memory.stat": stat,
        "/proc/%d/status" % pid: status,
    }
    if procs:
        for hierarchy in ("systemd", "unified"):
            files["/sys/fs/cgroup/%s/system.slice/%s/cgroup.procs" % (hierarchy, RPC_UNIT)] = "%d\n" % pid
    return files


@needs(os.path.isdir("/sys/fs/cgroup/memory/") and parse_proc_cgroup(read_text_file("/proc/self/cgroup") or "")
       ["cgroup1"] is not None, "the v1 memory controller (the lab's hybrid layout)")
def test_a_unit_without_a_memory_cgroup_holds_its_processes_rss(tmp_path: Path, held_status) -> None:
    """The lab's second deploy: rpc-server's weights count as its own, not as others' use of the host's limit."""
    pid, status, dummy = held_status
    rss = parse_status_rss(status)
    assert rss is not None and rss >= 64 * MIB
    limits = read_memory_limits(tree(tmp_path, nspawn_v1(pid, status, others=900 * MIB)), [RPC_UNIT])
    assert limits["hierarchy"] == "cgroup1"
    assert [c["path"] for c in limits["cgroups"]] == ["/system.slice", "/"]
    (unit,) = limits["units"]
    assert (unit["source"], unit["pids"], limits["own_bytes"]) == ("unit RSS", [pid], rss)
    assert unit["procs_files"] == ["/sys/fs/cgroup/unified/system.slice/%s/cgroup.procs" % RPC_UNIT,
                                   "/sys/fs/cgroup/systemd/system.slice/%s/cgroup.procs" % RPC_UNIT]
    figures = memory_figures(24105, 23003, limits)
    assert figures["free_mib"] == 4096 - 900
    assert figures["free_source"] == ("cgroup / memory.limit_in_bytes (4096 MiB, 900 MiB used by others, %d MiB the "
                                      "service holds by unit RSS)" % (rss // MIB))
    assert figures["units"] == [{"unit": RPC_UNIT, "source": "unit RSS", "own_mib": rss // MIB, "pids": [pid]}]
    # the unit not running (no cgroup.procs): what the process holds is someone else's
    stopped = memory_figures(24105, 23003, read_memory_limits(tree(tmp_path / "stopped", nspawn_v1(
        pid, status, others=900 * MIB, procs=False)), [RPC_UNIT]))
    assert stopped["free_mib"] == (3196 * MIB - rss) // MIB
    assert stopped["free_source"] == "cgroup / memory.limit_in_bytes (4096 MiB, %d MiB used by others)" % (
        (900 * MIB + rss) // MIB)


def test_a_units_own_memory_cgroup_wins_over_its_processes(tmp_path: Path, held_status) -> None:
    """cgroup v2 with per-unit cgroups as before: the unit's charge, not its processes' RSS."""
    pid, status, dummy = held_status
    files = container_v2(tmp_path, unit_current=1536 * MIB)
    files.update({"/sys/fs/cgroup/system.slice/%s/cgroup.procs" % RPC_UNIT: "%d\n" % pid,
                  "/proc/%d/status" % pid: status})
    limits = read_memory_limits(tree(tmp_path, files), [RPC_UNIT])
    assert (limits["own_bytes"], limits["units"][0]["source"]) == (1536 * MIB, "cgroup /system.slice/" + RPC_UNIT)
    assert "pids" not in limits["units"][0]
    assert memory_figures(24105, 23003 - 1536, limits)["free_source"] == (
        "cgroup / memory.max (3072 MiB, 300 MiB used by others)")


def test_no_memory_controller_still_counts_the_units_rss(tmp_path: Path, held_status) -> None:
    pid, status, dummy = held_status
    read = tree(tmp_path, {"/proc/self/cgroup": "0::/user.slice\n", "/proc/1/cgroup": "0::/init.scope\n",
                           "/sys/fs/cgroup/cgroup.controllers": "cpu pids\n",
                           "/sys/fs/cgroup/system.slice/%s/cgroup.procs" % RPC_UNIT: "%d\n" % pid,
                           "/proc/%d/status" % pid: status})
    limits = read_memory_limits(read, [RPC_UNIT])
    rss = parse_status_rss(status)
    assert limits["hierarchy"] is None and limits["own_bytes"] == rss
    figures = memory_figures(24105, 20000, limits)
    assert figures["free_mib"] == 20000 + rss // MIB
    assert figures["free_source"] == ("/proc/meminfo MemAvailable + %d MiB the service holds (%d MiB of it by unit "
                                      "RSS)" % (rss // MIB, rss // MIB))


def test_unit_procs_files_in_each_hierarchy() -> None:
    hybrid = ("1:name=systemd:/machine.slice/lab2/init.scope\n4:memory:/machine.slice/lab2\n"
              "0::/machine.slice/lab2/init.scope\n")
    assert unit_procs_files(hybrid, RPC_UNIT) == [
        "/sys/fs/cgroup/machine.slice/lab2/system.slice/%s/cgroup.procs" % RPC_UNIT,
        "/sys/fs/cgroup/unified/machine.slice/lab2/system.slice/%s/cgroup.procs" % RPC_UNIT,
        "/sys/fs/cgroup/systemd/machine.slice/lab2/system.slice/%s/cgroup.procs" % RPC_UNIT]
    assert unit_procs_files("4:memory:/\n", RPC_UNIT) == []
    assert parse_named_cgroup(hybrid) == "/machine.slice/lab2/init.scope"
    assert parse_named_cgroup("4:memory:/\n") is None


def test_rss_of_a_real_process(held_status) -> None:
    """/proc/PID/status of a process holding 64 MiB: RssAnon + RssShmem, which statm's resident less shared gives
    too; VmRSS where the kernel has no split (before 4.5)."""
    dummy, status, statm = held_status
    resident, shared = (int(word) for word in statm.split()[1:3])
    anon = (resident - shared) * os.sysconf("SC_PAGE_SIZE")
    assert abs(parse_status_rss(status) - anon) <= MIB
    old_kernel = "".join(line + "\n" for line in status.splitlines() if not line.startswith(("RssAnon", "RssShmem",
                                                                                            "RssFile")))
    assert parse_status_rss(old_kernel) >= parse_status_rss(status)
    assert parse_status_rss("Name:\tkthreadd\nState:\tS (sleeping)\n") is None
    assert parse_status_rss(None) is None


def test_pids_of_a_real_cgroup_procs() -> None:
    """This process is listed in its own cgroup's cgroup.procs, in a hierarchy that is no memory controller's."""
    own = read_text_file("/proc/self/cgroup") or ""
    found = [(mount, path) for mount, path in (("/sys/fs/cgroup/systemd", parse_named_cgroup(own)),
                                               ("/sys/fs/cgroup/unified", parse_proc_cgroup(own)["cgroup2"]),
                                               ("/sys/fs/cgroup", parse_proc_cgroup(own)["cgroup2"]))
             if path is not None and read_text_file(mount + path.rstrip("/") + "/cgroup.procs") is not None]
    if not found:
        pytest.skip("no readable cgroup.procs for this process")
    mount, path = found[0]
    assert os.getpid() in parse_pids(read_text_file(mount + path.rstrip("/") + "/cgroup.procs"))
    assert parse_pids("") == [] and parse_pids(None) == [] and parse_pids("12\n345\n") == [12, 345]


def test_without_cgroup_procs_the_units_main_pid_and_its_children(tmp_path: Path, held_status) -> None:
    """No hierarchy lists the unit: systemd's MainPID (by systemctl show, as gpu_probe asks it) and its children."""
    pid, status, dummy = held_status
    rss = parse_status_rss(status)
    files = nspawn_v1(pid, status, others=900 * MIB + rss, procs=False)  # the child's child holds as much again
    files.update({"/proc/%d/task/%d/children" % (pid, pid): "%d " % (pid + 1),
                  "/proc/%d/status" % (pid + 1): status})
    systemctl = ("show", "--property=MainPID", "--value", "--", RPC_UNIT)
    calls = []

    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        return (0, "%d\n" % pid, "") if tuple(argv[1:]) == systemctl else (1, "", "unexpected")

    files["/proc/meminfo"] = MEMINFO
    found = collect_devices(run, lambda name: "/usr/bin/" + name if name == "systemctl" else None,
                            tree(tmp_path, files), backends=["cpu"], units=[RPC_UNIT])
    (cpu,) = found["rpc_devices"]
    assert calls == [["/usr/bin/systemctl", *systemctl]]
    assert cpu["memory"]["units"] == [{"unit": RPC_UNIT, "source": "unit RSS", "own_mib": 2 * rss // MIB,
                                       "pids": [pid, pid + 1]}]
    assert cpu["free_mib"] == 4096 - 900
    # a unit that is not running: MainPID 0, nothing held
    limits = read_memory_limits(tree(tmp_path / "stopped", nspawn_v1(pid, status, 0, procs=False)), [RPC_UNIT],
                                main_pid=lambda unit: 0)
    assert (limits["own_bytes"], limits["units"][0]["pids"], limits["units"][0]["main_pid"]) == (0, [], 0)


@needs(os.path.exists("/proc/%d/task/%d/children" % (os.getpid(), os.getpid())), "/proc/PID/task/PID/children")
def test_process_tree_of_this_process() -> None:
    with holding_process(1) as pid:
        assert {os.getpid(), pid} <= set(process_tree(read_text_file, os.getpid()))
    assert process_tree(lambda path: None, 0) == []
