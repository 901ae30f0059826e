"""The lab network: one bridge on the controller, one veth per host, and link shaping.

Addresses are fixed so inventories and docs can name them: the controller is
10.77.0.1 on bridge ``lfbr0`` and host ``labN`` is 10.77.0.(10+N).  systemd-nspawn
creates each host's veth pair; its controller end is ``vb-labN``.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass

from .system import LabError, run

BRIDGE = "lfbr0"
SUBNET = ipaddress.IPv4Network("10.77.0.0/24")
GATEWAY = "10.77.0.1"
HOST_OFFSET = 10  # labN gets 10.77.0.(10+N)
MAX_HOSTS = 32
HOST_NAME_RE = re.compile(r"^lab([1-9][0-9]*)$")


@dataclass(frozen=True)
class LabHost:
    """One lab host: its name (``lab1``), number, and address on the lab bridge."""

    index: int

    @property
    def name(self) -> str:
        return f"lab{self.index}"

    @property
    def address(self) -> str:
        return str(SUBNET.network_address + HOST_OFFSET + self.index)

    @property
    def veth(self) -> str:
        """The controller end of the host's veth pair (named by systemd-nspawn)."""
        return f"vb-{self.name}"

    @classmethod
    def from_name(cls, name: str) -> LabHost:
        match = HOST_NAME_RE.match(name)
        if not match or not 1 <= int(match.group(1)) <= MAX_HOSTS:
            raise LabError(f"{name!r} is not a lab host name (lab1 .. lab{MAX_HOSTS})")
        return cls(int(match.group(1)))


def lab_hosts(count: int) -> list[LabHost]:
    """Hosts ``lab1`` .. ``lab<count>``."""
    if not 1 <= count <= MAX_HOSTS:
        raise LabError(f"--hosts must be between 1 and {MAX_HOSTS}, not {count}")
    return [LabHost(i) for i in range(1, count + 1)]


# --------------------------------------------------------------------------- links


def _links(kind: str | None = None) -> list[dict]:
    argv = ["ip", "-json", "-details", "link", "show"]
    if kind:
        argv += ["type", kind]
    out = run(argv, what="listing network links").stdout
    return json.loads(out) if out.strip() else []


def link_exists(name: str) -> bool:
    return run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def lab_veths() -> list[str]:
    """Controller ends of lab host veths that exist now (``vb-lab*``)."""
    return sorted(
        link["ifname"].split("@")[0]
        for link in _links("veth")
        if re.fullmatch(r"vb-lab[0-9]+", link["ifname"].split("@")[0])
    )


def bridge_state() -> tuple[bool, list[str]]:
    """Whether the lab bridge exists, and its IPv4 addresses in CIDR form."""
    proc = run(["ip", "-json", "addr", "show", "dev", BRIDGE], check=False)
    if proc.returncode != 0:
        return False, []
    data = json.loads(proc.stdout or "[]")
    addrs = [f"{a['local']}/{a['prefixlen']}" for link in data for a in link.get("addr_info", []) if a.get("family") == "inet"]
    return True, addrs


# The bridge's own MAC address, fixed. A Linux bridge otherwise takes the lowest MAC of its ports, so a host's
# veth leaving (``lab stop``) can change it: the other hosts' ARP entries for 10.77.0.1 then point at the old
# address and their answers to the controller are lost until those entries go stale (about 30 s), which looked
# like a 52 s hang of a client request in the power-off fault test. Locally administered ("02:"), "lf".
BRIDGE_MAC = "02:6c:66:00:00:01"


def ensure_bridge() -> bool:
    """Make ``lfbr0`` a bridge carrying exactly 10.77.0.1/24 and BRIDGE_MAC, up.  Returns True if it was created."""
    wanted = f"{GATEWAY}/{SUBNET.prefixlen}"
    created = False
    if link_exists(BRIDGE):
        kinds = [link.get("linkinfo", {}).get("info_kind") for link in _links() if link["ifname"] == BRIDGE]
        if kinds != ["bridge"]:
            # A leftover of another kind under our name: replace it.
            run(["ip", "link", "del", BRIDGE], what=f"removing stale link {BRIDGE}")
    if not link_exists(BRIDGE):
        run(["ip", "link", "add", BRIDGE, "type", "bridge"], what=f"creating bridge {BRIDGE}")
        created = True
    _, addrs = bridge_state()
    for stray in (a for a in addrs if a != wanted):  # removed one by one: a running lab keeps its address
        run(["ip", "addr", "del", stray, "dev", BRIDGE], what=f"removing stray address {stray} from {BRIDGE}")
    if wanted not in addrs:
        run(["ip", "addr", "add", wanted, "dev", BRIDGE], what=f"addressing {BRIDGE}")
    run(["ip", "link", "set", BRIDGE, "address", BRIDGE_MAC], what=f"fixing {BRIDGE}'s MAC address")
    run(["ip", "link", "set", BRIDGE, "up"], what=f"bringing {BRIDGE} up")
    return created


