"""The lab's base image and how each host's root file system is made from it.

The base image is a Debian root file system made once by ``debootstrap`` and kept
read-only under ``$LLAMAFLEET_CACHE/lab/images/<key>/rootfs``; the key hashes what
determines its content (suite, package list, mirror).  Each host boots from an
overlay mount of that image with a private upper layer, so a host costs seconds
and a few megabytes, and ``lab down`` just discards the upper layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from . import host_bytecode
from .net import GATEWAY, SUBNET, LabHost
from .system import LabError, current_mounts, remove_tree, run

SUITE = "bookworm"

# What every lab host has from the start, so the roles work without reaching a
# package mirror.  The roles still install these for real on real fleets.
IMAGE_PACKAGES: tuple[str, ...] = (
    "systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-apt",
    "iproute2", "ca-certificates", "curl", "sudo", "procps", "nftables", "xz-utils",
    "rsync", "gcc", "g++", "make", "cmake", "git", "ccache", "libgomp1", "pkg-config",
)

# What a Vulkan host has installed besides: the Vulkan loader, Mesa's drivers (lavapipe, a software Vulkan device
# on the CPU, needs no /dev/dri) and vulkaninfo, as a host with a GPU has its driver. The build packages (headers,
# glslc) are the llamacpp_build role's to install.
VULKAN_PACKAGES: tuple[str, ...] = ("libvulkan1", "mesa-vulkan-drivers", "vulkan-tools")


@dataclass(frozen=True)
class HostKind:
    """A kind of lab host: the Debian suite it boots, what its image has installed, the llama.cpp backend the
    inventory gives it (``llamacpp_build_backend``)."""

    name: str
    suite: str
    packages: tuple[str, ...]
    backend: str


# cpu: Debian 12, like the machine. vulkan: Debian 13, whose Vulkan headers (1.4.309) and glslc build llama.cpp's
# Vulkan backend (Debian 12's 1.3.239 are too old), with lavapipe as its device.
HOST_KINDS: dict[str, HostKind] = {
    "cpu": HostKind("cpu", SUITE, IMAGE_PACKAGES, "cpu"),
    "vulkan": HostKind("vulkan", "trixie", IMAGE_PACKAGES + VULKAN_PACKAGES, "vulkan"),
}
DEFAULT_KIND = "cpu"

# Bump when the image customisation below changes: it is part of the cache key.
IMAGE_LAYOUT_VERSION = 3

OVERLAY_SOURCE = "llamafleet-lab"  # the mount "source" naming our overlays in mountinfo

DEFAULT_ARCHIVE = "http://deb.debian.org/debian"
DEFAULT_SECURITY = "http://deb.debian.org/debian-security"

# Suites of the Debian archive itself (``bookworm``, ``bookworm-updates``,
# ``stable-security``...): entries with these are Debian mirrors, not third-party repositories.
_DEBIAN_SUITE_RE = re.compile(
    r"^(buzz|rex|bo|hamm|slink|potato|woody|sarge|etch|lenny|squeeze|wheezy|jessie|stretch|buster|"
    r"bullseye|bookworm|trixie|forky|duke|sid|stable|testing|unstable|oldstable|oldoldstable|experimental)"
    r"(-(updates|security|backports|backports-sloppy|proposed-updates))?$"
)


# --------------------------------------------------------------------------- apt sources


@dataclass(frozen=True)
class AptSource:
    """One enabled apt source: a URI and the suites fetched from it."""

    uri: str
    suites: tuple[str, ...]

    @property
    def host(self) -> str:
        return (urlsplit(self.uri).hostname or "").lower()

    @property
    def is_debian_archive(self) -> bool:
        """True for the Debian archive or its security archive (any mirror), not third-party repositories."""
        return urlsplit(self.uri).scheme in ("http", "https") and any(_DEBIAN_SUITE_RE.match(s) for s in self.suites)


def parse_one_line_sources(text: str) -> list[AptSource]:
    """Parse ``sources.list`` format (``deb [opts] URI SUITE COMPONENTS...``)."""
    found: list[AptSource] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb"):
            continue
        line = re.sub(r"\[[^\]]*\]", " ", line)  # drop [arch=... signed-by=...]
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("deb", "deb-src"):
            found.append(AptSource(parts[1].rstrip("/"), (parts[2],)))
    return found


def parse_deb822_sources(text: str) -> list[AptSource]:
    """Parse deb822 ``.sources`` stanzas (``Types:``, ``URIs:``, ``Suites:``, ``Enabled:``)."""
    found: list[AptSource] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for raw in stanza.splitlines():
            if raw.startswith("#"):
                continue
            if raw[:1].isspace() and key:
                fields[key] += " " + raw.strip()
                continue
            name, sep, value = raw.partition(":")
            if sep:
                key = name.strip().lower()
                fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no" or not fields.get("uris"):
            continue
        suites = tuple(fields.get("suites", "").split())
        for uri in fields["uris"].split():
            found.append(AptSource(uri.rstrip("/"), suites))
    return found


def read_apt_sources(root: Path = Path("/")) -> list[AptSource]:
    """The enabled apt sources of the system at ``root`` (only files apt itself reads)."""
    etc = root / "etc" / "apt"
    sources: list[AptSource] = []
    files = [etc / "sources.list"] + sorted((etc / "sources.list.d").glob("*"))
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.name.endswith(".list"):
            sources += parse_one_line_sources(text)
        elif path.name.endswith(".sources"):
            sources += parse_deb822_sources(text)
    return sources


@dataclass(frozen=True)
class DebianMirror:
    """Where the lab gets Debian packages: the archive, its security archive, and their host names."""

    archive: str
    security: str | None

    @property
    def proxy_allow(self) -> tuple[str, ...]:
        """The proxy's allow-list: each mirror's host name, with its port when not the scheme's default."""
        entries = set()
        for uri in filter(None, (self.archive, self.security)):
            parts = urlsplit(uri)
            if parts.hostname:
                entries.add(parts.hostname.lower() + (f":{parts.port}" if parts.port else ""))
        return tuple(sorted(entries))

    @classmethod
    def from_sources(cls, sources: Sequence[AptSource]) -> DebianMirror:
        """Pick the archive and security mirrors from the controller's apt sources.

        Falls back to deb.debian.org when the controller has no Debian entries (a
        Debian derivative, say).
        """
        debian = [s for s in sources if s.is_debian_archive]
        security = next((s.uri for s in debian if any(x.endswith("-security") for x in s.suites)), None)
        archive = next(
            (s.uri for s in debian if s.uri != security and not all(x.endswith("-security") for x in s.suites)),
            None,
        )
        if archive is None:
            return cls(DEFAULT_ARCHIVE, DEFAULT_SECURITY)
        return cls(archive, security)


