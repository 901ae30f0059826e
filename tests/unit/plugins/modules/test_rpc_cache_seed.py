"""rpc_cache_seed module: the four-run idempotence check, diff output, and failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.unit.gguf_testfile import write_gguf

from ansible_collections.llamafleet.cluster.plugins.modules import rpc_cache_seed
from tests.unit.module_runner import run_four, run_main, warning_messages


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(rpc_cache_seed.main, args, capsys)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    tensors = [("blk.0.w", (3000,), 0), ("blk.1.w", (3000,), 0), ("small", (4,), 0)]
    return write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, tensors)


def test_check_apply_apply_check(model: Path, tmp_path: Path, fnv_helper: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache" / "rpc"
    base = {"model": [str(model)], "cache_dir": str(cache), "threshold": 1000, "hasher": fnv_helper}
    results = run_four(rpc_cache_seed.main, base, capsys)
    first_check, applied, again = results[:3]
    assert sorted(first_check["seeded_files"]) == sorted(applied["seeded_files"])
    assert len(applied["seeded_files"]) == 2 and applied["seeded_bytes"] == 24000
    assert applied["tensors_over_threshold"] == 2
    assert set(applied["hashes"]) == {"blk.0.w", "blk.1.w"}
    assert sorted(again["skipped_files"]) == sorted(applied["seeded_files"])
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(applied["seeded_files"])
    assert first_check["diff"]["before"] == ""
    assert all(name in first_check["diff"]["after"] for name in applied["seeded_files"])
    assert "diff" not in applied


def test_fallback_warning(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = {"model": [str(model)], "cache_dir": str(tmp_path / "c"), "threshold": 1000,
            "hasher": str(tmp_path / "missing-helper")}
    rc, result = run_module(args, capsys)
    assert rc == 0 and result["hasher"] == "python"
    # ansible-core 2.19 reports warnings as {"event": {"msg": ...}}, older releases as plain strings
    messages = warning_messages(result)
    assert any("missing-helper" in m and "hashing in Python" in m for m in messages)


def test_bad_model_fails_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all, just text" * 4)
    rc, result = run_module({"model": [str(bad)], "cache_dir": str(tmp_path / "c")}, capsys)
    assert rc == 1 and result["msg"].startswith("%s: not a GGUF file" % bad)
    assert not (tmp_path / "c").exists()