def delete_link(name: str) -> None:
    if link_exists(name):
        run(["ip", "link", "del", name], what=f"removing link {name}")


def ip_forwarding_enabled() -> bool:
    """Whether the controller routes IPv4 between interfaces (lab hosts could then leave the lab)."""
    try:
        with open("/proc/sys/net/ipv4/ip_forward", encoding="ascii") as handle:
            return handle.read().strip() == "1"
    except OSError:
        return False


# --------------------------------------------------------------------------- shaping

_RATE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([kmgt]?)(bit|bps)$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(rate: str) -> int:
    """A tc rate (``30mbit``, ``1gbit``, ``4mbps`` = megabytes/s as in tc) in bits per second."""
    match = _RATE_RE.match(rate.strip().lower())
    if not match:
        raise LabError(f"rate {rate!r} is not a tc rate such as 30mbit, 500kbit, 1gbit or 4mbps (bytes/s)")
    value = float(match.group(1)) * _SCALE[match.group(2)] * (8 if match.group(3) == "bps" else 1)
    if value < 8000:
        raise LabError(f"rate {rate!r} is below 8kbit; that is not a useful link")
    return int(value)


def format_rate(bits: int) -> str:
    """Bits per second in tc's notation, with the largest unit that keeps it whole (30000000 -> 30mbit)."""
    for prefix, scale in (("g", 10**9), ("m", 10**6), ("k", 10**3)):
        if bits % scale == 0:
            return f"{bits // scale}{prefix}bit"
    return f"{bits}bit"


def tbf_arguments(rate: str) -> list[str]:
    """``tc qdisc replace`` arguments that limit a link to ``rate`` with a token bucket.

    The bucket holds 4 ms of traffic and at least ten full-size frames, so the
    configured rate is reached without bursts that would distort benchmarks; the
    queue holds up to 100 ms of traffic before tbf drops.
    """
    bits = parse_rate(rate)
    burst = max(bits // 8 // 250, 10 * 1514)
    return ["root", "tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "100ms"]


def parse_tbf_rate(tc_json: str) -> str | None:
    """The rate of a root tbf qdisc in ``tc -json qdisc show`` output, or None."""
    for qdisc in json.loads(tc_json or "[]"):
        if qdisc.get("kind") == "tbf" and qdisc.get("root"):
            rate = qdisc.get("options", {}).get("rate")
            if rate is None:
                return "tbf"
            return format_rate(int(rate) * 8) if isinstance(rate, int) else str(rate)
    return None


def qdisc_rate(dev: str, netns_pid: int | None = None) -> str | None:
    """The tbf rate limiting ``dev`` (in the network namespace of ``netns_pid``), or None."""
    proc = run(_in_netns(netns_pid) + ["tc", "-json", "qdisc", "show", "dev", dev], check=False)
    return parse_tbf_rate(proc.stdout) if proc.returncode == 0 else None


def _in_netns(pid: int | None) -> list[str]:
    return [] if pid is None else ["nsenter", f"--target={pid}", "--net", "--"]


def set_tbf(dev: str, rate: str | None, netns_pid: int | None = None) -> None:
    """Limit ``dev`` to ``rate`` with tbf, or remove the limit when ``rate`` is None."""
    prefix = _in_netns(netns_pid)
    if rate is None:
        if qdisc_rate(dev, netns_pid) is not None:
            run(prefix + ["tc", "qdisc", "del", "dev", dev, "root"], what=f"clearing the shaping of {dev}")
        return
    run(prefix + ["tc", "qdisc", "replace", "dev", dev] + tbf_arguments(rate), what=f"shaping {dev} to {rate}")
