"""fetch_policy: credentials and the hosts that get them, what to retry and how long to wait, what errors say."""

from __future__ import annotations

import email.utils
import http.client
import socket
import ssl
import urllib.error

import pytest

from llamafleet.core import fetch_policy as fp

ROLE = fp.Names(files="model_files", token="model_token", headers="model_headers",
                auth_redirect_hosts="model_auth_redirect_hosts", retries="model_download_retries")
NOW = 1_700_000_000.0


# --- credentials ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("token", "headers", "expected"), [
    ("", {}, {}),
    (None, None, {}),
    ("hf_abc", {}, {"Authorization": "Bearer hf_abc"}),
    ("  hf_abc\n", {}, {"Authorization": "Bearer hf_abc"}),
    ("Bearer hf_abc", {}, {"Authorization": "Bearer hf_abc"}),
    ("bearer  hf_abc", {}, {"Authorization": "Bearer hf_abc"}),
    ("", {"X-Api-Key": "k1", "Accept": " */* "}, {"X-Api-Key": "k1", "Accept": "*/*"}),
    ("", {"X-Count": 3}, {"X-Count": "3"}),
    ("", {"Authorization": "Basic dXNlcjpwdw=="}, {"Authorization": "Basic dXNlcjpwdw=="}),
    ("t0k", {"X-Trace": "1"}, {"X-Trace": "1", "Authorization": "Bearer t0k"}),
])
def test_credential_headers(token, headers, expected) -> None:
    assert fp.credential_headers(token, headers, ROLE) == expected


SECRET = "s3cr3t-value-never-printed"


@pytest.mark.parametrize(("token", "headers", "message"), [
    ("", {"Bad Name": SECRET}, "model_headers['Bad Name']: not an HTTP header name"),
    ("", {"X-Key": SECRET + "\r\nX-Evil: 1"}, "model_headers['X-Key']: the value has a line break"),
    ("", {"X-Key": None}, "model_headers['X-Key']: the value must be a string"),
    ("", {"X-Key": [SECRET]}, "model_headers['X-Key']: the value must be a string"),
    ("", {"Range": "bytes=0-"}, "model_headers['Range']: the download sets this header itself; remove it"),
    ("", {"host": "example.org"}, "model_headers['host']: the download sets this header itself; remove it"),
    (SECRET, {"authorization": SECRET}, "model_token and model_headers['Authorization'] both set the "
                                        "Authorization header: keep one"),
    (SECRET + " " + SECRET, {}, "model_token: a token has no spaces or line breaks"),
    ("Bearer ", {}, "model_token: a token has no spaces or line breaks"),
])
def test_credential_headers_refuse_without_printing_values(token, headers, message) -> None:
    with pytest.raises(ValueError) as info:
        fp.credential_headers(token, headers, ROLE)
    assert str(info.value) == message
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(("first", "target", "hosts", "sends"), [
    ("https://huggingface.co/o/r/resolve/c/m.gguf", "https://huggingface.co/o2/r/resolve/c/m.gguf", (), True),
    ("https://huggingface.co/m.gguf", "https://HuggingFace.co:443/m.gguf", (), True),
    ("https://huggingface.co/m.gguf", "https://cdn-lfs.huggingface.co/x?sig=1", (), False),
    ("https://huggingface.co/m.gguf", "https://cas-bridge.xethub.hf.co/x", (), False),
    ("https://huggingface.co/m.gguf", "https://cas-bridge.xethub.hf.co/x", ("cas-bridge.xethub.hf.co",), True),
    ("https://huggingface.co/m.gguf", "https://CDN.example/x", (" cdn.example ",), True),
    ("https://huggingface.co/m.gguf", "http://cdn.example/x", ("cdn.example",), False),  # never down to http
    ("https://huggingface.co/m.gguf", "http://huggingface.co/m.gguf", (), False),
    ("http://mirror.lan/m.gguf", "https://mirror.lan/m.gguf", (), True),  # upgrade, default ports
    ("http://mirror.lan:8089/m.gguf", "https://mirror.lan/m.gguf", (), False),
    ("http://mirror.lan:8089/m.gguf", "http://mirror.lan:8090/m.gguf", (), False),  # another port, another service
    ("http://mirror.lan:8089/m.gguf", "http://mirror.lan:8089/other", (), True),
    ("http://10.77.0.1:8089/m.gguf", "http://10.77.0.2:8089/m.gguf", (), False),
    ("http://10.77.0.1:8089/m.gguf", "http://10.77.0.2:8089/m.gguf", ("", "10.77.0.2"), True),
])
def test_sends_credentials(first: str, target: str, hosts: tuple[str, ...], sends: bool) -> None:
    assert fp.sends_credentials(first, target, hosts) is sends


