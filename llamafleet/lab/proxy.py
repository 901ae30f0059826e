"""The lab's package proxy: an HTTP forward proxy that reaches only the Debian mirrors.

Lab hosts have no route out of the lab network.  Their apt talks to this proxy on
the controller (``Acquire::http::Proxy``); the proxy resolves the mirror's name with
the controller's own resolver and forwards the request.  Every other destination
(another host name, an IP address, another port, a method apt does not use) is
refused with ``403``, so the lab can reach its package mirror and nothing else.
Clients outside the lab network are not served at all.

Run as a daemon: ``python -m llamafleet.lab.proxy --listen 10.77.0.1:3142 --allow deb.debian.org``.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import logging
import selectors
import socket
from collections.abc import Collection
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from .daemon import SERVER_PREFIX, configure_logging, serve
from .mirror import parse_listen
from .net import GATEWAY, SUBNET

PROXY_PORT = 3142
PROXY_URL = f"http://{GATEWAY}:{PROXY_PORT}"

# Methods apt (and curl, for a human checking by hand) need from a package mirror.
FORWARDED_METHODS = frozenset({"GET", "HEAD"})
HTTP_PORT, TLS_PORT = 80, 443
# Hop-by-hop headers (RFC 9110 section 7.6.1) and proxy credentials never travel on.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade",
})
CHUNK = 64 * 1024

log = logging.getLogger("lab-proxy")


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Decision:
    """Whether to forward a request, where to, and why (logged, and sent back when refused)."""

    allowed: bool
    host: str
    port: int
    reason: str


def _deny(reason: str, host: str = "", port: int = 0) -> Decision:
    return Decision(False, host, port, reason)


def normalise_host(host: str) -> str:
    """Lower-case, without a trailing dot (``Deb.Debian.org.`` is ``deb.debian.org``)."""
    return host.strip().lower().rstrip(".")


def allowed_destinations(entries: Collection[str]) -> frozenset[tuple[str, int]]:
    """(host, port) pairs from allow-list entries.

    ``HOST`` allows the mirror's standard ports (80 for http, 443 for a CONNECT
    tunnel); ``HOST:PORT`` allows exactly that port (a mirror on a custom port).
    """
    pairs: set[tuple[str, int]] = set()
    for entry in entries:
        host, sep, port = entry.rpartition(":")
        if sep and port.isdigit():
            pairs.add((normalise_host(host), int(port)))
        else:
            pairs.update({(normalise_host(entry), HTTP_PORT), (normalise_host(entry), TLS_PORT)})
    return frozenset(pairs)


def decide(method: str, target: str, allowed: Collection[tuple[str, int]]) -> Decision:
    """Decide a proxy request from its method and request target alone.

    Allowed: ``GET``/``HEAD`` of ``http://HOST[:PORT]/...`` and ``CONNECT HOST:PORT``
    where (HOST, PORT) is in ``allowed`` (see :func:`allowed_destinations`).  Host
    names compare exactly after normalising; IP literals are never allowed, since
    the allow-list names mirrors, not addresses.
    """
    method = method.upper()
    if method == "CONNECT":
        host, sep, port_s = target.rpartition(":")
        if not sep or not port_s.isdigit():
            return _deny(f"CONNECT target {target!r} is not HOST:PORT")
        host = normalise_host(host.strip("[]"))
        port = int(port_s)
    elif method in FORWARDED_METHODS:
        try:
            url = urlsplit(target)
            port = url.port or HTTP_PORT
        except ValueError:
            return _deny(f"malformed request target {target!r}")
        if url.scheme.lower() != "http" or not url.hostname:
            return _deny(f"{target!r} is not an absolute http:// URL (only proxy requests are served)")
        if url.username is not None or url.password is not None:
            return _deny("credentials in the URL are not forwarded")
        host = normalise_host(url.hostname)
    else:
        return _deny(f"method {method} is not forwarded (only GET, HEAD and CONNECT)")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return _deny(f"{host} is an IP address; only the Debian mirrors' names are allowed", host, port)
    if (host, port) not in allowed:
        names = sorted({h for h, _ in allowed})
        if host in names:
            return _deny(f"port {port} of {host} is not allowed", host, port)
        return _deny(f"{host} is not an allowed mirror (allowed: {', '.join(names) or 'none'})", host, port)
    return Decision(True, host, port, "allowed mirror")


def client_allowed(address: str) -> bool:
    """Only lab hosts and the controller itself may use the proxy."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip in SUBNET or ip.is_loopback


# --------------------------------------------------------------------------- server


