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
