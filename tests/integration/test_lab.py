"""The lab for real: `llamafleet lab up` makes three hosts, Ansible manages them, `lab down` leaves nothing.

Needs root (bridges, mounts, containers).  Every test drives the real CLI, real
SSH, real systemd inside the hosts, real apt through the lab proxy and real HTTP
ranges from the lab mirror.  The module fixture takes the lab down however the
tests end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamafleet.lab import LLAMA_CPP_SOURCE, MODEL, LabPaths, leftovers, ssh
from llamafleet.lab.core import DEFAULT_MEMORY_MIB
from llamafleet.lab.memory import memory_hierarchy
from tests.helpers import BIN, INVENTORY, cli, env
from tests.unit.needs import needs

pytestmark = [
    pytest.mark.lab,
    needs(os.geteuid() == 0, "root (the lab makes bridges, mounts, containers)"),
    needs(shutil.which("systemd-nspawn"), "systemd-nspawn (apt-get install systemd-container)"),
]

HOSTS = {"lab1": "10.77.0.11", "lab2": "10.77.0.12", "lab3": "10.77.0.13"}
PATHS = LabPaths.default()
MIRROR = "http://10.77.0.1:8089"
MEMORY_MIB = DEFAULT_MEMORY_MIB


def ansible(pattern: str, module: str, args: str | None = None, timeout: float = 300) -> dict[str, tuple[str, dict]]:
    """Run an ad-hoc Ansible module on the lab inventory; return {host: (status, result)}."""
    cmd = [str(BIN / "ansible"), "-i", str(INVENTORY), pattern, "-m", module]
    if args:
        cmd += ["-a", args]
    e = env() | {"ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal", "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout, check=False)
    results: dict[str, tuple[str, dict]] = {}
    # The minimal callback prints "HOST | STATUS => {json}" per host, or, for commands,
    # "HOST | STATUS | rc=N >>" followed by the command's output.
    headers = list(re.finditer(r"^(\S+) \| ([A-Z!]+)(?: \| rc=(\d+))? (=>|>>)\s", proc.stdout, re.M))
    for match, following in zip(headers, headers[1:] + [None]):
        text = proc.stdout[match.end():following.start() if following else None]
        if match.group(4) == "=>":
            body = json.JSONDecoder().raw_decode(text)[0]
        else:
            body = {"rc": int(match.group(3)), "stdout": text.rstrip("\n")}
        results[match.group(1)] = (match.group(2), body)
    assert set(results) == set(HOSTS), f"ansible output:\n{proc.stdout}\n{proc.stderr}"
    return results


def nothing_left() -> list[str]:
    """What of a lab is still on this machine, checked with the system's own tools."""
    left = leftovers(PATHS)  # the library's view ...
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    left += [f"link {name}" for name in re.findall(r"^\d+: ([^:@]+)", links, re.M)
             if name == "lfbr0" or name.startswith("vb-lab")]  # ... and the system's
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
            state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        if os.path.basename(argv[0]) == b"systemd-nspawn" or any(a.startswith(b"llamafleet.lab.") for a in argv):
            left.append(f"process {proc_dir.name}: {b' '.join(argv).decode(errors='replace')}")
    mounts = Path("/proc/self/mountinfo").read_text()
    left += [f"mount {line.split()[4]}" for line in mounts.splitlines()
             if "llamafleet-lab" in line or str(PATHS.hosts_dir) in line]
    if PATHS.hosts_dir.is_dir():
        left += [f"host dir {p}" for p in PATHS.hosts_dir.iterdir()]
    left += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/llamafleet-lab")]
    memory = memory_hierarchy()  # v1: the memory cgroups sit below this process's own
    left += [f"memory cgroup {memory.parent}"] if memory is not None and memory.parent.exists() else []
    left += [f"inventory {p}" for p in (INVENTORY, INVENTORY.parent / "group_vars" / "all" / "lab.yml") if p.exists()]
    return sorted(set(left))


@pytest.fixture(scope="module")
def lab() -> Iterator[str]:
    """A three-host lab for the module; taken down afterwards, pass or fail."""
    try:
        yield cli("lab", "up", "--hosts", "3", timeout=600).stdout
    finally:
        cli("lab", "down", check=False, timeout=120)


def test_up_makes_three_hosts_and_an_inventory(lab: str) -> None:
    assert "lab1 10.77.0.11 (orchestrator)" in lab or "already up" in lab
    inventory = INVENTORY.read_text()
    for name, address in HOSTS.items():
        assert f"{name} ansible_host={address} llamafleet_cluster_address={address}" in inventory
    assert "StrictHostKeyChecking=yes" in inventory


def test_up_again_is_a_fast_no_op(lab: str) -> None:
    started = time.monotonic()
    out = cli("lab", "up", "--hosts", "3").stdout
    assert "lab already up" in out
    assert "booting" not in out
    assert time.monotonic() - started < 10


