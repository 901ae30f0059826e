"""The lab package proxy: allow-list decisions (pure) and real forwarding on loopback."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llamafleet.lab.proxy import ProxyServer, allowed_destinations, client_allowed, decide

DEBIAN = allowed_destinations(["deb.debian.org"])


def test_allowed_destinations() -> None:
    assert DEBIAN == {("deb.debian.org", 80), ("deb.debian.org", 443)}
    assert allowed_destinations(["Mirror.Local.:8080"]) == {("mirror.local", 8080)}


@pytest.mark.parametrize(
    ("method", "target", "allowed", "reason"),
    [
        ("GET", "http://deb.debian.org/debian/dists/bookworm/InRelease", True, "allowed mirror"),
        ("HEAD", "http://DEB.debian.org./debian/", True, "allowed mirror"),
        ("GET", "http://deb.debian.org:80/debian/", True, "allowed mirror"),
        ("CONNECT", "deb.debian.org:443", True, "allowed mirror"),
        ("GET", "http://security.debian.org/", False, "not an allowed mirror"),
        ("GET", "http://deb.debian.org.evil.example/", False, "not an allowed mirror"),
        ("GET", "http://evil.example/?deb.debian.org", False, "not an allowed mirror"),
        ("GET", "http://203.0.113.80/debian/", False, "is an IP address"),
        ("GET", "http://[::1]/", False, "is an IP address"),
        ("GET", "http://10.77.0.12:50052/", False, "is an IP address"),
        ("CONNECT", "192.0.2.1:443", False, "is an IP address"),
        ("GET", "http://deb.debian.org:8080/", False, "port 8080 of deb.debian.org"),
        ("CONNECT", "deb.debian.org:22", False, "port 22 of deb.debian.org"),
        ("CONNECT", "deb.debian.org", False, "is not HOST:PORT"),
        ("GET", "https://deb.debian.org/debian/", False, "not an absolute http:// URL"),
        ("GET", "/debian/dists/bookworm/InRelease", False, "not an absolute http:// URL"),
        ("GET", "http://user:pw@deb.debian.org/", False, "credentials"),
        ("POST", "http://deb.debian.org/debian/", False, "method POST is not forwarded"),
        ("DELETE", "http://deb.debian.org/", False, "method DELETE"),
        ("GET", "http://deb.debian.org:99999/", False, "malformed"),
    ],
)
def test_decide(method: str, target: str, allowed: bool, reason: str) -> None:
    decision = decide(method, target, DEBIAN)
    assert decision.allowed is allowed
    assert reason in decision.reason


def test_decide_with_nothing_allowed() -> None:
    assert not decide("GET", "http://deb.debian.org/", frozenset()).allowed


@pytest.mark.parametrize(
    ("address", "ok"),
    [("10.77.0.11", True), ("10.77.0.1", True), ("127.0.0.1", True), ("::1", True),
     ("10.77.1.5", False), ("192.0.2.2", False), ("not-an-ip", False)],
)
def test_client_allowed(address: str, ok: bool) -> None:
    assert client_allowed(address) is ok


# --------------------------------------------------------------------------- real forwarding


class _Upstream(BaseHTTPRequestHandler):
    """A stand-in Debian mirror: one fixed-length file and one chunked one."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802
        _Upstream.seen.append({k.lower(): v for k, v in self.headers.items()} | {"path": self.path})
        if self.path.startswith("/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"Package: a\n", b"Package: b\n"):
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        body = b"Release file\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET  # noqa: N815 (the proxy must not wait for a HEAD body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def proxy() -> Iterator[tuple[int, int]]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    up_port = upstream.server_address[1]
    server = ProxyServer(("127.0.0.1", 0), [f"localhost:{up_port}"])
    _serve(upstream)
    _serve(server)
    _Upstream.seen.clear()
    try:
        yield server.server_address[1], up_port
    finally:
        for s in (server, upstream):
            s.shutdown()
            s.server_close()


def test_forwards_allowed_requests_with_keep_alive(proxy: tuple[int, int]) -> None:
    port, up = proxy
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", f"http://localhost:{up}/debian/Release?x=1",
                 headers={"Proxy-Authorization": "Basic c2VjcmV0", "User-Agent": "Debian APT-HTTP/1.3"})
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"Release file\n")
    conn.request("GET", f"http://localhost:{up}/chunked/Packages")  # same connection
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"Package: a\nPackage: b\n")
    conn.request("HEAD", f"http://localhost:{up}/debian/Release")
    response = conn.getresponse()
    assert response.status == 200 and response.read() == b""
    assert response.getheader("Content-Length") == "13"
    conn.close()
    first = _Upstream.seen[0]
    assert first["path"] == "/debian/Release?x=1"  # origin-form upstream
    assert first["host"] == f"localhost:{up}"
    assert first["user-agent"] == "Debian APT-HTTP/1.3"
    assert "proxy-authorization" not in first


@pytest.mark.parametrize(
    ("target", "reason"),
    [("http://127.0.0.1:{up}/debian/Release", "is an IP address"),
     ("http://localhost:{other}/", "port"),
     ("http://example.com/", "not an allowed mirror")],
)
def test_refuses_everything_else(proxy: tuple[int, int], target: str, reason: str) -> None:
    port, up = proxy
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", target.format(up=up, other=up + 1))
    response = conn.getresponse()
    assert response.status == 403
    assert reason in response.read().decode()
    conn.close()
    assert _Upstream.seen == []


def test_connect_tunnel(proxy: tuple[int, int]) -> None:
    port, up = proxy
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"CONNECT localhost:{up} HTTP/1.1\r\nHost: localhost:{up}\r\n\r\n".encode())
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /through-tunnel HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"Release file\n")
    assert _Upstream.seen[0]["path"] == "/through-tunnel"


def test_http10_client_gets_a_close_delimited_body(proxy: tuple[int, int]) -> None:
    port, up = proxy
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET http://localhost:{up}/chunked/Packages HTTP/1.0\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" not in head.lower()
    assert body == b"Package: a\nPackage: b\n"


def test_requests_with_a_body_are_refused(proxy: tuple[int, int]) -> None:
    port, up = proxy
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", f"http://localhost:{up}/debian/Release", body=b"smuggled")
    response = conn.getresponse()
    assert response.status == 400 and response.getheader("Connection") == "close"
    conn.close()
    assert _Upstream.seen == []
