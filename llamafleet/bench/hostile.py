"""Hostile HTTP against a llamafleet endpoint: malformed and hostile requests sent with raw sockets, each with the
class of answer it must get, and a flood of idle, trickling connections from one address while another is served.

``python -m llamafleet.bench.hostile URL --key-file FILE`` prints a table and a summary and exits 1 when a case
went wrong. Every hostile case must get a 4xx from the edge (or, for a connection that sends nothing, be closed):
never a reset, never a 2xx or 5xx, which would mean it went past the edge. A few control cases (the key with
``bearer`` in another case, keyless ``/health``) must be served, so the suite can fail both ways.
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

# What a case must get: REFUSED any 4xx; SERVED a 2xx; CLOSED a 4xx or a close with no answer (never a reset).
REFUSED = "4xx"
SERVED = "2xx"
CLOSED = "4xx/close"


@dataclass(frozen=True)
class Endpoint:
    """Where the suite connects: ``host``/``port``, TLS with ``tls`` (``cafile`` None: the certificate unchecked),
    and the local address to send from (``source``, "" for any)."""

    host: str
    port: int
    tls: bool = False
    cafile: str | None = None
    source: str = ""

    @classmethod
    def from_url(cls, url: str, cafile: str | None = None, source: str = "") -> "Endpoint":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an http:// or https:// URL is needed, not %r" % url)
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, cafile, source)

    def connect(self, timeout: float) -> socket.socket:
        """A connected socket (TLS wrapped when the endpoint speaks it)."""
        sock = socket.create_connection((self.host, self.port), timeout=timeout,
                                        source_address=(self.source, 0) if self.source else None)
        if not self.tls:
            return sock
        context = ssl.create_default_context(cafile=self.cafile)
        if self.cafile is None:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        context.set_alpn_protocols(["http/1.1"])
        return context.wrap_socket(sock, server_hostname=self.host)


@dataclass(frozen=True)
class Case:
    """One request: ``chunks`` sent one after another ``gap`` seconds apart (a slow sender when gap > 0), with the
    class of answer it must get (``expect``); ``backend``: whether it may reach what is behind the edge."""

    name: str
    chunks: tuple[bytes, ...]
    expect: str = REFUSED
    gap: float = 0.0
    backend: bool = False


@dataclass
class Result:
    """What a case got: ``status`` (an HTTP status) or ``outcome`` (reset, closed, timeout, error), and whether
    that is what it must get."""

    case: Case
    status: int | None
    outcome: str
    seconds: float
    ok: bool = field(default=False)


def judge(expect: str, status: int | None, outcome: str) -> bool:
    """Whether a case's answer is of the class it expects."""
    if expect == SERVED:
        return status is not None and 200 <= status < 300
    if status is not None:
        return 400 <= status < 500
    return expect == CLOSED and outcome == "closed"


def status_of(head: bytes) -> int | None:
    """The status of an HTTP/1.x response head, None when it is not one."""
    line = head.split(b"\r\n", 1)[0].split(b" ")
    if len(line) >= 2 and line[0].startswith(b"HTTP/1.") and line[1].isdigit() and len(line[1]) == 3:
        return int(line[1])
    return None


def run_case(endpoint: Endpoint, case: Case, timeout: float = 20.0) -> Result:
    """Send one case on a fresh connection and read the answer's status line."""
    started = time.monotonic()
    received = b""
    outcome = "answered"
    try:
        with endpoint.connect(timeout) as sock:
            sock.settimeout(timeout)
            for index, chunk in enumerate(case.chunks):
                if index and case.gap:
                    time.sleep(case.gap)
                try:
                    sock.sendall(chunk)
                except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    break  # the edge answered and closed early: read what it said
                if case.gap and _readable(sock):
                    break
            while b"\r\n" not in received or _interim(received):
                data = sock.recv(65536)
                if not data:
                    break
                received += data
                while _interim(received) and b"\r\n\r\n" in received:
                    received = received.split(b"\r\n\r\n", 1)[1]  # a 100 Continue: the answer follows
    except ConnectionResetError:
        outcome = "reset"
    except (socket.timeout, TimeoutError):
        outcome = "timeout"
    except (OSError, ssl.SSLError) as exc:
        outcome = "error: %s" % exc
    status = status_of(received)
    if status is None and outcome == "answered":
        outcome = "closed" if not received else "garbage"
    result = Result(case, status, outcome, time.monotonic() - started)
    result.ok = judge(case.expect, status, outcome)
    return result


def _interim(received: bytes) -> bool:
    status = status_of(received)
    return status is not None and 100 <= status < 200


