"""model_fetch module: the GGUF header check names the role's variable, in check mode and before a download."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from gguf_testfile import write_gguf

from ansible_collections.llamafleet.cluster.plugins.modules import model_fetch
from module_runner import run_main

HTML = b"<!DOCTYPE html>\n<html><body>404: not here, but 200 all the same</body></html>\n"


@pytest.fixture()
def mirror(tmp_path: Path, serve_dir):
    """An HTML page and a small GGUF on the lab mirror's server: (base URL, the served directory)."""
    (tmp_path / "page.html").write_bytes(HTML)
    write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama", "llama.block_count": 1,
                                     "llama.embedding_length": 64}, [("blk.0.w", (64, 4), 0)])
    return serve_dir(tmp_path), tmp_path


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(model_fetch.main, args, capsys)


@pytest.mark.parametrize("check_mode", [True, False])
def test_a_page_that_is_not_gguf_fails_before_anything_is_written(
        mirror, tmp_path: Path, check_mode: bool, capsys: pytest.CaptureFixture[str]) -> None:
    base, root = mirror
    dest = tmp_path / "dest"
    files = [{"url": base + "/m.gguf", "sha256": hashlib.sha256((root / "m.gguf").read_bytes()).hexdigest()},
             {"url": base + "/page.html", "sha256": hashlib.sha256(HTML).hexdigest()}]
    rc, result = run_module({"files": files, "dest": str(dest), "label": "model_files", "free_margin_mib": 0,
                             "_ansible_check_mode": check_mode}, capsys)
    assert rc == 1
    assert result["msg"] == ("model_files[1].url %s/page.html: not a GGUF file (text/html, starts with "
                             "'<!DOCTYPE html>')" % base)
    assert not dest.exists()


def test_good_files_pass_the_check_without_a_msg(mirror, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The model role's preflight treats a msg as the failure (it registers with failed_when: false)."""
    base, root = mirror
    files = [{"url": base + "/m.gguf", "sha256": hashlib.sha256((root / "m.gguf").read_bytes()).hexdigest()}]
    args = {"files": files, "dest": str(tmp_path / "dest"), "label": "model_files", "free_margin_mib": 0}
    rc, result = run_module(dict(args, _ansible_check_mode=True), capsys)
    assert rc == 0 and "msg" not in result and result["fetched"] == ["m.gguf"], result
    rc, result = run_module(args, capsys)
    assert rc == 0 and result["changed"] is True
    assert (tmp_path / "dest" / "m.gguf").read_bytes() == (root / "m.gguf").read_bytes()
