"""llamacpp_host: a build's binaries and flags from recorded help texts, dpkg's status lines, the Vulkan header's
version, the version directories under a build root."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamafleet.core.llamacpp_host import (
    BuildInspectError,
    dpkg_query_argv,
    flag_runner,
    inspect_build,
    missing_packages,
    parse_dpkg_status,
    version_dirs,
    vulkan_header_version,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
TEXTS = {
    ("/b/bin/llama-server", "--help"): "llama-server_0c1e570_help_real.txt",
    ("/b/bin/llama-server", "--version"): "llama-server_0c1e570_version_real.txt",
    ("/b/bin/ggml-rpc-server", "--help"): "ggml-rpc-server_0c1e570_help_real.txt",
}


def recorded(path: str, flag: str) -> str:
    return (FIXTURES / TEXTS[(path, flag)]).read_text(encoding="utf-8")


def test_a_build_with_both_servers() -> None:
    found = inspect_build("/b/bin", ["llama-server", "ggml-rpc-server", "llama-bench"], recorded,
                          ["llama_server", "rpc_server"])
    assert (found["llama_server"], found["rpc_server"]) == ("llama-server", "ggml-rpc-server")
    assert found["rpc_server_path"] == "/b/bin/ggml-rpc-server"
    assert found["features"]["llama_server"]["rpc"] is True and found["features"]["rpc_server"]["cache"] is True
    assert found["version"] and found["version"] == found["features"]["version"]["version"]


def test_a_required_binary_that_is_missing_is_named() -> None:
    with pytest.raises(BuildInspectError, match=r"/b/bin has no rpc_server \(looked for ggml-rpc-server\)"):
        inspect_build("/b/bin", ["llama-server"], recorded, ["rpc_server"])


def test_no_binaries_reads_nothing() -> None:
    found = inspect_build("/b/bin", [], recorded)
    assert found["llama_server"] is None and found["rpc_server"] is None and found["version"] is None


def test_a_binary_that_fails_is_named_with_its_output() -> None:
    run = flag_runner(lambda argv: (2, "", "error while loading shared libraries: libgomp.so.1\n"))
    with pytest.raises(BuildInspectError, match=r"/b/bin/llama-server --help failed \(rc=2\): error while loading"):
        inspect_build("/b/bin", ["llama-server"], run)
    assert flag_runner(lambda argv: (0, "out ", "err"))("/x", "--help") == "out err"


def test_dpkg_status() -> None:
    wanted = ["gcc", "cmake", "libgomp1", "ccache"]
    assert dpkg_query_argv(wanted)[:4] == ["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\n", "--"]
    text = "gcc installed\ncmake config-files\nlibgomp1:i386 not-installed\nlibgomp1:amd64 installed\n\n"
    status = parse_dpkg_status(text, wanted)
    assert status == {"gcc": "installed", "cmake": "config-files", "libgomp1": "installed", "ccache": None}
    assert missing_packages(wanted, status) == ["cmake", "ccache"]
    assert missing_packages(["gcc", "make"], status) == ["make"]


def test_vulkan_header_version() -> None:
    header = "// Version of this file\n#define VK_HEADER_VERSION 309\n#define VK_HEADER_VERSION_COMPLETE x\n"
    assert vulkan_header_version(header) == 309
    assert vulkan_header_version("#define VK_HEADER_VERSION_COMPLETE 1\n") == 0
    assert vulkan_header_version("") == 0


def test_version_dirs_newest_first_without_links_or_hidden() -> None:
    entries = [("old-cpu", True, 10.0), ("new-cpu", True, 30.0), ("current", False, 40.0),
               (".tmp", True, 50.0), ("mid-cpu.partial", True, 20.0)]
    assert version_dirs("/r", entries) == [{"path": "/r/new-cpu", "mtime": 30.0},
                                           {"path": "/r/mid-cpu.partial", "mtime": 20.0},
                                           {"path": "/r/old-cpu", "mtime": 10.0}]
