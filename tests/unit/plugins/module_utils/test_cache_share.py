"""The worker side of a share on real files: what the cache holds, verified installs, pruning; and a whole file
put together from pieces, resumed after a stop."""

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


def test_whole_file_from_pieces_resumes_and_is_verified(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    sha = hashlib.sha256(data).hexdigest()
    target = tmp_path / "models" / "m.gguf"
    piece = 3000
    layout = cs.pieces_of(len(data), piece)
    assert [p["size"] for p in layout] == [3000, 3000, 3000, 1000]

    def sent(index: int, content: bytes | None = None) -> dict:
        where = layout[index]
        chunk = data[where["offset"]:where["offset"] + where["size"]] if content is None else content
        path = tmp_path / ("piece-%d" % index)
        path.write_bytes(chunk)
        return {"path": str(path), "index": index, "sha256": hashlib.sha256(chunk).hexdigest()}

    state = cs.receive_state(str(target), len(data), sha, piece)
    assert state["missing"] == [0, 1, 2, 3] and state["missing_bytes"] == len(data)
    cs.receive_pieces(str(target), len(data), sha, piece, [sent(0), sent(2)])
    # a stop here: the next run sends only what is missing
    assert cs.receive_state(str(target), len(data), sha, piece)["missing"] == [1, 3]
    with pytest.raises(CacheError, match="piece 1 arrived with sha256"):
        broken = sent(1)
        broken["sha256"] = "0" * 64
        cs.receive_pieces(str(target), len(data), sha, piece, [broken])
    done = cs.receive_pieces(str(target), len(data), sha, piece, [sent(1), sent(3)], final=True)
    assert done["published"] and target.read_bytes() == data
    assert cs.receive_state(str(target), len(data), sha, piece)["verified"]


def test_whole_file_with_the_wrong_digest_is_not_published(tmp_path: Path) -> None:
    data = os.urandom(5000)
    target = tmp_path / "m.gguf"
    path = tmp_path / "p0"
    path.write_bytes(data)
    piece = {"path": str(path), "index": 0, "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(CacheError, match="the pinned one is"):
        cs.receive_pieces(str(target), len(data), "f" * 64, 8192, [piece], final=True)
    assert not target.exists() and not Path(str(target) + ".part").exists()
