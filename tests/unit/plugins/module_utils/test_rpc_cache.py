"""rpc-server cache seeding on real files: selection, atomic publication, verification, pruning."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest
from tests.unit.gguf_testfile import Typed, write_gguf

from llamafleet.core import rpc_cache
from llamafleet.core.fnv import fnv1a64, hash_name
from llamafleet.core.gguf import read_gguf
from llamafleet.core.rpc_cache import (
    HASH_THRESHOLD,
    CacheError,
    model_hashes,
    seed_cache,
)
from tests.unit.needs import needs

F32, F16 = 0, 1
THRESHOLD = 1000
SAME = bytes(range(256)) * 9 + bytes(96)  # 2400 bytes shared by two tensors


def _model(path: Path, salt: str = "") -> Path:
    tensors = [
        ("big.a", (600,), F32, SAME),
        ("big.b", (300, 2), F32, SAME),  # byte-identical to big.a: one cache file for both
        ("big.c" + salt, (2000,), F16),
        ("edge", (250,), F32),  # exactly THRESHOLD bytes: not cached (llama.cpp uses size > threshold)
        ("small", (10,), F32),
    ]
    return write_gguf(path, {"general.architecture": "llama"}, tensors)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return _model(tmp_path / "model.gguf")


def _expected(model_path: Path) -> dict[str, bytes]:
    """Cache file name -> content, computed independently of rpc_cache."""
    data = model_path.read_bytes()
    out = {}
    for tensor in read_gguf(model_path).tensors:
        if tensor.nbytes > THRESHOLD:
            blob = data[tensor.offset:tensor.offset + tensor.nbytes]
            out[hash_name(fnv1a64(blob))] = blob
    return out


def _seed(model_path: Path, cache: Path, **kwargs):
    kwargs.setdefault("threshold", THRESHOLD)
    return seed_cache(str(model_path), str(cache), **kwargs)


def test_llama_cpp_threshold() -> None:
    assert HASH_THRESHOLD == 10 * 1024 * 1024


@pytest.mark.parametrize(("threshold", "tensors", "files"), [(1000, 3, 2), (999, 4, 3), (2400, 1, 1), (4000, 0, 0)])
def test_only_tensors_strictly_over_the_threshold(model: Path, threshold: int, tensors: int, files: int) -> None:
    hashed = model_hashes(str(model), threshold)
    assert hashed.tensors_over_threshold == tensors
    assert len(hashed.entries) == files
    assert len(hashed.hashes) == tensors
    if tensors >= 2 and threshold < 2400:
        assert hashed.hashes["big.a"] == hashed.hashes["big.b"] == hash_name(fnv1a64(SAME))


def test_seed_check_apply_apply_check(model: Path, tmp_path: Path, fnv_helper: str) -> None:
    cache = tmp_path / "llama-cache" / "rpc"
    expected = _expected(model)

    check = _seed(model, cache, helper=fnv_helper, check_mode=True)
    assert check.changed and sorted(check.seeded_files) == sorted(expected)
    assert not cache.exists()

    first = _seed(model, cache, helper=fnv_helper)
    assert first.changed
    assert sorted(first.seeded_files) == sorted(expected)
    assert first.seeded_bytes == sum(len(v) for v in expected.values())
    assert first.skipped_files == [] and first.replaced_files == [] and first.pruned_files == []
    assert first.tensors_over_threshold == 3 and set(first.hashes) == {"big.a", "big.b", "big.c"}
    assert first.hasher == fnv_helper and first.warnings == []
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    for name, blob in expected.items():
        assert (cache / name).read_bytes() == blob
        assert stat.S_IMODE((cache / name).stat().st_mode) == 0o600
    assert not [p for p in os.listdir(cache) if p.startswith(rpc_cache.TEMP_PREFIX)]

    again = _seed(model, cache, helper=fnv_helper)
    assert not again.changed
    assert again.seeded_files == [] and sorted(again.skipped_files) == sorted(expected)

    check_again = _seed(model, cache, helper=fnv_helper, check_mode=True)
    assert not check_again.changed


def _corrupt_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _symlink_elsewhere(path: Path) -> None:
    target = path.parent.parent / "elsewhere"
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize("damage", [_corrupt_same_size, _truncate, _symlink_elsewhere])
def test_wrong_cache_files_are_replaced_never_used(model: Path, tmp_path: Path, fnv_helper: str, damage) -> None:
    cache = tmp_path / "cache"
    _seed(model, cache, helper=fnv_helper)
    name = hash_name(fnv1a64(SAME))
    damage(cache / name)

    check = _seed(model, cache, helper=fnv_helper, check_mode=True)
    assert check.changed and check.replaced_files == [name] and check.seeded_files == [name]

    fixed = _seed(model, cache, helper=fnv_helper)
    assert fixed.changed and fixed.replaced_files == [name] and fixed.seeded_files == [name]
    assert len(fixed.skipped_files) == 1
    assert not (cache / name).is_symlink()
    assert (cache / name).read_bytes() == SAME


def test_prune_removes_what_no_model_needs(model: Path, tmp_path: Path, fnv_helper: str) -> None:
    cache = tmp_path / "cache"
    _seed(model, cache, helper=fnv_helper)
    (cache / "0123456789abcdef").write_bytes(b"x" * 100)  # stale cache file
    (cache / "README").write_text("not ours")  # not a cache file name: left alone
    stale_tmp = cache / (rpc_cache.TEMP_PREFIX + "old")
    stale_tmp.write_bytes(b"y" * 10)
    two_hours_ago = time.time() - 7200
    os.utime(stale_tmp, (two_hours_ago, two_hours_ago))
    fresh_tmp = cache / (rpc_cache.TEMP_PREFIX + "running")  # another run may be writing it
    fresh_tmp.write_bytes(b"z")

    kept = _seed(model, cache, helper=fnv_helper, prune=False)
    assert not kept.changed and kept.pruned_files == []

    check = _seed(model, cache, helper=fnv_helper, check_mode=True)
    assert check.changed and check.pruned_files == ["0123456789abcdef", stale_tmp.name]
    assert (cache / "0123456789abcdef").exists()

    pruned = _seed(model, cache, helper=fnv_helper)
    assert pruned.changed
    assert pruned.pruned_files == ["0123456789abcdef", stale_tmp.name]
    assert pruned.pruned_bytes == 110
    left = sorted(list(_expected(model)) + ["README", fresh_tmp.name, rpc_cache.INDEX_NAME])
    assert sorted(os.listdir(cache)) == left
    assert "0123456789abcdef 100" in pruned.diff["before"] and "0123456789abcdef" not in pruned.diff["after"]


def test_keep_models_survive_pruning_and_are_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _model(tmp_path / "first.gguf")
    other = _model(tmp_path / "other.gguf", salt="x")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("LLAMAFLEET_FNV_HELPER", raising=False)
    hashed_paths: list[str] = []
    real = rpc_cache.hash_ranges_python

    def counting(path, ranges):
        hashed_paths.append(os.fspath(path))
        return real(path, ranges)

    monkeypatch.setattr(rpc_cache, "hash_ranges_python", counting)
    other_files = set(_expected(other)) - set(_expected(first))
    assert other_files

    _seed(other, cache, keep_models=[])
    hashed_paths.clear()
    result = _seed(first, cache, keep_models=[str(other)])
    assert result.pruned_files == [] and other_files <= set(os.listdir(cache))
    # other.gguf was indexed when it was seeded: not hashed again
    assert str(other) not in hashed_paths

    os.utime(other, None)  # any change to the file invalidates its index record
    hashed_paths.clear()
    _seed(first, cache, keep_models=[str(other)])
    assert str(other) in hashed_paths

    dropped = _seed(first, cache, keep_models=[])
    assert set(dropped.pruned_files) == other_files


def test_keep_models_must_be_readable(model: Path, tmp_path: Path, fnv_helper: str) -> None:
    cache = tmp_path / "cache"
    _seed(model, cache, helper=fnv_helper)
    with pytest.raises(CacheError, match="keep_models: /nonexistent/kept.gguf"):
        _seed(model, cache, helper=fnv_helper, keep_models=["/nonexistent/kept.gguf"])
    assert len(os.listdir(cache)) == 3  # nothing pruned on error


def test_python_fallback_warns(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("LLAMAFLEET_FNV_HELPER", raising=False)
    result = _seed(model, tmp_path / "cache")
    assert result.hasher == "python"
    assert len(result.warnings) == 1 and "hashing in Python" in result.warnings[0]
    missing = _seed(model, tmp_path / "cache2", helper="/nonexistent/llamafleet-fnv1a64")
    assert "/nonexistent/llamafleet-fnv1a64" in missing.warnings[0]
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(list(_expected(model)) + [rpc_cache.INDEX_NAME])


def test_source_changing_while_seeding_publishes_nothing(
        model: Path, tmp_path: Path, fnv_helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def bad_copy(src_path, offset, length, dst_fd):
        os.write(dst_fd, b"\0" * length)

    monkeypatch.setattr(rpc_cache, "_copy_range", bad_copy)
    cache = tmp_path / "cache"
    with pytest.raises(CacheError, match=r"model.gguf changed while seeding: tensor big\.\w"):
        _seed(model, cache, helper=fnv_helper)
    assert [p for p in os.listdir(cache) if p != rpc_cache.INDEX_NAME] == []


@pytest.mark.parametrize("mode", ["copy_file_range", "sendfile", "pread"])
def test_copy_range_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom(300000))
    if mode != "copy_file_range":
        def refuse(*args, **kwargs):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    if mode == "pread":
        monkeypatch.delattr(os, "sendfile")
    monkeypatch.setattr(rpc_cache, "_COPY_CHUNK", 65536)
    dst = tmp_path / "dst"
    with open(dst, "wb") as handle:
        rpc_cache._copy_range(str(src), 1234, 200000, handle.fileno())
    assert dst.read_bytes() == src.read_bytes()[1234:201234]


def test_copy_range_past_the_end(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    with open(tmp_path / "dst", "wb") as handle, pytest.raises(CacheError, match="src: file ended at byte 3"):
        rpc_cache._copy_range(str(src), 0, 10, handle.fileno())


def test_split_model_shards(tmp_path: Path, fnv_helper: str) -> None:
    shards = []
    for number in range(2):
        meta = {"split.no": Typed("u16", number), "split.count": Typed("u16", 2)}
        if number == 0:
            meta["general.architecture"] = "llama"
        shards.append(write_gguf(tmp_path / ("m-%05d-of-00002.gguf" % (number + 1)), meta,
                                 [("blk.%d.w" % number, (1000,), F32)]))
    cache = tmp_path / "cache"
    result = seed_cache(str(shards[0]), str(cache), threshold=THRESHOLD, helper=fnv_helper)
    expected = {**_expected(shards[0]), **_expected(shards[1])}
    assert len(expected) == 2 and sorted(result.seeded_files) == sorted(expected)
    for name, blob in expected.items():
        assert (cache / name).read_bytes() == blob


def test_cache_dir_that_is_a_file(model: Path, tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(CacheError, match="cache_dir .*file exists and is not a directory"):
        _seed(model, target)


def test_cache_dir_mode_is_enforced(model: Path, tmp_path: Path, fnv_helper: str) -> None:
    cache = tmp_path / "cache"
    _seed(model, cache, helper=fnv_helper)
    cache.chmod(0o755)
    assert _seed(model, cache, helper=fnv_helper, check_mode=True).changed
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755
    assert _seed(model, cache, helper=fnv_helper).changed
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_unknown_owner(model: Path, tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="user 'no-such-user-here' does not exist"):
        _seed(model, tmp_path / "cache", owner="no-such-user-here")
    with pytest.raises(CacheError, match="group 'no-such-group-here' does not exist"):
        _seed(model, tmp_path / "cache", group="no-such-group-here")


@needs(os.geteuid() == 0, "root (changing owners)")
def test_owner_and_group(model: Path, tmp_path: Path, fnv_helper: str) -> None:
    cache = tmp_path / "cache"
    _seed(model, cache, helper=fnv_helper, owner="65534", group="65534")
    for path in [cache] + list(cache.iterdir()):
        assert (path.stat().st_uid, path.stat().st_gid) == (65534, 65534), path
    os.chown(cache / hash_name(fnv1a64(SAME)), 0, 0)
    fixed = _seed(model, cache, helper=fnv_helper, owner="65534", group="65534")
    assert fixed.changed and fixed.seeded_files == []
    assert (cache / hash_name(fnv1a64(SAME))).stat().st_uid == 65534
    assert not _seed(model, cache, helper=fnv_helper, owner="65534", group="65534").changed