@pytest.mark.parametrize(("current", "location", "expected"), [
    ("https://huggingface.co/o/r/resolve/c/m.gguf", "https://cdn.example/blob?sig=1", "https://cdn.example/blob?sig=1"),
    ("https://huggingface.co/o/r/resolve/c/m.gguf", "/o2/r/resolve/c/m.gguf", "https://huggingface.co/o2/r/resolve/c/m.gguf"),
    ("http://h/a/b.gguf", "c d.gguf", "http://h/a/c%20d.gguf"),
    ("http://h/a/b.gguf", "//other/x", "http://other/x"),
])
def test_redirect_target(current: str, location: str, expected: str) -> None:
    assert fp.redirect_target(current, location) == expected


@pytest.mark.parametrize("location", ["file:///etc/shadow", "ftp://h/m.gguf", "data:,x"])
def test_redirect_target_refuses_other_schemes(location: str) -> None:
    with pytest.raises(ValueError, match="a redirect to a URL that is not http or https"):
        fp.redirect_target("https://h/m.gguf", location)


@pytest.mark.parametrize(("url", "shown"), [
    ("https://huggingface.co/o/r/resolve/c/m.gguf", "https://huggingface.co/o/r/resolve/c/m.gguf"),
    ("https://cdn.example/blob?X-Amz-Signature=abc&X-Amz-Credential=def", "https://cdn.example/blob?..."),
    ("https://user:pw-secret@mirror.lan:8443/m.gguf#frag", "https://user:***@mirror.lan:8443/m.gguf"),
    ("https://user@mirror.lan/m.gguf", "https://user@mirror.lan/m.gguf"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert fp.redact_url(url) == shown


@pytest.mark.parametrize(("url", "host"), [
    ("https://huggingface.co/x", "huggingface.co"), ("http://10.77.0.1:8089/x", "10.77.0.1:8089"),
    ("http://[::1]:8080/x", "[::1]:8080"), ("https://u:p@h.example/x", "h.example"),
])
def test_host_of(url: str, host: str) -> None:
    assert fp.host_of(url) == host


# --- retries -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "transient"), [
    (200, False), (301, False), (400, False), (401, False), (403, False), (404, False), (408, False),
    (410, False), (416, False), (429, True), (500, True), (501, False), (502, True), (503, True), (504, True),
    (505, False), (511, False), (520, True), (599, True),
])
def test_is_transient_status(code: int, transient: bool) -> None:
    assert fp.is_transient_status(code) is transient


def _gaierror(errno: int) -> socket.gaierror:
    return socket.gaierror(errno, "name resolution")


@pytest.mark.parametrize(("exc", "transient", "described"), [
    (urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")), True,
     "unreachable ([Errno 111] Connection refused)"),
    (urllib.error.URLError(TimeoutError("timed out")), True, "timed out"),
    (urllib.error.URLError("timed out"), True, "timed out"),
    (urllib.error.URLError(_gaierror(socket.EAI_AGAIN)), True, "unreachable ([Errno %d] name resolution)"
     % socket.EAI_AGAIN),
    (urllib.error.URLError(_gaierror(socket.EAI_NONAME)), False, "unreachable ([Errno %d] name resolution)"
     % socket.EAI_NONAME),
    (urllib.error.URLError(ssl.SSLCertVerificationError(1, "certificate verify failed")), False,
     "unreachable (certificate verify failed)"),
    (urllib.error.URLError("unknown url type: file"), False, "unreachable (unknown url type: file)"),
    (urllib.error.HTTPError("http://h/x", 503, "Service Unavailable", None, None), True, None),
    (urllib.error.HTTPError("http://h/x", 404, "Not Found", None, None), False, None),
    (TimeoutError("timed out"), True, "timed out"),
    (ConnectionResetError(104, "Connection reset by peer"), True,
     "dropped the connection ([Errno 104] Connection reset by peer)"),
    (http.client.IncompleteRead(b"x" * 10, 90), True, "dropped the connection (IncompleteRead(10 bytes read, 90 more "
                                                      "expected))"),
    (http.client.RemoteDisconnected("Remote end closed connection without response"), True,
     "dropped the connection (Remote end closed connection without response)"),
    (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), True,
     "dropped the connection (EOF occurred in violation of protocol)"),
    (OSError(28, "No space left on device"), False, None),
    (ValueError("x"), False, None),
])
def test_is_transient_error(exc: BaseException, transient: bool, described: str | None) -> None:
    assert fp.is_transient_error(exc) is transient
    if described is not None:
        assert fp.describe_error(exc) == described


@pytest.mark.parametrize(("value", "seconds"), [
    ("120", 120.0), (" 0 ", 0.0), ("", None), (None, None), ("soon", None), ("-5", None), ("1.5", None),
    (email.utils.formatdate(NOW + 90, usegmt=True), 90.0),
    (email.utils.formatdate(NOW - 90, usegmt=True), 0.0),  # in the past: at once
    ("Wed, 21 Oct 2015 07:28:00", 0.0),  # no zone: GMT, long past
])
def test_parse_retry_after(value: str | None, seconds: float | None) -> None:
    assert fp.parse_retry_after(value, NOW) == seconds


