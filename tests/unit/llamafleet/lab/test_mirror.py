"""The lab mirror: Range parsing (pure) and a real server on loopback."""

from __future__ import annotations

import http.client
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamafleet.lab.mirror import (
    ByteRange,
    MirrorServer,
    RangeNotSatisfiable,
    if_range_allows,
    mirror_url,
    parse_range,
    publish,
    safe_relative_path,
)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("bytes=0-9", ByteRange(0, 9, 100)),
        ("bytes=90-", ByteRange(90, 99, 100)),
        ("bytes=-10", ByteRange(90, 99, 100)),
        ("bytes=-500", ByteRange(0, 99, 100)),  # suffix longer than the file: all of it
        ("bytes=50-5000", ByteRange(50, 99, 100)),  # last position clamped to the end
        ("Bytes = 3-4", ByteRange(3, 4, 100)),
        ("bytes=99-99", ByteRange(99, 99, 100)),
        ("bytes=0-1,5-6", None),  # several ranges: answered with the whole file
        ("items=0-9", None),  # unknown unit: ignored
        ("bytes=9-0", None),  # invalid: ignored
        ("bytes=-", None),
        ("bytes=a-b", None),
    ],
)
def test_parse_range(header: str | None, expected: ByteRange | None) -> None:
    assert parse_range(header, 100) == expected


@pytest.mark.parametrize(("header", "size"), [("bytes=100-", 100), ("bytes=200-300", 100), ("bytes=-0", 100), ("bytes=-5", 0)])
def test_parse_range_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)


def test_content_range() -> None:
    assert ByteRange(10, 19, 253113024).content_range == "bytes 10-19/253113024"
    assert ByteRange(10, 19, 100).length == 10


def test_if_range() -> None:
    etag, date = '"10-abc"', "Mon, 23 Nov 2026 11:23:13 GMT"
    assert if_range_allows(None, etag, date)
    assert if_range_allows(etag, etag, date)
    assert if_range_allows(date, etag, date)
    assert not if_range_allows('"other"', etag, date)
    assert not if_range_allows('W/"10-abc"', etag, date)  # weak tags never match
    assert not if_range_allows("Tue, 24 Nov 2026 00:00:00 GMT", etag, date)


@pytest.mark.parametrize(
    ("url", "rel"),
    [("/models/a.gguf", "models/a.gguf"), ("/src//x.tar.gz?v=1", "src/x.tar.gz"), ("/", ""),
     ("/a/%2e%2e/b", None), ("/../etc/passwd", None), ("/a/%2E%2E%2Fb", None), ("/./models/./a", "models/a")],
)
def test_safe_relative_path(url: str, rel: str | None) -> None:
    assert safe_relative_path(url) == rel


def test_mirror_url_quotes() -> None:
    assert mirror_url("models", "my model.gguf") == "http://10.77.0.1:8089/models/my%20model.gguf"


def test_publish_links_without_copying(tmp_path: Path) -> None:
    source = tmp_path / "cache" / "synthetic.gguf"
    source.parent.mkdir()
    source.write_bytes(b"weights")
    mirror_dir = tmp_path / "mirror"
    url = publish(source, "models", mirror_dir=mirror_dir)
    assert url == "http://10.77.0.1:8089/models/synthetic.gguf"
    published = mirror_dir / "models" / "synthetic.gguf"
    assert os.path.samefile(published, source)
    assert publish(source, "models", mirror_dir=mirror_dir) == url  # again: a no-op
    other = tmp_path / "cache" / "v2.gguf"
    other.write_bytes(b"new weights")
    publish(other, "models", name="synthetic.gguf", mirror_dir=mirror_dir)  # replaces
    assert published.read_bytes() == b"new weights"
    with pytest.raises(ValueError):
        publish(source, "../outside", mirror_dir=mirror_dir)
    with pytest.raises(FileNotFoundError):
        publish(tmp_path / "nope", "models", mirror_dir=mirror_dir)


# --------------------------------------------------------------------------- a real server


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    content = bytes(range(256)) * 1000  # 256000 bytes
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(content)
    server = MirrorServer(("127.0.0.1", 0), tmp_path)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], content
    finally:
        server.shutdown()
        server.server_close()


def _get(conn: http.client.HTTPConnection, method: str, path: str, **headers: str) -> tuple[http.client.HTTPResponse, bytes]:
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    return response, response.read()


def test_server_full_range_head_and_errors(served: tuple[int, bytes]) -> None:
    port, content = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)  # one keep-alive connection throughout
    response, body = _get(conn, "GET", "/models/m.gguf")
    assert response.status == 200 and body == content
    assert response.getheader("Accept-Ranges") == "bytes"
    etag = response.getheader("ETag")

    response, body = _get(conn, "GET", "/models/m.gguf", Range="bytes=1000-1999")
    assert response.status == 206 and body == content[1000:2000]
    assert response.getheader("Content-Range") == f"bytes 1000-1999/{len(content)}"

    response, body = _get(conn, "GET", "/models/m.gguf", Range="bytes=-16")
    assert response.status == 206 and body == content[-16:]

    response, body = _get(conn, "GET", "/models/m.gguf", Range="bytes=255990-", **{"If-Range": etag})
    assert response.status == 206 and body == content[255990:]

    response, body = _get(conn, "GET", "/models/m.gguf", Range="bytes=0-9", **{"If-Range": '"stale"'})
    assert response.status == 200 and len(body) == len(content)  # changed file: whole new version

    response, body = _get(conn, "GET", "/models/m.gguf", Range=f"bytes={len(content)}-")
    assert response.status == 416 and response.getheader("Content-Range") == f"bytes */{len(content)}"

    response, body = _get(conn, "HEAD", "/models/m.gguf")
    assert response.status == 200 and body == b"" and response.getheader("Content-Length") == str(len(content))

    response, body = _get(conn, "GET", "/models/")
    assert response.status == 200 and body == b"m.gguf\n"

    response, _ = _get(conn, "GET", "/models/missing.gguf")
    assert response.status == 404
    response, _ = _get(conn, "GET", "/../../etc/passwd")
    assert response.status == 400
    assert response.getheader("Server", "").startswith("llamafleet-lab-mirror")
    conn.close()
