"""model_fetch's logic against a real HTTP server with Range support (the lab mirror, on loopback)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from llamafleet.core import fetch
from llamafleet.lab.mirror import MirrorServer

BLOB = os.urandom(3 * 1024 * 1024 + 123)
SHA = hashlib.sha256(BLOB).hexdigest()


@pytest.fixture()
def server(tmp_path: Path):
    root = tmp_path / "www"
    (root / "models").mkdir(parents=True)
    (root / "models" / "m.gguf").write_bytes(BLOB)
    srv = MirrorServer(("127.0.0.1", 0), root)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/models/m.gguf"
    finally:
        srv.shutdown()
        srv.server_close()


def test_spec_validation() -> None:
    with pytest.raises(fetch.FetchError, match="64 hex digits"):
        fetch.FileSpec(url="http://x/m.gguf", sha256="abc")
    assert fetch.FileSpec(url="http://x/a/m.gguf?download=1", sha256="A" * 64).name == "m.gguf"
    with pytest.raises(fetch.FetchError, match="derive a file name"):
        fetch.FileSpec(url="http://x/", sha256="a" * 64)


def test_download_then_verified_in_place(server: str, tmp_path: Path) -> None:
    dest = tmp_path / "models"
    states = fetch.plan([fetch.FileSpec(server, SHA)], str(dest))
    assert [s.action for s in states] == ["download"]
    assert states[0].remote_size == len(BLOB) and states[0].accepts_ranges
    dest.mkdir()
    fetch.download(states[0])
    assert (dest / "m.gguf").read_bytes() == BLOB
    assert not (dest / "m.gguf.part").exists()
    # the second plan trusts the marker and never downloads again
    again = fetch.plan([fetch.FileSpec(server, SHA)], str(dest))
    assert again[0].verified and again[0].action == "none"


def test_resume_from_partial_file(server: str, tmp_path: Path) -> None:
    (tmp_path / "m.gguf.part").write_bytes(BLOB[:1_000_000])
    state = fetch.plan([fetch.FileSpec(server, SHA)], str(tmp_path))[0]
    assert state.action == "resume" and state.partial_bytes == 1_000_000
    assert fetch.bytes_needed([state]) == len(BLOB) - 1_000_000
    fetch.download(state)
    assert (tmp_path / "m.gguf").read_bytes() == BLOB


def test_wrong_sha256_fails_and_keeps_nothing(server: str, tmp_path: Path) -> None:
    state = fetch.plan([fetch.FileSpec(server, "0" * 64)], str(tmp_path))[0]
    with pytest.raises(fetch.FetchError, match="sha256 mismatch"):
        fetch.download(state)
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "m.gguf.part").exists()


def test_corrupt_file_in_place_is_replaced(server: str, tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"not the model")
    state = fetch.plan([fetch.FileSpec(server, SHA)], str(tmp_path))[0]
    assert state.action == "replace" and state.notes
    fetch.download(state)
    assert (tmp_path / "m.gguf").read_bytes() == BLOB


def test_unreachable_and_missing_sources_are_named(server: str, tmp_path: Path) -> None:
    with pytest.raises(fetch.FetchError, match="HTTP 404"):
        fetch.plan([fetch.FileSpec(server.replace("m.gguf", "missing.gguf"), SHA)], str(tmp_path))
    with pytest.raises(fetch.FetchError, match="unreachable"):
        fetch.plan([fetch.FileSpec("http://127.0.0.1:9/m.gguf", SHA)], str(tmp_path), timeout=2)


def test_space_check_names_the_directory(server: str, tmp_path: Path) -> None:
    states = fetch.plan([fetch.FileSpec(server, SHA)], str(tmp_path / "not" / "yet"))
    needed, free = fetch.check_space(states, str(tmp_path / "not" / "yet"), 0)
    assert needed == len(BLOB) and free > needed
    with pytest.raises(fetch.FetchError, match="GiB free"):
        fetch.check_space(states, str(tmp_path), margin_bytes=free)


# --- the GGUF header check before anything is fetched ----------------------------------------------

LLAMA = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
         "tokenizer.ggml.tokens": ["token-%05d" % i for i in range(4000)]}  # a header of about 72 KiB
TENSORS = [("token_embd.weight", (64, 100), 1), ("blk.0.attn_q.weight", (64, 64), 1),
           ("blk.1.attn_q.weight", (64, 64), 1), ("output.weight", (64, 100), 0)]
HTML = b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>login</body></html>\n"


@pytest.fixture()
def sources(tmp_path: Path, serve_dir):
    """Files on two loopback servers: the lab mirror (byte ranges) and http.server (ignores Range)."""
    from gguf_testfile import write_gguf

    root = tmp_path / "www"
    root.mkdir()
    (root / "login.html").write_bytes(HTML)
    (root / "blob.bin").write_bytes(b"\x00\x01\x02\x03" * 8)
    (root / "empty.gguf").write_bytes(b"")
    good = write_gguf(root / "good.gguf", LLAMA, TENSORS)
    (root / "cut.gguf").write_bytes(good.read_bytes()[:good.stat().st_size - 1000])
    (root / "head-cut.gguf").write_bytes(good.read_bytes()[:5000])
    # a llama file that says it is another architecture: no notallama.* keys
    write_gguf(root / "unknown.gguf", dict(LLAMA, **{"general.architecture": "notallama"}), TENSORS)
    # the second shard of a split model carries no hyperparameters
    write_gguf(root / "m-00002-of-00002.gguf", {"split.no": 1, "split.count": 2}, TENSORS[:1])
    return [serve_dir(root), serve_dir(root, ranges=False)], good


@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "no-ranges"])
@pytest.mark.parametrize(("name", "message"), [
    ("good.gguf", None),
    ("m-00002-of-00002.gguf", None),
    ("login.html", "model_files[3].url {url}: not a GGUF file (text/html, starts with '<!DOCTYPE html>')"),
    ("blob.bin", "model_files[3].url {url}: not a GGUF file (application/octet-stream, starts with bytes "
                 "00 01 02 03 00 01 02 03)"),
    ("empty.gguf", "model_files[3].url {url}: not a GGUF file ("),
    ("cut.gguf", "model_files[3] ({url}): the server has {cut} bytes, the GGUF header needs {size} (a truncated "
                 "file?)"),
    ("head-cut.gguf", "model_files[3] ({url}): string of "),
    ("unknown.gguf", "model_files[3] ({url}): required metadata keys notallama.block_count and "
                     "notallama.embedding_length are missing for general.architecture 'notallama'"),
])
def test_check_header(sources, ranges: bool, name: str, message: str | None) -> None:
    bases, good = sources
    url = "%s/%s" % (bases[0 if ranges else 1], name)
    size = good.stat().st_size
    # a first read of 4 KiB makes the check grow its range over the 72 KiB header
    if message is None:
        fetch.check_header(url, "model_files[3]", timeout=5, first_bytes=4096)
        return
    with pytest.raises(fetch.FetchError) as info:
        fetch.check_header(url, "model_files[3]", timeout=5, first_bytes=4096)
    assert str(info.value).startswith(message.format(url=url, cut=size - 1000, size=size)), str(info.value)


def test_check_header_reads_at_most_the_cap(sources) -> None:
    url = sources[0][0] + "/good.gguf"
    with pytest.raises(fetch.FetchError, match=r"the GGUF header is longer than 0 MiB, the most this check reads"):
        fetch.check_header(url, "f[0]", timeout=5, first_bytes=1024, max_bytes=16384)


def test_check_headers_only_for_files_to_fetch(sources, tmp_path: Path) -> None:
    base = sources[0][0]
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "login.html").write_bytes(HTML)  # in place and verified: never read again
    specs = [fetch.FileSpec(base + "/login.html", hashlib.sha256(HTML).hexdigest()),
             fetch.FileSpec(base + "/good.gguf", "0" * 64), fetch.FileSpec(base + "/unknown.gguf", "0" * 64)]
    states = fetch.plan(specs, str(dest))
    assert [s.action for s in states] == ["none", "download", "download"]
    with pytest.raises(fetch.FetchError, match=r"^model_files\[2\] \(.*/unknown.gguf\): required metadata keys"):
        fetch.check_headers(states, "model_files", timeout=5)
    fetch.check_headers(states[:2], "model_files", timeout=5)


@pytest.mark.parametrize(("value", "total"), [
    ("bytes 0-1023/253113024", 253113024), ("bytes */4096", 4096), ("BYTES 5-9/10", 10),
    ("bytes 0-1023/*", None), ("", None), (None, None), ("items 0-1/2", None),
])
def test_content_range_total(value: str | None, total: int | None) -> None:
    assert fetch.content_range_total(value) == total


@pytest.mark.parametrize(("content_type", "head", "expected"), [
    ("text/html; charset=utf-8", b"<!DOCTYPE html>\n<html>", "text/html, starts with '<!DOCTYPE html>'"),
    ("", b'{"error": "Unauthorized"}', "no Content-Type, starts with '{\"error\": \"Unauthorized\"}'"),
    ("application/octet-stream", b"\x89PNG\r\n\x1a\n\x00",
     "application/octet-stream, starts with bytes 89 50 4e 47 0d 0a 1a 0a"),
    ("text/plain", b"", "text/plain, empty"),
])
def test_describe_start(content_type: str, head: bytes, expected: str) -> None:
    assert fetch.describe_start(content_type, head) == expected
