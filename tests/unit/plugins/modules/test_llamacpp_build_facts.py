"""llamacpp_build_facts module on a build root under a temporary directory: a build not installed yet, the
versions and the current link, a Vulkan header, dpkg's answer where this machine has dpkg, a broken record."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import llamacpp_build_facts
from tests.unit.module_runner import run_main


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(llamacpp_build_facts.main, {"backend": "cpu", "_ansible_check_mode": True, **args}, capsys)


def test_a_build_not_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "older").mkdir()
    (tmp_path / ".hidden").mkdir()
    os.utime(tmp_path / "older", (1000, 1000))
    (tmp_path / "current").symlink_to("old")
    (tmp_path / "vulkan_core.h").write_text("#define VK_HEADER_VERSION 275\n")
    rc, result = run_module({"root": str(tmp_path), "build_id": "new-cpu-0123456789", "groups": ["llamafleet_workers"],
                             "vulkan_header": str(tmp_path / "vulkan_core.h")}, capsys)
    assert rc == 0 and result["changed"] is False
    assert (result["current"], result["current_target"]) == ("old", "old")
    assert result["installed"] is False and result["record"] is None and result["info"] is None
    assert [v["path"] for v in result["versions"]] == [str(tmp_path / "old"), str(tmp_path / "older")]
    assert result["backend"]["problem"] is None and "vulkan_loader" in result["backend"]["facts"]
    assert result["vulkan_header_version"] == 275
    assert (result["packages"], result["packages_missing"]) == ({}, [])
    assert (result["root"], result["build_id"]) == (str(tmp_path), "new-cpu-0123456789")


def test_no_root_yet_and_no_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"root": str(tmp_path / "none"), "build_id": "x", "backend": "metal"}, capsys)
    assert rc == 0 and result["versions"] == [] and result["current"] is None and result["current_target"] is None
    assert "macOS" in result["backend"]["problem"] and result["vulkan_header_version"] is None


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="this machine has no dpkg")
def test_dpkg_status_of_the_packages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"root": str(tmp_path), "build_id": "x",
                             "packages": ["dpkg", "llamafleet-no-such-package"]}, capsys)
    assert rc == 0 and result["packages"] == {"dpkg": "installed", "llamafleet-no-such-package": None}
    assert result["packages_missing"] == ["llamafleet-no-such-package"]


def test_a_broken_record_fails_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b1").mkdir()
    (tmp_path / "b1" / "BUILDINFO.json").write_text("{not json")
    rc, result = run_module({"root": str(tmp_path), "build_id": "b1"}, capsys)
    assert rc == 1 and result["failed"] is True
    assert result["msg"].startswith("%s/b1/BUILDINFO.json is not a build record" % tmp_path)


def test_an_installed_build_without_its_bin_directory_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b1").mkdir()
    (tmp_path / "b1" / "BUILDINFO.json").write_text('{"version": "b1"}')
    rc, result = run_module({"root": str(tmp_path), "build_id": "b1"}, capsys)
    assert rc == 1 and "bin_dir %s/b1/bin is not a directory" % tmp_path in result["msg"]
