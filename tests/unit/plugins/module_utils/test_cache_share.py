"""The worker side of a share on real files: what the cache holds, verified installs, pruning (a whole file
streamed into place: test_receive_stream.py)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from llamafleet.core import cache_share as cs
from llamafleet.core.fnv import fnv1a64, hash_name
from llamafleet.core.rpc_cache import CacheError


def _entry(data: bytes, tensor: str) -> dict:
    return {"name": hash_name(fnv1a64(data)), "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "tensors": [tensor]}


BLOBS = {name: os.urandom(3000 + i) for i, name in enumerate(["blk.0.a", "blk.0.b", "blk.1.a"])}


@pytest.fixture
def entries() -> list[dict]:
    return [_entry(data, name) for name, data in BLOBS.items()]


def _send(cache: Path, entry: dict, data: bytes, folder: Path | None = None) -> dict:
    folder = folder or cache / cs.INCOMING
    path = folder / entry["name"]
    path.write_bytes(data)
    return {**entry, "path": str(path)}


def test_inspect_install_and_again(tmp_path: Path, entries: list[dict]) -> None:
    cache = tmp_path / "rpc"
    seen = cs.inspect_share(str(cache), entries, check_mode=True)
    assert seen["missing"] == [e["name"] for e in entries] and not cache.exists()
    seen = cs.inspect_share(str(cache), entries)
    assert seen["changed"] and seen["missing_bytes"] == sum(len(d) for d in BLOBS.values())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and stat.S_IMODE((cache / cs.INCOMING).stat().st_mode) == 0o700
    sent = [_send(cache, e, BLOBS[e["tensors"][0]]) for e in entries[:2]]
    done = cs.install_files(str(cache), sent)
    assert done["installed"] == [e["name"] for e in entries[:2]]
    for entry in entries[:2]:
        target = cache / entry["name"]
        assert target.read_bytes() == BLOBS[entry["tensors"][0]]
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert list((cache / cs.INCOMING).iterdir()) == []
    again = cs.inspect_share(str(cache), entries)
    assert again["present"] == [e["name"] for e in entries[:2]] and again["missing"] == [entries[2]["name"]]
    assert not again["changed"]


def test_received_bytes_that_differ_are_refused_naming_the_tensor(tmp_path: Path, entries: list[dict],
                                                                  fnv_helper: str) -> None:
    cache = tmp_path / "rpc"
    cs.inspect_share(str(cache), entries)
    bad = _send(cache, entries[0], b"x" * entries[0]["size"])
    with pytest.raises(CacheError, match="blk.0.a.*sha256"):
        cs.install_files(str(cache), [bad])
    assert not (cache / entries[0]["name"]).exists() and not Path(bad["path"]).exists()
    short = _send(cache, entries[1], b"x")
    with pytest.raises(CacheError, match="blk.0.b.*received 1 bytes"):
        cs.install_files(str(cache), [short])
    # the manifest's digest matches but the name is not these bytes' FNV: the worker's helper sees it
    data = BLOBS["blk.1.a"]
    wrong = {**entries[2], "name": "0123456789abcdef"}
    with pytest.raises(CacheError, match="hash to cache name %s" % entries[2]["name"]):
        cs.install_files(str(cache), [_send(cache, wrong, data)], hasher=fnv_helper)
    assert sorted(p.name for p in cache.iterdir() if cs.CACHE_NAME.match(p.name)) == []


def test_files_sent_to_another_folder_are_copied_in(tmp_path: Path, entries: list[dict]) -> None:
    cache = tmp_path / "rpc"
    elsewhere = tmp_path / "ansible-tmp"
    elsewhere.mkdir()
    cs.inspect_share(str(cache), entries)
    sent = _send(cache, entries[0], BLOBS["blk.0.a"], elsewhere)
    cs.install_files(str(cache), [sent])
    assert (cache / entries[0]["name"]).read_bytes() == BLOBS["blk.0.a"] and not Path(sent["path"]).exists()


def test_a_changed_cache_file_is_verified_again(tmp_path: Path, entries: list[dict]) -> None:
    cache = tmp_path / "rpc"
    cs.inspect_share(str(cache), entries)
    cs.install_files(str(cache), [_send(cache, e, BLOBS[e["tensors"][0]]) for e in entries])
    target = cache / entries[0]["name"]
    data = bytearray(target.read_bytes())
    data[10] ^= 1
    target.write_bytes(bytes(data))  # same size, new mtime and ctime
    seen = cs.inspect_share(str(cache), entries)
    assert seen["missing"] == [entries[0]["name"]]


def test_settled_only_where_an_inspect_that_writes_would_change_nothing(tmp_path: Path, entries: list[dict]) -> None:
    """The room check (check mode) says which workers the send step may skip: only those whose whole share is there
    and was verified before (a file hashed now is remembered only by an inspect that writes)."""
    cache = tmp_path / "rpc"
    assert not cs.inspect_share(str(cache), entries, check_mode=True)["settled"]  # no cache yet
    cs.inspect_share(str(cache), entries)
    cs.install_files(str(cache), [_send(cache, e, BLOBS[e["tensors"][0]]) for e in entries[:2]])
    assert not cs.inspect_share(str(cache), entries, check_mode=True)["settled"]  # one missing
    # the third put there by other means (as rpc-server writes its own cache): present, but never verified
    (cache / entries[2]["name"]).write_bytes(BLOBS["blk.1.a"])
    seen = cs.inspect_share(str(cache), entries, check_mode=True)
    assert seen["missing"] == [] and not seen["settled"]
    assert not cs.inspect_share(str(cache), entries, check_mode=True)["settled"]  # check mode remembered nothing
    assert not cs.inspect_share(str(cache), entries)["settled"]  # this one remembers it
    assert cs.inspect_share(str(cache), entries, check_mode=True)["settled"]
    target = cache / entries[0]["name"]
    data = bytearray(target.read_bytes())
    data[10] ^= 1
    target.write_bytes(bytes(data))
    assert not cs.inspect_share(str(cache), entries, check_mode=True)["settled"]


def test_prune_keeps_only_the_shares(tmp_path: Path, entries: list[dict]) -> None:
    cache = tmp_path / "rpc"
    cs.inspect_share(str(cache), entries)
    cs.install_files(str(cache), [_send(cache, e, BLOBS[e["tensors"][0]]) for e in entries])
    (cache / cs.INCOMING / "half-sent").write_bytes(b"abc")
    (cache / "not-a-cache-file").write_bytes(b"kept")
    keep = [entries[0]["name"]]
    preview = cs.prune_share(str(cache), keep, check_mode=True)
    assert preview["changed"] and (cache / entries[1]["name"]).exists()
    done = cs.prune_share(str(cache), keep)
    assert sorted(done["pruned_files"]) == sorted([e["name"] for e in entries[1:]] + [cs.INCOMING + "/half-sent"])
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [entries[0]["name"], cs.INCOMING, cs.VERIFIED_NAME, "not-a-cache-file"])
    assert not cs.prune_share(str(cache), keep)["changed"]