def detect_mirror(root: Path = Path("/")) -> DebianMirror:
    """The Debian mirror named in this controller's apt sources."""
    return DebianMirror.from_sources(read_apt_sources(root))


# --------------------------------------------------------------------------- base image


def image_key(suite: str, packages: Iterable[str], mirror: DebianMirror) -> str:
    """A short, stable hash of everything that determines the base image's content."""
    material = json.dumps(
        {
            "layout": IMAGE_LAYOUT_VERSION,
            "suite": suite,
            "packages": sorted(set(packages)),
            "archive": mirror.archive,
            "security": mirror.security,
        },
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BaseImage:
    """A built base image: its key and read-only root file system."""

    key: str
    directory: Path

    @property
    def rootfs(self) -> Path:
        return self.directory / "rootfs"

    @property
    def metadata_file(self) -> Path:
        return self.directory / "image.json"

    def is_complete(self) -> bool:
        return self.metadata_file.is_file() and (self.rootfs / "usr" / "lib" / "systemd" / "systemd").exists()


def _apt_sources_text(suite: str, mirror: DebianMirror) -> str:
    lines = [f"deb {mirror.archive} {suite} main", f"deb {mirror.archive} {suite}-updates main"]
    if mirror.security:
        lines.append(f"deb {mirror.security} {suite}-security main")
    return "# Written by llamafleet lab: the controller's Debian mirrors, reached through the lab proxy.\n" + "\n".join(lines) + "\n"


def _customise_image(rootfs: Path, suite: str, mirror: DebianMirror) -> None:
    """Make a fresh debootstrap tree a neutral base every host can start from."""
    # Host identity is per host: no SSH host keys, no machine id, no hostname here.
    for key in (rootfs / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    (rootfs / "etc" / "machine-id").write_text("", encoding="ascii")
    # dbus installs its own copy of the build's machine id; make it follow /etc/machine-id as on a fresh install.
    dbus_id = rootfs / "var" / "lib" / "dbus" / "machine-id"
    if dbus_id.exists() or dbus_id.is_symlink():
        dbus_id.unlink()
        dbus_id.symlink_to("/etc/machine-id")
    (rootfs / "etc" / "hostname").write_text("localhost\n", encoding="ascii")
    # Hosts have no resolver of their own (only the lab network); the controller's
    # resolver, copied in by debootstrap, is not reachable from there.
    resolv = rootfs / "etc" / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("# lab hosts resolve names through /etc/hosts; packages come through the lab proxy\n", encoding="ascii")
    (rootfs / "etc" / "apt" / "sources.list").write_text(_apt_sources_text(suite, mirror), encoding="ascii")
    # The packages' archives were needed only to install them.
    for deb in (rootfs / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        deb.unlink()
    run(["systemctl", f"--root={rootfs}", "enable", "systemd-networkd.service"], what="enabling systemd-networkd in the image")


def ensure_base_image(
    images_dir: Path,
    mirror: DebianMirror,
    *,
    suite: str = SUITE,
    packages: Sequence[str] = IMAGE_PACKAGES,
    progress: Callable[[str], None] = print,
) -> BaseImage:
    """Return the cached base image for (suite, packages, mirror), building it if needed.

    The build happens in a temporary directory renamed into place only when
    complete, so an interrupted build never leaves a half image behind.
    """
    key = image_key(suite, packages, mirror)
    image = BaseImage(key, images_dir / key)
    if image.is_complete():
        return image
    images_dir.mkdir(parents=True, exist_ok=True)
    for stale in images_dir.glob(f"{key}.tmp-*"):
        remove_tree(stale)
    if image.directory.exists():
        remove_tree(image.directory)  # an incomplete image from an older run
    tmp = images_dir / f"{key}.tmp-{os.getpid()}"
    progress(f"==> building base image {key} (debootstrap {suite}, ~2 min, once)")
    started = time.monotonic()
    try:
        rootfs = tmp / "rootfs"
        rootfs.parent.mkdir(parents=True)
        log = tmp / "debootstrap.log"
        with open(log, "w", encoding="utf-8") as out:
            proc = subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs), mirror.archive],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False,
            )
        if proc.returncode != 0:
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-8:]
            raise LabError(
                f"debootstrap of {suite} from {mirror.archive} failed (exit {proc.returncode}):\n  " + "\n  ".join(tail)
            )
        _customise_image(rootfs, suite, mirror)
        size = sum(f.stat().st_size for f in rootfs.rglob("*") if f.is_file() and not f.is_symlink())
        meta = {
            "key": key, "suite": suite, "packages": list(packages), "archive": mirror.archive,
            "security": mirror.security, "layout": IMAGE_LAYOUT_VERSION, "bytes": size,
            "built_seconds": round(time.monotonic() - started, 1),
        }
        (tmp / "image.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.rename(tmp, image.directory)
    except BaseException:
        with contextlib.suppress(Exception):
            remove_tree(tmp)
        raise
    progress(f"    base image ready in {time.monotonic() - started:.0f} s ({size / 2**20:.0f} MiB)")
    return image


def prune_images(images_dir: Path, keep: Iterable[str]) -> list[str]:
    """Delete cached base images other than those in ``keep`` that no host overlay uses; return their keys."""
    keep = set(keep)
    if not images_dir.is_dir():
        return []
    in_use = {str(Path(lower).parent.name) for m in current_mounts() if m.source == OVERLAY_SOURCE
              for lower in (m.option("lowerdir") or "").split(":") if lower}
    removed = []
    for entry in sorted(images_dir.iterdir()):
        if entry.is_dir() and entry.name not in keep and entry.name not in in_use:
            remove_tree(entry)
            removed.append(entry.name)
    return removed


# --------------------------------------------------------------------------- per-host root


@dataclass(frozen=True)
class HostRoot:
    """A host's overlay: upper and work layers on top of the base image, mounted at ``root``."""

    directory: Path

    @property
    def upper(self) -> Path:
        return self.directory / "upper"

    @property
    def work(self) -> Path:
        return self.directory / "work"

    @property
    def root(self) -> Path:
        return self.directory / "root"

    @property
    def console_log(self) -> Path:
        return self.directory / "console.log"

    def mount(self, image: BaseImage) -> None:
        """Mount a fresh, empty overlay of ``image`` at :attr:`root`."""
        for path in (self.upper, self.work, self.root):
            path.mkdir(parents=True, exist_ok=True)
        options = f"lowerdir={image.rootfs},upperdir={self.upper},workdir={self.work}"
        run(["mount", "-t", "overlay", OVERLAY_SOURCE, "-o", options, str(self.root)],
            what=f"mounting the overlay root of {self.directory.name}")

    def is_mounted(self) -> bool:
        return os.path.ismount(self.root)


def hosts_file_text(hosts: Sequence[LabHost]) -> str:
    """/etc/hosts for every lab host: loopback plus every lab host by name."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{GATEWAY}\tlab-controller"]
    lines += [f"{h.address}\t{h.name}" for h in hosts]
    return "\n".join(lines) + "\n"


def networkd_text(host: LabHost) -> str:
    """systemd-networkd config giving the container end of the veth (``host0``) its lab address."""
    return (
        "# Written by llamafleet lab\n"
        "[Match]\nName=host0\n\n"
        f"[Network]\nAddress={host.address}/{SUBNET.prefixlen}\nGateway={GATEWAY}\n"
        "LinkLocalAddressing=no\nIPv6AcceptRA=no\n"
    )


def apt_proxy_text(proxy_url: str) -> str:
    """apt configuration sending every package download through the lab proxy."""
    return (
        "// Written by llamafleet lab: packages come through the controller's allow-listing proxy.\n"
        f'Acquire::http::Proxy "{proxy_url}";\n'
        f'Acquire::https::Proxy "{proxy_url}";\n'
        'Acquire::http::Pipeline-Depth "0";\n'
        'Acquire::Retries "3";\n'
    )


# systemd-sysctl.service is skipped in a container (ConditionPathIsReadWrite=/proc/sys/), but nspawn leaves the
# container's own /proc/sys/net writable: this unit applies the network settings of sysctl.d at boot as a real
# host does (e.g. the gate's ping permission the llama_server role writes, after `lab stop|start`).
NET_SYSCTL_UNIT = "llamafleet-lab-net-sysctl.service"
NET_SYSCTL_UNIT_TEXT = (
    "[Unit]\n"
    "Description=llamafleet lab: network sysctl settings as on a booted Debian host\n"
    "DefaultDependencies=no\n"
    "Before=sysinit.target network-pre.target\n"
    "ConditionPathIsReadWrite=/proc/sys/net/\n"
    "\n"
    "[Service]\n"
    "Type=oneshot\n"
    "RemainAfterExit=yes\n"
    "ExecStart=/lib/systemd/systemd-sysctl --prefix=/net/\n"
    "\n"
    "[Install]\n"
    "WantedBy=sysinit.target\n"
)


# A second Vulkan driver manifest for lavapipe on a Vulkan host, outside the loader's search path: with
# VK_DRIVER_FILES naming both it and Mesa's own (LAVAPIPE_ICD), the loader lists two devices, as on a host with two
# GPUs (the multi-device shapes of rpc-server are tested so). Without that variable nothing changes.
LAVAPIPE_ICD = "/usr/share/vulkan/icd.d/lvp_icd.json"
SECOND_LAVAPIPE_ICD = "/etc/llamafleet-lab/lvp_icd.second.json"


def provision_host(
    root: Path, host: LabHost, all_hosts: Sequence[LabHost], authorized_key: str, proxy_url: str,
    kind: str = DEFAULT_KIND,
) -> dict[str, str]:
    """Give a freshly mounted host root its identity; return its SSH public host keys by type.

    Identity means: hostname, machine id, SSH host keys, address, /etc/hosts,
    root's authorized key, and the apt proxy; and the network sysctl defaults (NET_SYSCTL_UNIT), and the bytecode
    cache for Ansible's module payloads (:mod:`llamafleet.lab.host_bytecode`).
    A ``vulkan`` host also gets :data:`SECOND_LAVAPIPE_ICD`.
    """
    etc = root / "etc"
    for path, text in host_bytecode.host_files().items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    if kind == "vulkan":
        second = root / SECOND_LAVAPIPE_ICD.lstrip("/")
        second.parent.mkdir(parents=True, exist_ok=True)
        second.write_bytes((root / LAVAPIPE_ICD.lstrip("/")).read_bytes())
    units = etc / "systemd" / "system"
    (units / "sysinit.target.wants").mkdir(parents=True, exist_ok=True)
    (units / NET_SYSCTL_UNIT).write_text(NET_SYSCTL_UNIT_TEXT, encoding="ascii")
    wants = units / "sysinit.target.wants" / NET_SYSCTL_UNIT
    if not wants.is_symlink():
        wants.symlink_to("../" + NET_SYSCTL_UNIT)
    (etc / "hostname").write_text(host.name + "\n", encoding="ascii")
    (etc / "machine-id").write_text(uuid.uuid4().hex + "\n", encoding="ascii")
    (etc / "hosts").write_text(hosts_file_text(all_hosts), encoding="ascii")
    network = etc / "systemd" / "network"
    network.mkdir(parents=True, exist_ok=True)
    (network / "10-host0.network").write_text(networkd_text(host), encoding="ascii")
    (etc / "apt" / "apt.conf.d" / "01llamafleet-lab-proxy").write_text(apt_proxy_text(proxy_url), encoding="ascii")
    ssh_dir = root / "root" / ".ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys_file = ssh_dir / "authorized_keys"
    keys_file.write_text(authorized_key.strip() + "\n", encoding="ascii")
    keys_file.chmod(0o600)
    # ssh-keygen -A -f PREFIX creates every missing host key type under PREFIX/etc/ssh.
    run(["ssh-keygen", "-q", "-A", "-f", str(root)], what=f"generating SSH host keys for {host.name}")
    public: dict[str, str] = {}
    for pub in sorted((etc / "ssh").glob("ssh_host_*_key.pub")):
        key_type, blob = pub.read_text(encoding="ascii").split()[:2]
        public[key_type] = blob
    if not public:
        raise LabError(f"no SSH host keys were generated under {root}/etc/ssh")
    return public
