"""model_fetch's logic against a real HTTP server with Range support (the lab mirror, on loopback)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from llamafleet.core import fetch
from llamafleet.core.fetch_policy import Names
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
        fetch.plan([fetch.FileSpec("http://127.0.0.1:9/m.gguf", SHA)], str(tmp_path), fetch.Http(timeout=2, retries=0))


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
    from tests.unit.gguf_testfile import write_gguf

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
        fetch.check_header(url, "model_files[3]", fetch.Http(timeout=5), first_bytes=4096)
        return
    with pytest.raises(fetch.FetchError) as info:
        fetch.check_header(url, "model_files[3]", fetch.Http(timeout=5), first_bytes=4096)
    assert str(info.value).startswith(message.format(url=url, cut=size - 1000, size=size)), str(info.value)


def test_check_header_reads_at_most_the_cap(sources) -> None:
    url = sources[0][0] + "/good.gguf"
    with pytest.raises(fetch.FetchError, match=r"the GGUF header is longer than 0 MiB, the most this check reads"):
        fetch.check_header(url, "f[0]", fetch.Http(timeout=5), first_bytes=1024, max_bytes=16384)


def test_check_headers_only_for_files_to_fetch(sources, tmp_path: Path) -> None:
    base = sources[0][0]
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "login.html").write_bytes(HTML)  # in place and verified: never read again
    specs = [fetch.FileSpec(base + "/login.html", hashlib.sha256(HTML).hexdigest()),
             fetch.FileSpec(base + "/good.gguf", "0" * 64), fetch.FileSpec(base + "/unknown.gguf", "0" * 64)]
    http = fetch.Http(timeout=5, names=Names(files="model_files"))
    states = fetch.plan(specs, str(dest), http)
    assert [s.action for s in states] == ["none", "download", "download"]
    assert [s.label for s in states] == ["model_files[0]", "model_files[1]", "model_files[2]"]
    with pytest.raises(fetch.FetchError, match=r"^model_files\[2\] \(.*/unknown.gguf\): required metadata keys"):
        fetch.check_headers(states, http)
    fetch.check_headers(states[:2], http)


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


# --- credentials, redirects and retries, against a server that misbehaves on cue ---------------------------

TOKEN = "hf_" + "T0kEn" * 8
KEY = "mirror-key-" + "k3y" * 8


@pytest.fixture()
def flaky(tmp_path: Path):
    """Factory: flaky(host) starts a FlakyServer serving m.gguf (BLOB) under that host name."""
    from tests.unit.flaky_server import start

    root = tmp_path / "flaky"
    root.mkdir()
    (root / "m.gguf").write_bytes(BLOB)
    servers = []

    def make(host: str = "127.0.0.1"):
        servers.append(start(root, host))
        return servers[-1]

    yield make
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def fetch_file(url: str, dest: Path, http: fetch.Http) -> fetch.FileState:
    """plan() and download() of one file, as the module does (without the GGUF check: BLOB is not GGUF)."""
    state = fetch.plan([fetch.FileSpec(url, SHA)], str(dest), http)[0]
    if state.action != "none":
        dest.mkdir(exist_ok=True)
        fetch.download(state, http)
    return state


def rules(*specs: dict):
    from tests.unit.flaky_server import Rule

    return [Rule(**spec) for spec in specs]


@pytest.mark.parametrize(("script", "kinds", "ranges", "sleeps"), [
    pytest.param([], ["HEAD", "get"], [None], [], id="no-trouble"),
    pytest.param([dict(kind="HEAD", status=503, times=3)], ["HEAD"] * 4 + ["get"], [None], [2, 4, 8],
                 id="503-backoff-doubles"),
    pytest.param([dict(kind="get", status=502, times=2)], ["HEAD", "get", "get", "get"], [None] * 3, [2, 4],
                 id="502-on-the-download"),
    pytest.param([dict(status=429, headers={"Retry-After": "7"})], ["HEAD", "HEAD", "get"], [None], [7],
                 id="429-retry-after-seconds"),
    pytest.param([dict(kind="get", status=503, headers={"Retry-After": "Tue, 14 Nov 2023 22:14:20 GMT"})],
                 ["HEAD", "get", "get"], [None, None], [30], id="503-retry-after-date"),
    pytest.param([dict(kind="get", drop_after=100_000)], ["HEAD", "get", "get"], [None, "bytes=100000-"], [2],
                 id="dropped-then-resumed"),
    pytest.param([dict(kind="get", drop_after=0)], ["HEAD", "get", "get"], [None, None], [2],
                 id="dropped-before-the-body"),
    # the 2 MB the second attempt fetched start the count again: its drop is failure 1 again (a 2 s wait), not 2
    pytest.param([dict(kind="get", drop_after=500_000), dict(kind="get", drop_after=2_000_000)],
                 ["HEAD", "get", "get", "get"], [None, "bytes=500000-", "bytes=2500000-"], [2, 2],
                 id="progress-resets-the-count"),
])
def test_transient_failures_are_retried(flaky, tmp_path: Path, script, kinds, ranges, sleeps) -> None:
    srv = flaky()
    srv.rules = rules(*script)
    waits: list[float] = []
    http = fetch.Http(timeout=5, retry_delay=2, sleep=waits.append, clock=lambda: 1_700_000_030.0)
    fetch_file(srv.url("m.gguf"), tmp_path / "dest", http)
    assert hashlib.sha256((tmp_path / "dest" / "m.gguf").read_bytes()).hexdigest() == SHA
    assert srv.kinds() == kinds
    assert [seen.headers.get("Range") for seen in srv.seen if seen.kind == "get"] == ranges
    assert waits == sleeps
    assert len(http.notes) == len(sleeps)
    assert all(note.startswith("files[0].url %s: 127.0.0.1:%d " % (srv.url("m.gguf"), srv.server_address[1]))
               for note in http.notes), http.notes


@pytest.mark.parametrize(("script", "retries", "message", "kinds", "left"), [
    pytest.param([dict(status=503, times=99)], 2,
                 "{host} answered HTTP 503 Service Unavailable; gave up after 3 attempts (retries=2); run again later",
                 ["HEAD"] * 3, 0, id="503-until-the-retries-are-spent"),
    pytest.param([dict(status=503, times=99)], 0, "{host} answered HTTP 503 Service Unavailable; run again later",
                 ["HEAD"], 0, id="no-retries"),
    pytest.param([dict(kind="get", drop_after=100_000, times=99)], 1,
                 "{host} closed the connection after 100000 of %d bytes; gave up after 2 attempts (retries=1); "
                 "run again to resume" % (len(BLOB) - 100_000), ["HEAD", "get", "get"], 200_000, id="dropped-twice"),
    pytest.param([dict(status=429, headers={"Retry-After": "301"})], 5,
                 "{host} answered HTTP 429 Too Many Requests; the server asks to retry in 301 s, longer than the "
                 "300 s this waits at most; run again later", ["HEAD"], 0, id="429-asks-too-much"),
    pytest.param([dict(kind="get", status=404)], 5,
                 "{host} answered HTTP 404 Not Found: no such file, check files[0].url", ["HEAD", "get"], 0,
                 id="404-at-once"),
    pytest.param([dict(kind="HEAD", status=403)], 5,
                 "{host} answered HTTP 403 Forbidden: it needs credentials: set token (or headers)", ["HEAD"], 0,
                 id="403-at-once"),
    pytest.param([dict(kind="HEAD", status=501)], 5, "{host} answered HTTP 501 Not Implemented", ["HEAD"], 0,
                 id="501-at-once"),
])
def test_what_fails_and_how_it_says_so(flaky, tmp_path: Path, script, retries, message, kinds, left) -> None:
    srv = flaky()
    srv.rules = rules(*script)
    url = srv.url("m.gguf")
    http = fetch.Http(timeout=5, retries=retries, retry_delay=0, sleep=lambda s: None)
    with pytest.raises(fetch.FetchError) as info:
        fetch_file(url, tmp_path, http)
    host = "127.0.0.1:%d" % srv.server_address[1]
    assert str(info.value) == "files[0].url %s: %s" % (url, message.format(host=host))
    assert srv.kinds() == kinds
    part = tmp_path / "m.gguf.part"
    assert (part.stat().st_size if part.exists() else 0) == left
    if left:  # the next run resumes from what the failed one kept
        srv.rules = []
        state = fetch_file(url, tmp_path, http)
        assert state.action == "resume" and srv.seen[-1].headers.get("Range") == "bytes=%d-" % left
        assert (tmp_path / "m.gguf").read_bytes() == BLOB


BEARER = {"Authorization": "Bearer " + TOKEN}


@pytest.mark.parametrize(("origin_wants", "cdn_wants", "settings", "message", "cdn_gets_them"), [
    pytest.param(BEARER, {}, {"token": TOKEN}, None, False, id="token-stays-with-the-origin"),
    pytest.param({"X-Mirror-Key": KEY}, {}, {"headers": {"X-Mirror-Key": KEY}}, None, False, id="header-too"),
    pytest.param(BEARER, BEARER, {"token": TOKEN},
                 "{cdn} answered HTTP 401 Unauthorized after a redirect from {origin}; the token and headers go only "
                 "to {origin}: add localhost to auth_redirect_hosts if it needs them", False, id="cdn-wants-it"),
    pytest.param(BEARER, BEARER, {"token": TOKEN, "auth_redirect_hosts": ("localhost",)}, None, True,
                 id="cdn-listed"),
    pytest.param(BEARER, {}, {}, "{origin} answered HTTP 401 Unauthorized: it needs credentials: set token (or "
                                 "headers)", False, id="no-token"),
    pytest.param(BEARER, {}, {"token": "hf_wrong_" + TOKEN[::-1]},
                 "{origin} answered HTTP 401 Unauthorized to the credentials sent: check that token (or headers) may "
                 "read it (on Hugging Face: a token of an account that accepted a gated model's conditions)", False,
                 id="wrong-token"),
])
def test_credentials_go_to_the_origin_only(flaky, tmp_path: Path, origin_wants, cdn_wants, settings, message,
                                           cdn_gets_them) -> None:
    """The origin wants credentials and redirects (302, with a signed query) to a CDN on another host name."""
    cdn = flaky("localhost")
    origin = flaky()
    origin.require, cdn.require = dict(origin_wants), dict(cdn_wants)
    origin.redirect_to = cdn.base
    http = fetch.Http(timeout=5, retries=0, **settings)
    assert TOKEN not in repr(http) and KEY not in repr(http)
    url = origin.url("m.gguf")
    names = {"origin": "127.0.0.1:%d" % origin.server_address[1], "cdn": "localhost:%d" % cdn.server_address[1]}
    if message is None:
        fetch_file(url, tmp_path, http)
        assert (tmp_path / "m.gguf").read_bytes() == BLOB
        assert origin.kinds() == cdn.kinds() == ["HEAD", "get"]
        assert all(seen.path.endswith("?X-Amz-Signature=" + origin.signature) for seen in cdn.seen)
    else:
        with pytest.raises(fetch.FetchError) as info:
            fetch_file(url, tmp_path, http)
        assert str(info.value) == "files[0].url %s: %s" % (url, message.format(**names))
        assert origin.signature not in str(info.value)
    sent = list(settings.get("headers", {}).items())
    if settings.get("token"):
        sent.append(("Authorization", "Bearer " + settings["token"]))
    for seen in origin.seen:
        assert all(seen.headers.get(name) == value for name, value in sent), seen
    for seen in cdn.seen:
        assert all((seen.headers.get(name) == value) is cdn_gets_them for name, value in sent), seen


def test_redirect_to_a_file_url_is_refused(flaky, tmp_path: Path) -> None:
    origin = flaky()
    origin.redirect_to = "file:///etc"
    with pytest.raises(fetch.FetchError, match=r"^files\[0\]\.url .*: 127\.0\.0\.1:\d+ answered with a redirect to a "
                                               r"URL that is not http or https \(file:///etc/m\.gguf\?\.\.\.\)$"):
        fetch_file(origin.url("m.gguf"), tmp_path, fetch.Http(timeout=5, retries=0))


def test_bad_headers_fail_before_any_request(flaky) -> None:
    with pytest.raises(fetch.FetchError, match=r"^headers\['X-Key'\]: the value has a line break$"):
        fetch.Http(headers={"X-Key": KEY + "\nX-Other: 1"})


def test_a_complete_part_file_is_not_fetched_again(flaky, tmp_path: Path) -> None:
    """A .part that already holds the whole file (a run stopped before the rename) gets 416 for its range."""
    srv = flaky()
    (tmp_path / "m.gguf.part").write_bytes(BLOB)
    state = fetch_file(srv.url("m.gguf"), tmp_path, fetch.Http(timeout=5, retries=0))
    assert state.action == "resume" and state.partial_bytes == len(BLOB)
    assert (tmp_path / "m.gguf").read_bytes() == BLOB
    assert srv.kinds() == ["HEAD", "get"]


def _shards(root: Path) -> list[Path]:
    """A two-shard llama model: the first shard carries the hyperparameters, a vocabulary of 4000 tokens (a header of
    about 72 KiB, longer than the first read below) and layer 0, the second layer 1 and the output."""
    from tests.unit.gguf_testfile import llama_meta, llama_tensors, write_gguf

    meta = llama_meta(**{"tokenizer.ggml.tokens": LLAMA["tokenizer.ggml.tokens"]})
    tensors = llama_tensors()
    first = [t for t in tensors if not t[0].startswith(("blk.1.", "output"))]
    return [write_gguf(root / "s-00001-of-00002.gguf", dict(meta, **{"split.no": 0, "split.count": 2}), first),
            write_gguf(root / "s-00002-of-00002.gguf", {"split.no": 1, "split.count": 2},
                       [t for t in tensors if t not in first])]


@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "no-ranges"])
@pytest.mark.parametrize("in_place", [(), (0,), (0, 1)], ids=["none-in-place", "first-in-place", "all-in-place"])
def test_header_facts_are_the_files_facts(tmp_path: Path, serve_dir, ranges: bool, in_place: tuple) -> None:
    """The planner's facts from the headers over HTTP ranges, or from the files in place, are gguf_facts.model_facts of
    the files themselves (deploy.yml's preflight fit check plans from them before the model is fetched)."""
    from llamafleet.core.gguf_facts import model_facts

    root = tmp_path / "www"
    root.mkdir()
    shards = _shards(root)
    dest = tmp_path / "dest"
    dest.mkdir()
    for index in in_place:
        (dest / shards[index].name).write_bytes(shards[index].read_bytes())
    # a file in place and verified is read here, never asked for: its URL points at nothing
    base = serve_dir(root, ranges=ranges)
    specs = [fetch.FileSpec("http://127.0.0.1:9/%s" % s.name if index in in_place else "%s/%s" % (base, s.name),
                            hashlib.sha256(s.read_bytes()).hexdigest()) for index, s in enumerate(shards)]
    http = fetch.Http(timeout=5, retries=0)
    states = fetch.plan(specs, str(dest), http, record=False)
    assert [s.action for s in states] == ["none" if i in in_place else "download" for i in range(2)]
    facts = fetch.header_facts(states, http)
    assert facts == model_facts([str(s) for s in shards])
    assert facts["n_layer"] == 2 and all(facts["layer_bytes"]) and facts["output_bytes"]


def test_header_facts_refuse_what_is_not_one_model(sources, tmp_path: Path) -> None:
    """A shard without its siblings fails as the planner's own read of the files does, and a file to fetch is still
    checked (its error names it by its label)."""
    base = sources[0][0]
    http = fetch.Http(timeout=5, retries=0, names=Names(files="model_files"))
    lone = fetch.plan([fetch.FileSpec(base + "/m-00002-of-00002.gguf", "0" * 64)], str(tmp_path), http)
    with pytest.raises(fetch.FetchError, match=r"is shard 1 of a 2-file split model, but no other shard was given"):
        fetch.header_facts(lone, http)
    bad = fetch.plan([fetch.FileSpec(base + "/login.html", "0" * 64)], str(tmp_path), http)
    with pytest.raises(fetch.FetchError, match=r"^model_files\[0\]\.url .*: not a GGUF file \(text/html"):
        fetch.header_facts(bad, http)
