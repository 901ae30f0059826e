"""Base-image inputs: apt sources, mirror detection, cache key, per-host files (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamafleet.lab.image import (
    IMAGE_PACKAGES,
    AptSource,
    DebianMirror,
    apt_proxy_text,
    hosts_file_text,
    image_key,
    networkd_text,
    parse_deb822_sources,
    parse_one_line_sources,
    read_apt_sources,
)
from llamafleet.lab.net import lab_hosts

# The controller's /etc/apt/sources.list.d/debian.sources, as found on the development machine.
CONTROLLER_DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
# http://snapshot.debian.org/archive/debian-security/20250520T000000Z
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""

NODESOURCE = """\
Types: deb
URIs: https://deb.nodesource.com/node_20.x
Suites: nodistro
Components: main
"""


def test_parse_deb822_controller_sources() -> None:
    assert parse_deb822_sources(CONTROLLER_DEB822) == [
        AptSource("http://deb.debian.org/debian", ("bookworm", "bookworm-updates")),
        AptSource("http://deb.debian.org/debian-security", ("bookworm-security",)),
    ]


def test_parse_deb822_skips_disabled_and_folds_continuations() -> None:
    text = "Enabled: no\nURIs: http://a.example/debian\nSuites: bookworm\n\nURIs: http://b.example/debian\n  http://c.example/debian/\nSuites: trixie\n"
    assert parse_deb822_sources(text) == [
        AptSource("http://b.example/debian", ("trixie",)),
        AptSource("http://c.example/debian", ("trixie",)),
    ]


def test_parse_one_line_sources() -> None:
    text = (
        "# comment\n"
        "deb http://ftp.de.debian.org/debian/ bookworm main contrib\n"
        "deb [arch=amd64 signed-by=/k.gpg] https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n"
        "deb-src http://ftp.de.debian.org/debian bookworm main\n"
        "deb http://security.debian.org/debian-security bookworm-security main # trailing\n"
    )
    assert parse_one_line_sources(text) == [
        AptSource("http://ftp.de.debian.org/debian", ("bookworm",)),
        AptSource("https://packages.cloud.google.com/apt", ("cloud-sdk-bookworm",)),
        AptSource("http://ftp.de.debian.org/debian", ("bookworm",)),
        AptSource("http://security.debian.org/debian-security", ("bookworm-security",)),
    ]


@pytest.mark.parametrize(
    ("suites", "debian"),
    [(("bookworm",), True), (("bookworm-updates",), True), (("stable-security",), True), (("sid",), True),
     (("nodistro",), False), (("cloud-sdk-bookworm",), False), (("bookworm-pgdg",), False)],
)
def test_is_debian_archive(suites: tuple[str, ...], debian: bool) -> None:
    assert AptSource("http://x.example/debian", suites).is_debian_archive is debian


def test_mirror_from_controller_sources() -> None:
    mirror = DebianMirror.from_sources(parse_deb822_sources(CONTROLLER_DEB822 + "\n" + NODESOURCE))
    assert mirror == DebianMirror("http://deb.debian.org/debian", "http://deb.debian.org/debian-security")
    assert mirror.proxy_allow == ("deb.debian.org",)  # never the third-party repository


def test_mirror_allow_list_keeps_custom_ports_and_both_hosts() -> None:
    sources = parse_one_line_sources(
        "deb http://mirror.local:8080/debian bookworm main\ndeb http://security.debian.org/debian-security bookworm-security main\n"
    )
    assert DebianMirror.from_sources(sources).proxy_allow == ("mirror.local:8080", "security.debian.org")


def test_mirror_falls_back_to_deb_debian_org() -> None:
    mirror = DebianMirror.from_sources(parse_deb822_sources(NODESOURCE))
    assert mirror.archive == "http://deb.debian.org/debian"
    assert mirror.proxy_allow == ("deb.debian.org",)


def test_read_apt_sources_reads_only_what_apt_reads(tmp_path: Path) -> None:
    listd = tmp_path / "etc" / "apt" / "sources.list.d"
    listd.mkdir(parents=True)
    (tmp_path / "etc" / "apt" / "sources.list").write_text("deb http://one.example/debian bookworm main\n")
    (listd / "debian.sources").write_text(CONTROLLER_DEB822)
    (listd / "nodesource.sources.disabled-by-farm").write_text(NODESOURCE)
    hosts = [s.host for s in read_apt_sources(tmp_path)]
    assert hosts == ["one.example", "deb.debian.org", "deb.debian.org"]


def test_image_key_is_stable_and_sensitive() -> None:
    mirror = DebianMirror("http://deb.debian.org/debian", "http://deb.debian.org/debian-security")
    key = image_key("bookworm", IMAGE_PACKAGES, mirror)
    assert len(key) == 16 and int(key, 16) >= 0
    assert image_key("bookworm", reversed(IMAGE_PACKAGES), mirror) == key  # order does not matter
    assert image_key("bookworm", list(IMAGE_PACKAGES) + ["curl"], mirror) == key  # nor duplicates
    assert image_key("trixie", IMAGE_PACKAGES, mirror) != key
    assert image_key("bookworm", list(IMAGE_PACKAGES) + ["vim"], mirror) != key
    assert image_key("bookworm", IMAGE_PACKAGES, DebianMirror("http://ftp.de.debian.org/debian", None)) != key


def test_image_includes_what_the_roles_need_offline() -> None:
    for package in ("systemd", "systemd-sysv", "openssh-server", "python3", "python3-apt", "libgomp1", "cmake",
                    "g++", "ccache", "nftables", "curl", "ca-certificates"):
        assert package in IMAGE_PACKAGES


def test_per_host_files() -> None:
    hosts = lab_hosts(3)
    assert networkd_text(hosts[1]).count("Address=10.77.0.12/24") == 1
    assert "Gateway=10.77.0.1\n" in networkd_text(hosts[1])
    assert "Name=host0\n" in networkd_text(hosts[1])
    etc_hosts = hosts_file_text(hosts)
    assert "10.77.0.11\tlab1\n" in etc_hosts and "10.77.0.13\tlab3\n" in etc_hosts
    assert etc_hosts.startswith("127.0.0.1\tlocalhost\n")
    proxy = apt_proxy_text("http://10.77.0.1:3142")
    assert 'Acquire::http::Proxy "http://10.77.0.1:3142";' in proxy
    assert 'Acquire::https::Proxy "http://10.77.0.1:3142";' in proxy
