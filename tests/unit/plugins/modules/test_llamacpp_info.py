"""llamacpp_info module: binaries that print the recorded --help/--version texts, and the real dev build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import llamacpp_info
from tests.unit.module_runner import run_main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(llamacpp_info.main, args, capsys)


def fake_binary(path: Path, help_file: str, help_to_stderr: bool, version_file: str | None = None) -> None:
    """A script answering --help (and --version, on stderr like llama.cpp) with a recorded text."""
    redirect = " >&2" if help_to_stderr else ""
    body = "#!/bin/sh\ncase \"$1\" in\n  --help) cat '%s'%s ;;\n" % (FIXTURES / help_file, redirect)
    if version_file:
        body += "  --version) cat '%s' >&2 ;;\n" % (FIXTURES / version_file)
    body += "  *) echo \"error: unknown argument: $1\" >&2; exit 1 ;;\nesac\n"
    path.write_text(body)
    path.chmod(0o755)


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    return tmp_path


def test_current_build(prefix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_binary(prefix / "bin" / "llama-server", "llama-server_0c1e570_help_real.txt", False,
                "llama-server_0c1e570_version_real.txt")
    fake_binary(prefix / "bin" / "ggml-rpc-server", "ggml-rpc-server_0c1e570_help_real.txt", True)
    rc, result = run_module({"prefix": str(prefix), "require": ["llama_server", "rpc_server"],
                             "_ansible_check_mode": True}, capsys)
    assert rc == 0 and result["changed"] is False
    assert (result["llama_server"], result["rpc_server"]) == ("llama-server", "ggml-rpc-server")
    assert result["rpc_server_path"] == str(prefix / "bin" / "ggml-rpc-server")
    assert result["features"]["llama_server"]["fit"] is True
    assert result["features"]["llama_server"]["no_mmap"] is False
    assert result["features"]["rpc_server"] == {"host": True, "port": True, "threads": True, "device": True,
                                                "cache": True, "mem": False}
    assert (result["version"], result["commit"]) == ("0.5.0-dev", None)


def test_old_build(prefix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_binary(prefix / "bin" / "llama-server", "llama-server_no-mmap-era_help_excerpt_reconstructed.txt", False,
                "llama-server_build-number-era_version_reconstructed.txt")
    fake_binary(prefix / "bin" / "rpc-server", "rpc-server_with-mem_help_reconstructed.txt", True)
    rc, result = run_module({"bin_dir": str(prefix / "bin")}, capsys)
    assert rc == 0
    assert result["rpc_server"] == "rpc-server"
    assert result["features"]["llama_server"]["no_mmap"] and not result["features"]["llama_server"]["fit"]
    assert result["features"]["rpc_server"]["mem"] and not result["features"]["rpc_server"]["device"]
    assert (result["version"], result["commit"]) == ("4589", "a1b2c3d4")


def test_missing_required_binary(prefix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_binary(prefix / "bin" / "llama-server", "llama-server_0c1e570_help_real.txt", False,
                "llama-server_0c1e570_version_real.txt")
    rc, result = run_module({"prefix": str(prefix), "require": ["rpc_server"]}, capsys)
    assert rc == 1 and result["msg"] == "%s has no rpc_server (looked for ggml-rpc-server)" % (prefix / "bin")


def test_failing_binary(prefix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = prefix / "bin" / "llama-server"
    script.write_text("#!/bin/sh\necho 'error while loading shared libraries: libggml.so' >&2\nexit 127\n")
    script.chmod(0o755)
    rc, result = run_module({"prefix": str(prefix)}, capsys)
    assert rc == 1 and "--help failed (rc=127)" in result["msg"] and "libggml.so" in result["msg"]


def test_not_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"prefix": str(tmp_path / "none")}, capsys)
    assert rc == 1 and "is not a directory" in result["msg"]