@pytest.mark.parametrize(("base", "cap", "schedule"), [
    (5, 60, [5, 10, 20, 40, 60, 60]),
    (1, 60, [1, 2, 4, 8, 16, 32, 60]),
    (0, 60, [0, 0, 0]),
    (0.01, 60, [0.01, 0.02, 0.04]),
    (90, 60, [90, 90]),  # a configured delay beyond the cap is the cap
    (-3, 60, [0, 0]),
])
def test_backoff_delay(base: float, cap: float, schedule: list[float]) -> None:
    assert [fp.backoff_delay(n, base, cap) for n in range(1, len(schedule) + 1)] == pytest.approx(schedule)


def test_backoff_counts_from_one() -> None:
    with pytest.raises(ValueError):
        fp.backoff_delay(0, 5)


@pytest.mark.parametrize(("failures", "retries", "retry_after", "wait", "refused"), [
    (1, 5, None, 5.0, None),
    (3, 5, None, 20.0, None),
    (5, 5, None, 60.0, None),
    (6, 5, None, None, "gave up after 6 attempts (model_download_retries=5)"),
    (1, 0, None, None, ""),
    (1, 5, 30.0, 30.0, None),  # the server's wish wins over the backoff
    (4, 5, 0.0, 0.0, None),
    (2, 5, 300.0, 300.0, None),
    (2, 5, 301.0, None, "the server asks to retry in 301 s, longer than the 300 s this waits at most"),
    (6, 5, 1.0, None, "gave up after 6 attempts (model_download_retries=5)"),
])
def test_wait_before_retry(failures: int, retries: int, retry_after: float | None, wait: float | None,
                           refused: str | None) -> None:
    if refused is None:
        assert fp.wait_before_retry(failures, retries, 5.0, retry_after, ROLE) == wait
        return
    with pytest.raises(fp.RetryRefused) as info:
        fp.wait_before_retry(failures, retries, 5.0, retry_after, ROLE)
    assert str(info.value) == refused


# --- messages -----------------------------------------------------------------------------------------

HF = "https://huggingface.co/org/repo/resolve/abc/m.gguf"
CDN = "https://cas-bridge.xethub.hf.co/xet-bridge/abc?X-Amz-Signature=secret"


@pytest.mark.parametrize(("code", "reason", "url", "credentials", "message"), [
    (401, "Unauthorized", HF, "none",
     "huggingface.co answered HTTP 401 Unauthorized: it needs credentials: set model_token (or model_headers)"),
    (401, "Unauthorized", HF, "sent",
     "huggingface.co answered HTTP 401 Unauthorized to the credentials sent: check that model_token (or "
     "model_headers) may read it (on Hugging Face: a token of an account that accepted a gated model's conditions)"),
    (403, "Forbidden", CDN, "withheld",
     "cas-bridge.xethub.hf.co answered HTTP 403 Forbidden after a redirect from huggingface.co; the token and "
     "headers go only to huggingface.co: add cas-bridge.xethub.hf.co to model_auth_redirect_hosts if it needs them"),
    (404, "Not Found", HF, "sent", "huggingface.co answered HTTP 404 Not Found: no such file, check model_files[2].url"),
    (410, "Gone", "http://10.77.0.1:8089/m.gguf", "none",
     "10.77.0.1:8089 answered HTTP 410 Gone: no such file, check model_files[2].url"),
    (400, "Bad Request", HF, "none",
     "huggingface.co answered HTTP 400 Bad Request: check model_files[2].url and model_headers"),
    (503, "Service Unavailable", HF, "sent", "huggingface.co answered HTTP 503 Service Unavailable"),
    (429, "", HF, "none", "huggingface.co answered HTTP 429"),
])
def test_status_problem(code: int, reason: str, url: str, credentials: str, message: str) -> None:
    text = fp.status_problem(code, reason, url, "model_files[2]", credentials, HF, ROLE)
    assert text == message
    assert "secret" not in text


def test_status_problem_names_the_options_by_default() -> None:
    assert fp.status_problem(401, "Unauthorized", HF, "files[0]", "none") == (
        "huggingface.co answered HTTP 401 Unauthorized: it needs credentials: set token (or headers)")


@pytest.mark.parametrize(("labels", "expected"), [
    (None, fp.Names(files="model_files")),
    ({}, fp.Names(files="model_files")),
    ({"token": "model_token", "retries": "model_download_retries"},
     fp.Names(files="model_files", token="model_token", retries="model_download_retries")),
])
def test_names_of(labels, expected) -> None:
    assert fp.Names.of("model_files", labels) == expected


def test_names_of_refuses_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"^labels: unknown key\(s\) files, tokn; known: token, headers, "
                                         r"auth_redirect_hosts, retries$"):
        fp.Names.of("model_files", {"tokn": "x", "files": "y"})