def test_status_reports_every_host_healthy(lab: str) -> None:
    proc = cli("lab", "status")
    for name, address in HOSTS.items():
        assert re.search(rf"^{name}\s+{re.escape(address)}\s+up\s+ok\s+running\s+unlimited\s+{MEMORY_MIB} MiB$",
                         proc.stdout, re.M), proc.stdout
    assert re.search(r"^proxy\s+http://10.77.0.1:3142\s+\d+\s+yes$", proc.stdout, re.M)
    assert re.search(r"^mirror\s+http://10.77.0.1:8089\s+\d+\s+yes$", proc.stdout, re.M)


# What a host's processes see of their own limit: the container's cgroup, v1 or v2.
LIMIT_INSIDE = ("cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max")


def test_each_host_has_an_enforced_memory_limit(lab: str) -> None:
    for name in HOSTS:
        assert int(ssh(name, LIMIT_INSIDE).stdout) == MEMORY_MIB * 1024 * 1024, name
    # Going over the limit gets the process killed inside that host only; the host goes on.
    # (a shell reports the kill: ssh itself exits 255 for a command that dies of a signal)
    hog = f"python3 -c 'b = bytearray({MEMORY_MIB + 512} * 1024 * 1024); print(len(b))'; echo rc=$?"
    proc = ssh("lab2", hog, check=False)
    assert proc.stdout.strip() == "rc=137", (proc.returncode, proc.stdout, proc.stderr)
    assert ssh("lab2", "python3 -c 'b = bytearray(256 * 1024 * 1024); print(len(b))'").stdout.strip() == str(256 << 20)
    assert ssh("lab2", "systemctl is-system-running").stdout.strip() == "running"


def test_memory_limit_changes_in_place(lab: str) -> None:
    try:
        out = cli("lab", "up", "--hosts", "3", "--memory-mib", "3072").stdout
        assert f"lab2: memory limit {MEMORY_MIB} -> 3072 MiB" in out and "booting" not in out, out
        assert int(ssh("lab3", LIMIT_INSIDE).stdout) == 3072 * 1024 * 1024
        assert re.search(r"^lab3\s.*\s3072 MiB$", cli("lab", "status").stdout, re.M)
    finally:
        out = cli("lab", "up", "--hosts", "3").stdout
    assert f"lab3: memory limit 3072 -> {MEMORY_MIB} MiB" in out, out
    assert int(ssh("lab3", LIMIT_INSIDE).stdout) == MEMORY_MIB * 1024 * 1024
    refused = cli("lab", "up", "--hosts", "3", "--memory-mib", "100", check=False)
    assert refused.returncode != 0 and "at least 512 MiB" in refused.stdout + refused.stderr


def test_ansible_ping(lab: str) -> None:
    results = ansible("llamafleet", "ansible.builtin.ping")
    assert {h: (s, r.get("ping")) for h, (s, r) in results.items()} == {h: ("SUCCESS", "pong") for h in HOSTS}


def test_ansible_setup_sees_real_systemd_hosts(lab: str) -> None:
    results = ansible("llamafleet", "ansible.builtin.setup")
    for name, address in HOSTS.items():
        status, result = results[name]
        facts = result["ansible_facts"]
        assert status == "SUCCESS"
        assert facts["ansible_hostname"] == name
        assert facts["ansible_default_ipv4"]["address"] == address
        assert facts["ansible_default_ipv4"]["gateway"] == "10.77.0.1"
        assert facts["ansible_service_mgr"] == "systemd"
        assert facts["ansible_distribution_release"] == "bookworm"
    machine_ids = {results[n][1]["ansible_facts"]["ansible_machine_id"] for n in HOSTS}
    assert len(machine_ids) == 3  # every host has its own identity


def test_systemd_is_running_on_every_host(lab: str) -> None:
    results = ansible("llamafleet", "ansible.builtin.command", "systemctl is-system-running")
    assert {h: r["stdout"] for h, (_, r) in results.items()} == {h: "running" for h in HOSTS}


def test_hosts_have_distinct_pinned_host_keys(lab: str) -> None:
    known = PATHS.known_hosts.read_text().splitlines()
    ed25519 = {line.split()[0]: line.split()[2] for line in known if line.split()[1] == "ssh-ed25519"}
    assert set(ed25519) == set(HOSTS.values())
    assert len(set(ed25519.values())) == 3


def test_hosts_reach_each_other_by_address(lab: str) -> None:
    probe = ("import socket,sys\n"
             "for a in sys.argv[1:]:\n"
             "    socket.create_connection((a, 22), timeout=5).close()\n"
             "print('ok')")
    for name in HOSTS:
        others = [a for n, a in HOSTS.items() if n != name]
        assert ssh(name, ["python3", "-c", probe, *others]).stdout.strip() == "ok"


def test_bridge_has_its_own_fixed_mac(lab: str) -> None:
    """Set, not inherited from a port: a host leaving the bridge must not change the address the others reach
    the controller at (see llamafleet.lab.net.BRIDGE_MAC)."""
    from llamafleet.lab.net import BRIDGE, BRIDGE_MAC

    sysfs = Path("/sys/class/net") / BRIDGE
    assert (sysfs / "address").read_text().strip() == BRIDGE_MAC
    assert (sysfs / "addr_assign_type").read_text().strip() == "3"  # NET_ADDR_SET