def _readable(sock: socket.socket) -> bool:
    """Whether the peer has sent something (an early answer to a slow sender)."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def _request(method: str, path: str, headers: list[str], body: bytes = b"", version: str = "HTTP/1.1") -> bytes:
    head = "%s %s %s\r\n" % (method, path, version) + "".join(h + "\r\n" for h in headers) + "\r\n"
    return head.encode("latin-1") + body


def cases(host: str, key: str, max_body: int, slow_seconds: float) -> list[Case]:
    """The hostile cases (and a few controls) for an endpoint whose Host is ``host`` and key ``key``; bodies over
    ``max_body`` bytes must be refused; slow senders trickle for ``slow_seconds``, past the edge's head timeout."""
    auth = "Authorization: Bearer " + key
    hst = "Host: " + host
    out: list[Case] = []

    def add(name: str, data: bytes, expect: str = REFUSED, backend: bool = False) -> None:
        out.append(Case(name, (data,), expect, backend=backend))

    # controls: these must be served, or the suite proves nothing
    add("control: GET /v1/models with the key", _request("GET", "/v1/models", [hst, auth, "Connection: close"]),
        SERVED, True)
    add("control: bearer in lower case", _request("GET", "/v1/models", [hst, "Authorization: bearer " + key,
                                                                         "Connection: close"]), SERVED, True)
    add("control: BEARER in upper case", _request("GET", "/v1/models", [hst, "Authorization: BEARER " + key,
                                                                         "Connection: close"]), SERVED, True)
    add("control: keyless /health", _request("GET", "/health", [hst, "Connection: close"]), SERVED, True)
    body = b'{"model":"m","messages":[]}'
    add("control: two spaces in the request line (rewritten by the edge)",
        _request("GET ", "/v1/models", [hst, auth, "Connection: close"]), SERVED, True)
    # a body llama-server itself serves (the lab's e2e test sends the suite to the real one): tokenize a word
    words = b'{"content":"hello"}'
    add("control: POST with Content-Length", _request(
        "POST", "/tokenize", [hst, auth, "Content-Type: application/json", "Content-Length: %d" % len(words),
                              "Connection: close"], words), SERVED, True)

    # the key
    for label, value in [("none", None), ("empty", ""), ("Bearer alone", "Bearer"), ("Bearer and space", "Bearer "),
                         ("wrong key", "Bearer " + "x" * max(len(key), 16)), ("key's prefix", "Bearer " + key[:-1]),
                         ("key and more", "Bearer " + key + "x"), ("key upper-cased", "Bearer " + key.upper()
                                                                   if key.upper() != key else "Bearer " + key.lower()),
                         ("key alone", key), ("Basic", "Basic " + key), ("Token", "Token " + key),
                         ("key, then a comma", "Bearer " + key + ",x"), ("comma, then the key", "Bearer x," + key),
                         ("tab for space", "Bearer\t" + key), ("Bearerkey", "Bearer" + key),
                         ("key with a NUL", "Bearer " + key + "\x00"), ("quoted key", 'Bearer "%s"' % key)]:
        headers = [hst] + ([] if value is None else ["Authorization: " + value])
        add("key: %s" % label, _request("GET", "/v1/models", headers))
    add("key: two Authorization headers", _request("GET", "/v1/models", [hst, auth, "Authorization: Bearer x"]))
    add("key: two headers, the right one last", _request("GET", "/v1/models", [hst, "Authorization: Bearer x", auth]))
    add("key: in the query string", _request("GET", "/v1/models?api_key=" + key, [hst]))
    add("key: in X-Api-Key", _request("GET", "/v1/models", [hst, "X-Api-Key: " + key]))
    for path in ["/llamafleet/metrics", "/metrics", "/v1/chat/completions", "/completion", "/slots", "/props",
                 "/health/../v1/models", "/health?x=/v1/models", "/HEALTH", "/v1/models/"]:
        add("keyless GET %s" % path, _request("GET", path, [hst]))
    add("keyless POST a completion", _request("POST", "/v1/completions", [
        hst, "Content-Type: application/json", "Content-Length: %d" % len(body)], body))
    add("keyless POST 1 MiB", _request("POST", "/v1/completions", [hst, "Content-Length: %d" % (1 << 20)],
                                       b"x" * (1 << 20)))

    # request lines
    for label, line in [("empty line then garbage", b"\r\n\x16\x03\x01garbage\r\n\r\n"),
                        ("no version", b"GET /\r\n\r\n"),
                        ("HTTP/0.9", b"GET /\r\n"), ("HTTP/9.9", b"GET / HTTP/9.9\r\n"),
                        ("HTTP/1.1 with junk after", b"GET / HTTP/1.1 junk\r\n"),
("space in the path", b"GET /a b HTTP/1.1\r\n"),
                        ("NUL in the path", b"GET /\x00 HTTP/1.1\r\n"), ("DEL in the path", b"GET /\x7f HTTP/1.1\r\n"),
                        ("bare LF line ends", b"GET / HTTP/1.1\nHost: x\n\n"),
                        ("lower-case version", b"GET / http/1.1\r\n"), ("a method alone", b"GET\r\n\r\n"),
                        ("a TLS hello on plain HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40),
                        ("binary noise", bytes(range(256)) * 4), ("a lone CR", b"\r\r\r\r"),
                        ("NUL before the method", b"\x00GET / HTTP/1.1\r\n")]:
        tail = b"" if line.endswith(b"\r\n\r\n") or line.endswith(b"\n\n") or b"\r\n" not in line else \
            ("Host: %s\r\n%s\r\n\r\n" % (host, auth)).encode()
        add("request line: %s" % label, line + tail)
    add("request line: 64 KiB path", _request("GET", "/" + "a" * 65536, [hst, auth]))

    # methods
    for method in ["FOO", "TRACE", "PUT", "DELETE", "PATCH", "PROPFIND", "get", "G\x01T", "M" * 2000, "123",
                   "CONNECT"]:
        path = "%s:443" % host if method == "CONNECT" else "/v1/models"
        add("method: %s" % (method[:12] + ("..." if len(method) > 12 else "")),
            _request(method, path, [hst, auth]))

    # paths
    for path in ["/../etc/passwd", "/v1/../../etc/passwd", "/%2e%2e/etc/passwd", "/v1/%2E%2E/admin", "//etc/passwd",
                 "/v1/models/..", "/v1/./models", "/..\\..\\windows", "/%00", "/v1%2fmodels", "*",
                 "http://evil.example/v1/models", "v1/models", "/%5c..%5cetc"]:
        add("path: %s" % path, _request("GET", path, [hst, auth]))

    # Host
    add("Host: missing (HTTP/1.1)", _request("GET", "/v1/models", [auth]))
    # the same Host twice: HAProxy merges the two into one, which is what goes on (no ambiguity left behind it)
    add("control: Host twice, the same (merged by the edge)", _request("GET", "/v1/models", [
        hst, hst, auth, "Connection: close"]), SERVED, True)
    add("Host: two, different", _request("GET", "/v1/models", [hst, "Host: evil.example", auth]))
    add("Host: with a space in the name", _request("GET", "/v1/models", ["Host : " + host, auth]))
    add("Host: bad characters", _request("GET", "/v1/models", ["Host: a b/c", auth]))

    # framing: request smuggling and Content-Length
    smuggled = b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    for label, headers in [
            ("CL and TE", ["Content-Length: %d" % len(smuggled), "Transfer-Encoding: chunked"]),
            ("TE and CL", ["Transfer-Encoding: chunked", "Content-Length: 4"]),
            ("TE chunked alone", ["Transfer-Encoding: chunked"]),
            ("TE xchunked", ["Transfer-Encoding: xchunked"]),
            ("TE chunked, identity", ["Transfer-Encoding: chunked, identity"]),
            ("TE identity", ["Transfer-Encoding: identity"]),
            ("TE empty and chunked", ["Transfer-Encoding:", "Transfer-Encoding: chunked"]),
            ("TE with a tab", ["Transfer-Encoding:\tchunked"]),
            ("TE name with a space", ["Transfer-Encoding : chunked"]),
            ("TE folded", ["Transfer-Encoding: x", " chunked"]),
            ("two CL, different", ["Content-Length: 4", "Content-Length: 5"]),
            ("CL list", ["Content-Length: 4, 5"]), ("CL +4", ["Content-Length: +4"]), ("CL -1", ["Content-Length: -1"]),
            ("CL hex", ["Content-Length: 0x4"]), ("CL 4 5", ["Content-Length: 4 5"]),
            ("CL 4.0", ["Content-Length: 4.0"]),
            ("CL 2**70", ["Content-Length: %d" % 2 ** 70]), ("CL empty", ["Content-Length:"]),
            ("CL superscript two", ["Content-Length: \u00b2"]), ("CL Arabic-Indic four", ["Content-Length: \u0664"]),
            ("CL full-width four", ["Content-Length: \uff14"])]:
        data = ("POST /v1/completions HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (host, auth)
                + "".join(h + "\r\n" for h in headers) + "\r\n").encode("utf-8") + smuggled
        add("framing: %s" % label, data)
    add("body: over the limit", _request("POST", "/v1/completions", [hst, auth, "Content-Length: %d" % (max_body + 1)]))
    add("body: over the limit with Expect", _request("POST", "/v1/completions", [
        hst, auth, "Content-Length: %d" % (max_body + 1), "Expect: 100-continue"]))

    # header shapes and sizes
    for label, header in [("64 KiB value", "X-Big: " + "a" * 65536), ("no colon", "NoColon"),
                          ("space in the name", "Bad Name: x"), ("empty name", ": x"),
                          ("NUL in the value", "X: a\x00b"), ("CR in the value", "X: a\rb"),
                          ("non-ASCII name", "X-\u00e9: x"), ("folded line", " folded")]:
        add("header: %s" % label, _request("GET", "/v1/models", [hst, auth, header]))
    add("header: 500 of them", _request("GET", "/v1/models", [hst, auth] + ["X-%d: y" % i for i in range(500)]))
    add("header: 1 MiB of them", _request("GET", "/v1/models", [hst, auth] + ["X-%d: %s" % (i, "y" * 1000)
                                                                              for i in range(1024)]))

    # slow senders: past the head timeout, the edge must answer 408 (or close) without waiting for them
    step = 0.5
    steps = max(2, int(slow_seconds / step))
    head = _request("GET", "/v1/models", [hst, auth])
    out.append(Case("slow: the head a byte at a time", tuple(head[i:i + 1] for i in range(min(steps, len(head)))),
                    CLOSED, step))
    out.append(Case("slow: an endless header", (b"GET /v1/models HTTP/1.1\r\nHost: " + host.encode() + b"\r\nX: ",)
                    + (b"a",) * steps, CLOSED, step))
    post = _request("POST", "/v1/completions", [hst, auth, "Content-Length: 100000"])
    out.append(Case("slow: the body a byte at a time", (post,) + (b"x",) * steps, CLOSED, step))
    out.append(Case("slow: a connection that sends nothing", (b"",) * steps, CLOSED, step))
    out.append(Case("slow: a body shorter than its Content-Length", (post + b"x" * 10,) + (b"",) * steps, CLOSED, step))
    return out


class Flood:
    """While open: ``connections`` from ``attacker`` that trickle a header byte a second (a slowloris that reconnects
    what the edge drops or refuses); ``held`` says how many are open now, ``counts`` how many were refused at connect
    and dropped after."""

    def __init__(self, attacker: Endpoint, connections: int = 1000, host: str = "localhost") -> None:
        self.attacker = attacker
        self.connections = connections
        self.socks: list[socket.socket] = []
        self.counts = {"refused": 0, "dropped": 0}
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._trickle, daemon=True)
        # on a TLS port the attacker never finishes its handshake: a record header promising 512 bytes, then a byte
        # a second; on plain HTTP a head that never ends
        self._start, self._drip = ((b"\x16\x03\x01\x02\x00", b"\x01") if attacker.tls
                                   else (b"GET /v1/models HTTP/1.1\r\nHost: " + host.encode() + b"\r\nX: ", b"a"))

    @property
    def held(self) -> int:
        return len(self.socks)

    def _fill(self) -> None:
        """Open connections until ``connections`` are held (the attacker reconnects what the edge drops)."""
        for _index in range(self.connections - len(self.socks)):
            if self._stop.is_set():
                return
            try:
                sock = socket.create_connection((self.attacker.host, self.attacker.port), timeout=5.0,
                                                source_address=(self.attacker.source, 0) if self.attacker.source else None)
                sock.sendall(self._start)
                self.socks.append(sock)
            except OSError:
                self.counts["refused"] += 1

    def _trickle(self) -> None:
        while not self._stop.wait(1.0):
            for sock in list(self.socks):
                try:
                    sock.send(self._drip)
                except OSError:
                    self.socks.remove(sock)
                    sock.close()
                    self.counts["dropped"] += 1
            self._fill()

    def __enter__(self) -> "Flood":
        self._fill()
        self._feeder.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._feeder.join()
        for sock in self.socks:
            sock.close()


