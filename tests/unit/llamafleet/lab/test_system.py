"""Parsers of /proc data the lab relies on (mountinfo, nspawn command lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamafleet.lab.machines import Machine, nspawn_argv, parse_machine
from llamafleet.lab.net import LabHost
from llamafleet.lab.system import Mount, Process, missing_tools_message, parse_mountinfo

# Lines of /proc/self/mountinfo on the controller with a lab host up (one with an escaped space).
MOUNTINFO = (
    "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard\n"
    "310 22 0:52 / /var/cache/llamafleet/lab/hosts/lab1/root rw,relatime shared:170 - overlay llamafleet-lab "
    "rw,lowerdir=/var/cache/llamafleet/lab/images/c805a7821bf8ace0/rootfs,upperdir=/var/cache/llamafleet/lab/hosts/lab1/upper,"
    "workdir=/var/cache/llamafleet/lab/hosts/lab1/work,uuid=on\n"
    "311 22 0:53 / /tmp/with\\040space rw - tmpfs tmpfs rw\n"
)


def test_parse_mountinfo() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert [(m.mountpoint, m.fstype, m.source) for m in mounts] == [
        ("/", "ext4", "/dev/vda"),
        ("/var/cache/llamafleet/lab/hosts/lab1/root", "overlay", "llamafleet-lab"),
        ("/tmp/with space", "tmpfs", "tmpfs"),
    ]
    assert mounts[1].option("upperdir") == "/var/cache/llamafleet/lab/hosts/lab1/upper"
    assert mounts[1].option("uuid") == "on"
    assert mounts[0].option("upperdir") is None
    assert Mount("/", "ext4", "/dev/vda", "rw,discard").option("discard") == ""


def test_parse_machine_recognises_only_lab_containers() -> None:
    root = Path("/var/cache/llamafleet/lab/hosts/lab2/root")
    nspawn = Process(100, 1, tuple(nspawn_argv(LabHost(2), root)))
    assert parse_machine(nspawn, {100: [101]}) == Machine("lab2", 100, str(root), 101)
    # Another user's container on another bridge, and a non-lab machine name, are not ours.
    other_bridge = Process(200, 1, ("systemd-nspawn", "-D", "/srv/x", "-M", "lab2", "--network-bridge=br0", "-b"))
    other_name = Process(300, 1, ("/usr/bin/systemd-nspawn", "-D", "/srv/y", "--machine", "web1", "--network-bridge=lfbr0"))
    not_nspawn = Process(400, 1, ("vim", "-M", "lab1", "--network-bridge=lfbr0"))
    assert [parse_machine(p, {}) for p in (other_bridge, other_name, not_nspawn)] == [None, None, None]


def test_missing_tools_name_the_debian_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: nothing is installed
    assert missing_tools_message(["systemd-nspawn", "debootstrap", "tc", "ip"]) == (
        "missing tool(s) on this machine: debootstrap, ip, systemd-nspawn, tc; "
        "install them with: apt-get install debootstrap iproute2 systemd-container"
    )
    tool = tmp_path / "debootstrap"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert missing_tools_message(["debootstrap"]) is None
