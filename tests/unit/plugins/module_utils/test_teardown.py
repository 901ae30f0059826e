"""teardown: the units to stop in order, the ping range to give back, the llamafleet folders to prune."""

from __future__ import annotations

import pytest

from llamafleet.core import constants as c
from llamafleet.core.host_observation import ping_group_range
from llamafleet.core.teardown import (
    EMPTY_PING_GROUP_RANGE,
    namespace_parents,
    ping_group_range_restore,
    teardown_units,
)

SD = "/etc/systemd/system"


def entry(path: str, isdir: bool = False) -> dict:
    """A file entry as ansible.builtin.find returns it (only the keys the function reads, plus one it does not)."""
    return {"path": path, "isdir": isdir, "islnk": False}


@pytest.mark.parametrize(("found", "expected"), [
    ([], []),
    # a worker: firewall, guard, rpc-server, the textfile metrics' timer and its service; wants links left out
    ([entry(SD + "/llamafleet-rpc-server.service"), entry(SD + "/llamafleet-rpc-guard.service"),
      entry(SD + "/llamafleet-rpc-firewall.service"), entry(SD + "/llamafleet-rpc-metrics.service"),
      entry(SD + "/llamafleet-rpc-metrics.timer"),
      entry(SD + "/multi-user.target.wants/llamafleet-rpc-server.service"),
      entry(SD + "/timers.target.wants/llamafleet-rpc-metrics.timer")],
     ["llamafleet-rpc-metrics.timer", "llamafleet-rpc-firewall.service", "llamafleet-rpc-guard.service",
      "llamafleet-rpc-metrics.service", "llamafleet-rpc-server.service"]),
    # the orchestrator with degraded mode: the path unit first; drop-in folders are not units
    ([entry(SD + "/llamafleet-llama-server.service"), entry(SD + "/llamafleet-gate.service"),
      entry(SD + "/llamafleet-plan-switch.service"), entry(SD + "/llamafleet-plan-switch.path"),
      entry(SD + "/llamafleet-llama-server.service.d", isdir=True),
      entry("/run/systemd/system/llamafleet-llama-server.service.d", isdir=True)],
     ["llamafleet-plan-switch.path", "llamafleet-gate.service", "llamafleet-llama-server.service",
      "llamafleet-plan-switch.service"]),
    # plain paths; per-device units; the same unit twice; a trailing slash on nothing; other names and suffixes
    ([SD + "/llamafleet-rpc-server-cuda1.service", SD + "/llamafleet-rpc-server-cuda0.service",
      SD + "//llamafleet-rpc-server-cuda0.service", SD + "/llamafleet-notes.txt", SD + "/sshd.service",
      "/lib/systemd/system/llamafleet-x.service", SD + "/llamafleet-sock.socket"],
     ["llamafleet-sock.socket", "llamafleet-rpc-server-cuda0.service", "llamafleet-rpc-server-cuda1.service"]),
    # a folder named like a unit is not one
    ([entry(SD + "/llamafleet-odd.service", isdir=True)], []),
])
def test_teardown_units(found: list, expected: list[str]) -> None:
    assert teardown_units(found) == expected


def test_teardown_units_takes_the_folder_and_prefix() -> None:
    assert teardown_units(["/run/systemd/system/x-a.service", "/run/systemd/system/y-a.service"],
                          systemd_dir="/run/systemd/system/", prefix="x-") == ["x-a.service"]


def test_every_unit_of_the_roles_is_found() -> None:
    """teardown.yml finds the units by the prefix alone: a unit named otherwise would outlive it."""
    names = sorted({(value % 0 if "%d" in value else value % "cuda0" if "%s" in value else value)
                    for name, value in vars(c).items()
                    if name.endswith(("_UNIT", "_TIMER")) and isinstance(value, str)})
    assert len(names) >= 7 and c.LLAMA_SERVER_UNIT in names and c.PLAN_SWITCH_PATH_UNIT in names, names
    assert sorted(teardown_units([SD + "/" + name for name in names])) == names


def _setting(gid: int) -> str:
    """The sysctl file the llama_server role writes where the range was empty (tasks/install.yml)."""
    value, note = ping_group_range(EMPTY_PING_GROUP_RANGE, gid)
    return "# Managed by Ansible (role llamafleet.cluster.llama_server): %s\nnet.ipv4.ping_group_range = %s\n" % (
        note, value)


@pytest.mark.parametrize(("setting", "current", "expected"), [
    (_setting(997), "997\t997\n", EMPTY_PING_GROUP_RANGE),  # the deploy's value still in force: give back empty
    (_setting(997), "997 997", EMPTY_PING_GROUP_RANGE),
    (_setting(997), "0\t2147483647\n", ""),  # someone widened it since: theirs
    (_setting(997), "1\t0\n", ""),  # already empty (never applied, or reset)
    ("", "997\t997\n", ""),  # no file: nothing of ours
    ("# net.ipv4.ping_group_range = 997 997\n", "997\t997\n", ""),  # a comment sets nothing
    ("net.ipv4.ping_group_range = 5 5\nnet.ipv4.ping_group_range = 997 997\n", "997\t997", "1 0"),  # the last wins
    ("net.ipv4.ping_group_range = 1 0\n", "1\t0\n", ""),
    ("net.ipv4.ping_group_range = many\n", "997\t997\n", ""),
    (_setting(997), "garbage", ""),
])
def test_ping_group_range_restore(setting: str, current: str, expected: str) -> None:
    assert ping_group_range_restore(setting, current) == expected


@pytest.mark.parametrize(("paths", "expected"), [
    ([], []),
    # the defaults: /opt/llamafleet and /var/cache/llamafleet, each once, deepest first
    ([c.LLAMACPP_ROOT, "/var/cache/llamafleet/build", "/var/cache/llamafleet/ccache"],
     ["/var/cache/llamafleet", "/opt/llamafleet"]),
    # folders the user chose: their parents are not llamafleet's
    (["/opt/llama.cpp", "/srv/cache/build", "/llamafleet-root"], []),
    # a name that only starts with llamafleet counts (llamafleet-rpc); trailing slashes do not matter
    (["/var/lib/llamafleet-rpc/cache/", "/data/llamafleet/x/y"], ["/var/lib/llamafleet-rpc"]),
    (["/data/llamafleet/y", "/data/llamafleet/llamafleet-sub/x", "/data/llamafleet/z"],
     ["/data/llamafleet/llamafleet-sub", "/data/llamafleet"]),
    (["/llamafleet"], []),  # never the root
])
def test_namespace_parents(paths: list[str], expected: list[str]) -> None:
    assert namespace_parents(paths) == expected