def probe(client: Endpoint, key: str, probes: int = 10, deadline: float = 1.0, every: float = 1.0,
          host: str = "localhost", before: Callable[[], None] | None = None) -> dict[str, object]:
    """``probes`` keyed requests from ``client``, one every ``every`` seconds, each to be answered (2xx) within
    ``deadline`` seconds; ``before`` runs before each."""
    times: list[float] = []
    statuses: list[object] = []
    request = _request("GET", "/v1/models", ["Host: " + host, "Authorization: Bearer " + key, "Connection: close"])
    for _index in range(probes):
        if before:
            before()
        result = run_case(client, Case("probe", (request,), SERVED), timeout=deadline + 4)
        times.append(result.seconds)
        statuses.append(result.status or result.outcome)
        time.sleep(max(0.0, every - result.seconds))
    served = sum(1 for s, t in zip(statuses, times) if isinstance(s, int) and 200 <= s < 300 and t <= deadline)
    return {"probes": probes, "served_in_time": served, "slowest_s": round(max(times), 3), "statuses": statuses,
            "ok": served == probes}


def flood(attacker: Endpoint, client: Endpoint, key: str, connections: int = 1000, probes: int = 10,
          deadline: float = 1.0, hold: float = 10.0, host: str = "localhost") -> dict[str, object]:
    """Hold a :class:`Flood` of ``connections`` from ``attacker`` and meanwhile :func:`probe` from ``client``."""
    held: list[int] = []
    with Flood(attacker, connections, host) as attack:
        time.sleep(min(hold, 1.0))
        report = probe(client, key, probes, deadline, hold / probes, host, lambda: held.append(attack.held))
    return {"connections": connections, "held_min": min(held), "held_max": max(held), **attack.counts, **report}