class ProxyHandler(BaseHTTPRequestHandler):
    """Forwards allowed requests with HTTP/1.1 keep-alive towards the client."""

    protocol_version = "HTTP/1.1"
    server_version = SERVER_PREFIX + "proxy"
    server: ProxyServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._forward()

    def do_HEAD(self) -> None:  # noqa: N802
        self._forward()

    def do_CONNECT(self) -> None:  # noqa: N802
        decision = self._check()
        if decision is None:
            return
        try:
            upstream = socket.create_connection((decision.host, decision.port), timeout=30)
        except OSError as exc:
            self._refuse(HTTPStatus.BAD_GATEWAY, f"cannot reach {decision.host}:{decision.port}: {exc}")
            return
        self.send_response(HTTPStatus.OK, "Connection established")
        self.end_headers()
        self.close_connection = True
        with upstream:
            self._relay(self.connection, upstream)

    # Anything else a client might send is refused the same way.
    def do_POST(self) -> None:  # noqa: N802
        self._check()

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_POST  # noqa: N815

    def _check(self) -> Decision | None:
        decision = decide(self.command, self.path, self.server.allowed)
        if not decision.allowed:
            self._refuse(HTTPStatus.FORBIDDEN, decision.reason)
            return None
        return decision

    def _refuse(self, status: HTTPStatus, reason: str) -> None:
        log.warning("DENY %s %s %s: %s", self.client_address[0], self.command, self.path, reason)
        body = f"llamafleet lab proxy: {reason}\n".encode()
        # A refused request's body (if any) was not read: the connection cannot carry another request.
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self) -> None:
        decision = self._check()
        if decision is None:
            return
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") != "0":
            self._refuse(HTTPStatus.BAD_REQUEST, f"{self.command} requests with a body are not forwarded")
            return
        url = urlsplit(self.path)
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        upstream = http.client.HTTPConnection(decision.host, decision.port, timeout=60)
        try:
            upstream.putrequest(self.command, path, skip_host=True, skip_accept_encoding=True)
            upstream.putheader("Host", url.netloc)
            for key, value in self.headers.items():
                if key.lower() not in HOP_BY_HOP and key.lower() != "host":
                    upstream.putheader(key, value)
            upstream.endheaders()
            response = upstream.getresponse()
        except OSError as exc:  # name resolution, refused connection, timeout
            upstream.close()
            self._refuse(HTTPStatus.BAD_GATEWAY, f"cannot reach {decision.host}: {exc}")
            return
        try:
            self._relay_response(response)
        finally:
            upstream.close()

    def _relay_response(self, response: http.client.HTTPResponse) -> None:
        has_body = self.command != "HEAD" and response.status not in (204, 304) and response.status >= 200
        self.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in HOP_BY_HOP and not (has_body and key.lower() == "content-length"):
                self.send_header(key, value)
        length = response.length if has_body else None
        # A body of unknown length goes chunked to HTTP/1.1 clients, and ends with the connection otherwise.
        chunked = has_body and length is None and self.request_version == "HTTP/1.1"
        if has_body and length is not None:
            self.send_header("Content-Length", str(length))
        elif chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif has_body:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        log.info("%s %s %s -> %d", self.client_address[0], self.command, self.path, response.status)
        if not has_body:
            return
        try:
            while block := response.read(CHUNK):
                if chunked:
                    block = f"{len(block):x}\r\n".encode() + block + b"\r\n"
                self.wfile.write(block)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as exc:
            log.warning("transfer of %s broke off: %s", self.path, exc)
            self.close_connection = True

    @staticmethod
    def _relay(a: socket.socket, b: socket.socket) -> None:
        """Copy bytes both ways between two sockets until either side closes."""
        with selectors.DefaultSelector() as sel:
            sel.register(a, selectors.EVENT_READ, b)
            sel.register(b, selectors.EVENT_READ, a)
            while events := sel.select(timeout=300):  # a tunnel idle for five minutes is closed
                for key, _ in events:
                    try:
                        data = key.fileobj.recv(CHUNK)  # type: ignore[union-attr]
                        if not data:
                            return
                        key.data.sendall(data)
                    except OSError:
                        return

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (signature of the base class)
        log.debug("%s %s", self.address_string(), format % args)


class ProxyServer(ThreadingHTTPServer):
    """A threaded proxy server that knows which mirror names it may reach."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], allow: Collection[str]) -> None:
        self.allowed = allowed_destinations(allow)
        super().__init__(address, ProxyHandler)

    def verify_request(self, request: object, client_address: tuple[str, int]) -> bool:
        if client_allowed(client_address[0]):
            return True
        log.warning("DENY client %s: not on the lab network", client_address[0])
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llamafleet.lab.proxy", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=parse_listen, default=(GATEWAY, PROXY_PORT), metavar="HOST:PORT")
    parser.add_argument("--allow", action="append", required=True, metavar="HOST[:PORT]",
                        help="a mirror requests may go to: a host name (ports 80 and 443) or HOST:PORT (repeatable)")
    parser.add_argument("--pidfile", type=Path, help="written once listening, removed on exit")
    args = parser.parse_args(argv)
    configure_logging()
    server = ProxyServer(args.listen, args.allow)
    log.info("forwarding only to: %s", ", ".join(f"{h}:{p}" for h, p in sorted(server.allowed)))
    serve(server, args.pidfile, "lab-proxy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