def test_mirror_serves_ranges_to_hosts(lab: str) -> None:
    model = MODEL.path(PATHS.root)
    with open(model, "rb") as handle:
        handle.seek(1_000_000)
        expected = handle.read(4096).hex()
    url = f"{MIRROR}/models/{MODEL.name}"
    out = ssh("lab2", f"curl -sS -D /tmp/headers -r 1000000-1004095 {url} | od -An -v -tx1 | tr -d ' \\n'; "
                      "echo; cat /tmp/headers").stdout
    body_hex, headers = out.split("\n", 1)
    assert body_hex == expected
    assert "HTTP/1.1 206 Partial Content" in headers
    assert f"Content-Range: bytes 1000000-1004095/{model.stat().st_size}" in headers
    head = ssh("lab3", f"curl -sSI {url}").stdout
    assert "HTTP/1.1 200 OK" in head and "Accept-Ranges: bytes" in head


def test_interrupted_download_resumes(lab: str) -> None:
    url = f"{MIRROR}/src/{LLAMA_CPP_SOURCE.name}"
    out = ssh("lab3", f"cd /tmp && curl -sS -r 0-999999 -o part {url} && stat -c %s part && "
                      f"curl -sS -C - -o part {url} && sha256sum part && rm part").stdout.split()
    assert out[0] == "1000000"
    assert out[1] == LLAMA_CPP_SOURCE.sha256


def test_apt_works_through_the_proxy(lab: str) -> None:
    update = ssh("lab1", "apt-get update", timeout=300)
    assert "deb.debian.org" in update.stdout
    download = ssh("lab1", "cd /tmp && apt-get download -q hello && ls hello_*.deb && rm hello_*.deb", timeout=300)
    assert "hello_" in download.stdout


def test_proxy_refuses_other_destinations(lab: str) -> None:
    for target in ("http://example.com/", "http://1.1.1.1/", "http://deb.debian.org:8080/", "http://10.77.0.12:22/"):
        out = ssh("lab1", f"curl -s -o /dev/null -w '%{{http_code}}' -x http://10.77.0.1:3142 {target}", check=False)
        assert out.stdout == "403", target


def test_shape_limits_the_link(lab: str) -> None:
    url = f"{MIRROR}/models/{MODEL.name}"
    fetch = f"curl -sS -o /dev/null -w '%{{speed_download}}' -r 0-7999999 {url}"
    try:
        cli("lab", "shape", "lab2", "--rate", "30mbit")
        assert "tbf" in ssh("lab2", "tc qdisc show dev host0").stdout  # the host's own direction too
        assert "30mbit" in cli("lab", "status").stdout
        shaped = float(ssh("lab2", fetch).stdout)
    finally:
        cli("lab", "shape", "lab2", "--clear")
    unshaped = float(ssh("lab2", fetch).stdout)
    assert 2.5e6 < shaped < 4.2e6  # 30 Mbit/s is 3.75 MB/s
    assert unshaped > 4 * shaped
    assert "tbf" not in ssh("lab2", "tc qdisc show dev host0").stdout


def test_shrink_and_recover_from_stale_pieces(lab: str) -> None:
    out = cli("lab", "up", "--hosts", "2").stdout
    assert "removing hosts beyond --hosts 2: lab3" in out, out
    # Kill lab2 the hard way (its overlay stays mounted) and dirty the bridge.
    lab2 = [m for m in subprocess.run(["pgrep", "-f", "systemd-nspawn .* -M lab2 "], capture_output=True,
                                      text=True, check=False).stdout.split()]
    assert lab2
    subprocess.run(["kill", "-KILL", *lab2], check=True)
    subprocess.run(["ip", "addr", "add", "10.99.0.1/24", "dev", "lfbr0"], check=True)
    out = cli("lab", "up", "--hosts", "2").stdout
    assert "booting lab2" in out and "booting lab1" not in out, out
    status = cli("lab", "status").stdout
    assert "lab3" not in status and "10.99.0.1" not in status
    assert re.search(r"^lab2\s+10.77.0.12\s+up\s+ok\s+running", status, re.M), status


def test_down_without_state_files_leaves_nothing(lab: str) -> None:
    for path in [PATHS.state_file, PATHS.known_hosts, *PATHS.run_dir.glob("*.pid")]:
        path.unlink(missing_ok=True)
    started = time.monotonic()
    cli("lab", "down")
    assert time.monotonic() - started < 15
    assert nothing_left() == []
    again = cli("lab", "down")  # idempotent
    assert "lab is down" in again.stdout
    assert cli("lab", "status", check=False).returncode == 1


def test_failed_up_removes_what_it_made() -> None:
    assert nothing_left() == []
    # Occupy the mirror's port: the bridge and the proxy come up first, then the mirror cannot.
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", 8089))
    blocker.listen()
    try:
        proc = cli("lab", "up", "--hosts", "1", check=False, timeout=300)
    finally:
        blocker.close()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mirror did not start listening" in proc.stderr
    assert "Address already in use" in proc.stderr
    assert "removing what this run made" in proc.stdout
    assert nothing_left() == []