def run_suite(endpoint: Endpoint, key: str, host: str = "localhost", max_body: int = 8 << 20,
              slow_seconds: float = 12.0, progress: Callable[[Result], None] | None = None,
              workers: int = 1) -> list[Result]:
    """Every case against ``endpoint``, ``workers`` at a time (one after another by default; a few at once spare the
    slow senders' wait, each on its own connection, within the edge's per-address limits), in the cases' order."""

    def one(case: Case) -> Result:
        result = run_case(endpoint, case, timeout=slow_seconds + 10)
        if progress:
            progress(result)
        return result

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, cases(host, key, max_body, slow_seconds)))


def table(results: list[Result]) -> str:
    """A text table of the results and a summary line."""
    lines = ["%-4s %-48s %-10s %-12s %7s" % ("ok", "case", "expect", "got", "s")]
    for res in results:
        got = str(res.status) if res.status is not None else res.outcome
        lines.append("%-4s %-48s %-10s %-12s %7.2f" % ("ok" if res.ok else "FAIL", res.case.name[:48], res.case.expect,
                                                      got[:12], res.seconds))
    bad = [r for r in results if not r.ok]
    lines.append("%d cases, %d as expected, %d not%s" % (len(results), len(results) - len(bad), len(bad),
                                                         (": " + ", ".join(r.case.name for r in bad)) if bad else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llamafleet.bench.hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the endpoint, e.g. https://10.0.0.5:8080")
    parser.add_argument("--key-file", required=True,
                        help="a file holding the API key (never given on the command line)")
    parser.add_argument("--cafile", help="the CA to check an https endpoint's certificate (else unchecked)")
    parser.add_argument("--max-body", type=int, default=8 << 20, help="the edge's body limit, bytes")
    parser.add_argument("--slow-seconds", type=float, default=12.0,
                        help="how long slow senders trickle (> the head timeout)")
    parser.add_argument("--flood", type=int, default=1000, help="idle connections from --flood-source (0: none)")
    parser.add_argument("--flood-source", default="", help="the local address the flood comes from")
    parser.add_argument("--client-source", default="", help="the local address the probes come from")
    parser.add_argument("--probes-only", type=int, default=0, metavar="N",
                        help="send only N keyed probes, one a second, each to be answered within 1 s, and print "
                             "their report as JSON: another address's side of a flood run elsewhere")
    args = parser.parse_args(argv)
    key = Path(args.key_file).read_text(encoding="utf-8").strip()
    endpoint = Endpoint.from_url(args.url, args.cafile, args.client_source)
    host = urlsplit(args.url).netloc
    if args.probes_only:
        report = probe(endpoint, key, args.probes_only, host=host)
        print(json.dumps(report))
        return 0 if report["ok"] else 1
    results = run_suite(endpoint, key, host, args.max_body, args.slow_seconds)
    print(table(results))
    ok = all(r.ok for r in results)
    if args.flood:
        attacker = Endpoint.from_url(args.url, args.cafile, args.flood_source)
        report = flood(attacker, endpoint, key, args.flood, host=host)
        print("flood: %s" % report)
        ok = ok and bool(report["ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
