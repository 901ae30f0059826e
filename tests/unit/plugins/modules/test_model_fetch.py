"""model_fetch module: the GGUF header check names the role's variable, in check mode and before a download;
credentials and retries against a loopback server that misbehaves on cue (tests/unit/flaky_server.py)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.unit.gguf_testfile import write_gguf

from ansible_collections.llamafleet.cluster.plugins.modules import model_fetch
from tests.unit.module_runner import run_main

HTML = b"<!DOCTYPE html>\n<html><body>404: not here, but 200 all the same</body></html>\n"


@pytest.fixture()
def mirror(tmp_path: Path, serve_dir):
    """An HTML page and a small GGUF on the lab mirror's server: (base URL, the served directory)."""
    (tmp_path / "page.html").write_bytes(HTML)
    write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama", "llama.block_count": 1,
                                     "llama.embedding_length": 64}, [("blk.0.w", (64, 4), 0)])
    return serve_dir(tmp_path), tmp_path


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(model_fetch.main, args, capsys)


@pytest.mark.parametrize("check_mode", [True, False])
def test_a_page_that_is_not_gguf_fails_before_anything_is_written(
        mirror, tmp_path: Path, check_mode: bool, capsys: pytest.CaptureFixture[str]) -> None:
    base, root = mirror
    dest = tmp_path / "dest"
    files = [{"url": base + "/m.gguf", "sha256": hashlib.sha256((root / "m.gguf").read_bytes()).hexdigest()},
             {"url": base + "/page.html", "sha256": hashlib.sha256(HTML).hexdigest()}]
    rc, result = run_module({"files": files, "dest": str(dest), "label": "model_files", "free_margin_mib": 0,
                             "_ansible_check_mode": check_mode}, capsys)
    assert rc == 1
    assert result["msg"] == ("model_files[1].url %s/page.html: not a GGUF file (text/html, starts with "
                             "'<!DOCTYPE html>')" % base)
    assert not dest.exists()


def test_good_files_pass_the_check_without_a_msg(mirror, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The model role's preflight treats a msg as the failure (it registers with failed_when: false)."""
    base, root = mirror
    files = [{"url": base + "/m.gguf", "sha256": hashlib.sha256((root / "m.gguf").read_bytes()).hexdigest()}]
    args = {"files": files, "dest": str(tmp_path / "dest"), "label": "model_files", "free_margin_mib": 0}
    rc, result = run_module(dict(args, _ansible_check_mode=True), capsys)
    assert rc == 0 and "msg" not in result and result["fetched"] == ["m.gguf"], result
    rc, result = run_module(args, capsys)
    assert rc == 0 and result["changed"] is True
    assert (tmp_path / "dest" / "m.gguf").read_bytes() == (root / "m.gguf").read_bytes()


# --- credentials and retries through the module, as the model role calls it ------------------------------

REPO = Path(__file__).resolve().parents[4]
ROLE_TASK = next(task["llamafleet.cluster.model_fetch"] for task in
                 yaml.safe_load((REPO / "roles" / "model" / "tasks" / "main.yml").read_text(encoding="utf-8"))
                 if "llamafleet.cluster.model_fetch" in task)
TOKEN = "hf_" + "m0dUl3T0k" * 5
KEY = "mirror-" + "s3cr3tK3y" * 4
BEARER = {"Authorization": "Bearer " + TOKEN}
NO_LOG = "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER"


def test_the_role_names_its_own_variables() -> None:
    """The errors name what the user sets: the role passes labels that are its variables."""
    defaults = yaml.safe_load((REPO / "roles" / "model" / "defaults" / "main.yml").read_text(encoding="utf-8"))
    assert ROLE_TASK["label"] == "model_files"
    assert set(ROLE_TASK["labels"]) == {"token", "headers", "auth_redirect_hosts", "retries"}
    assert set(ROLE_TASK["labels"].values()) <= set(defaults)


@pytest.fixture()
def flaky_model(tmp_path: Path):
    """A FlakyServer serving big.gguf, a 2.3 MiB GGUF (its header check reads 1 MiB, the download gets the rest)."""
    from tests.unit.flaky_server import start

    root = tmp_path / "www"
    root.mkdir()
    path = write_gguf(root / "big.gguf", {"general.architecture": "llama", "llama.block_count": 1,
                                          "llama.embedding_length": 64}, [("blk.0.w", (64, 9472), 0)])
    srv = start(root)
    yield srv, hashlib.sha256(path.read_bytes()).hexdigest()
    srv.shutdown()
    srv.server_close()


R = "model_files[0].url {url}: {host} "
GAVE_UP = "; gave up after 3 attempts (model_download_retries=2); run again to resume"


@pytest.mark.parametrize(("wants", "script", "args", "kinds", "retried", "message"), [
    pytest.param(BEARER, [], {"token": TOKEN}, ["HEAD", "range", "get"], [], None, id="a-bearer-token"),
    pytest.param({"X-Mirror-Key": KEY}, [], {"headers": {"X-Mirror-Key": KEY}}, ["HEAD", "range", "get"], [], None,
                 id="a-custom-header"),
    pytest.param(BEARER, [], {}, ["HEAD"], [],
                 R + "answered HTTP 401 Unauthorized: it needs credentials: set model_token (or model_headers)",
                 id="a-no-token"),
    pytest.param(BEARER, [], {"token": TOKEN[:-1]}, ["HEAD"], [],
                 R + "answered HTTP 401 Unauthorized to the credentials sent: check that model_token (or "
                 "model_headers) may read it (on Hugging Face: a token of an account that accepted a gated model's "
                 "conditions)", id="a-wrong-token"),
    pytest.param(BEARER, [dict(status=503, times=3)], {"token": TOKEN}, ["HEAD"] * 4 + ["range", "get"],
                 [R + "answered HTTP 503 Service Unavailable: retry %d of 5 in %s s" % (n + 1, wait)
                  for n, wait in enumerate(["0.01", "0.02", "0.04"])], None, id="b-503-three-times"),
    pytest.param({}, [dict(kind="get", drop_after=1_000_000)], {}, ["HEAD", "range", "get", "get"],
                 [R + "closed the connection after 1000000 of {size} bytes: retry 1 of 5 in 0.01 s"], None,
                 id="c-dropped-midway"),
    pytest.param({}, [dict(kind="range", status=429, headers={"Retry-After": "1"})], {},
                 ["HEAD", "range", "range", "get"], [R + "answered HTTP 429 Too Many Requests: retry 1 of 5 in 1 s"],
                 None, id="d-429-retry-after"),
    pytest.param({}, [dict(status=429, headers={"Retry-After": "3600"})], {}, ["HEAD"], [],
                 R + "answered HTTP 429 Too Many Requests; the server asks to retry in 3600 s, longer than the 300 s "
                 "this waits at most; run again later", id="d-429-too-long"),
    pytest.param(BEARER, [dict(kind="get", status=503, times=99)], {"token": TOKEN, "retries": 2},
                 ["HEAD", "range", "get", "get", "get"],
                 [R + "answered HTTP 503 Service Unavailable: retry %d of 2 in %s s" % (n + 1, wait)
                  for n, wait in enumerate(["0.01", "0.02"])],
                 R + "answered HTTP 503 Service Unavailable" + GAVE_UP, id="b-503-for-good"),
    pytest.param(BEARER, [dict(kind="get", status=404)], {"token": TOKEN}, ["HEAD", "range", "get"], [],
                 R + "answered HTTP 404 Not Found: no such file, check model_files[0].url", id="404"),
])
def test_auth_and_retries(flaky_model, tmp_path: Path, capsys: pytest.CaptureFixture[str], wants, script, args,
                          kinds, retried, message) -> None:
    from tests.unit.flaky_server import Rule

    srv, sha = flaky_model
    srv.require = dict(wants)
    srv.rules = [Rule(**spec) for spec in script]
    url = srv.url("big.gguf")
    size = (srv.root / "big.gguf").stat().st_size
    dest = tmp_path / "dest"
    module_args = {"files": [{"url": url, "sha256": sha}], "dest": str(dest), "free_margin_mib": 0, "timeout": 5,
                   "retry_delay": 0.01, "label": ROLE_TASK["label"], "labels": ROLE_TASK["labels"], **args}
    started = time.monotonic()
    rc, result = run_module(module_args, capsys)
    fill = {"url": url, "host": "127.0.0.1:%d" % srv.server_address[1], "size": size}
    if message is None:
        assert rc == 0, result
        assert hashlib.sha256((dest / "big.gguf").read_bytes()).hexdigest() == sha
    else:
        assert rc == 1 and result["msg"] == message.format(**fill)
        assert not (dest / "big.gguf").exists()
    assert srv.kinds() == kinds
    assert result["retried"] == [note.format(**fill) for note in retried]
    if "429" in str(retried):
        assert time.monotonic() - started >= 1.0  # Retry-After: 1 was honoured, not the 0.01 s backoff
    if "drop_after" in str(script):
        assert srv.seen[-1].headers.get("Range") == "bytes=1000000-"  # the retry resumed from the bytes on disk
    # every request carried the credentials given; none came back in the result (nothing needed masking either)
    sent = dict(args.get("headers", {}), **({"Authorization": "Bearer " + args["token"]} if "token" in args else {}))
    for seen in srv.seen:
        assert all(seen.headers.get(name) == value for name, value in sent.items())
    assert_nothing_secret(result, TOKEN, KEY)


def assert_nothing_secret(result: dict[str, Any], *secrets: str) -> None:
    """No secret in the result, and no mask where one was caught (Ansible masks no_log values in a result: a
    mask outside ``invocation`` means the module put one there)."""
    output = json.dumps(result)
    assert not [secret for secret in secrets if secret in output]
    invocation = result["invocation"]["module_args"]
    assert invocation["token"] in (None, NO_LOG) and set(invocation["headers"].values()) <= {NO_LOG}
    rest = json.dumps({key: value for key, value in result.items() if key != "invocation"})
    assert "********" not in rest and NO_LOG not in rest


def test_the_token_is_not_in_an_error_about_the_cdn(flaky_model, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A redirect to another host (a CDN that wants the token too) fails naming the setting that would send it."""
    from tests.unit.flaky_server import start

    origin, sha = flaky_model
    cdn = start(origin.root, "localhost")
    try:
        origin.require = cdn.require = dict(BEARER)
        origin.redirect_to = cdn.base
        args = {"files": [{"url": origin.url("big.gguf"), "sha256": sha}], "dest": str(tmp_path / "d"),
                "free_margin_mib": 0, "timeout": 5, "token": TOKEN, "label": ROLE_TASK["label"],
                "labels": ROLE_TASK["labels"]}
        rc, result = run_module(args, capsys)
        assert rc == 1
        assert result["msg"] == (
            "model_files[0].url %s: localhost:%d answered HTTP 401 Unauthorized after a redirect from 127.0.0.1:%d; "
            "the token and headers go only to 127.0.0.1:%d: add localhost to model_auth_redirect_hosts if it needs "
            "them" % (origin.url("big.gguf"), cdn.server_address[1], origin.server_address[1],
                      origin.server_address[1]))
        assert_nothing_secret(result, TOKEN, cdn.signature)
        assert "Authorization" not in cdn.seen[0].headers
        rc, result = run_module(dict(args, auth_redirect_hosts=["localhost"]), capsys)
        assert rc == 0 and cdn.kinds() == ["HEAD", "HEAD", "range", "get"], cdn.kinds()
        assert_nothing_secret(result, TOKEN, cdn.signature)
    finally:
        cdn.shutdown()
        cdn.server_close()


# the retry's state stands in the progress file for 0.3 s, and the watcher must read it then: starved at load 8-10
# beside make check's other workers it did not (make check runs this alone, before its parallel workers)
@pytest.mark.timing
def test_the_progress_file_while_it_downloads_and_retries(flaky_model, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """What await_progress shows of a download (the role runs it async): bytes of the total, the retry it waits for,
    no URL and no token; the file is gone when the module ends."""
    import threading

    from tests.unit.flaky_server import Rule

    from llamafleet.core.await_progress import transfer_of

    srv, sha = flaky_model
    srv.require = dict(BEARER)
    srv.rules = [Rule(kind="get", drop_after=1_000_000)]
    dest = tmp_path / "dest"
    progress = dest / ".model_fetch-progress.json"
    seen: list[str] = []
    raw: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                text = progress.read_text()
            except OSError:
                text = ""
            if text:
                raw.append(text)
                seen.append(transfer_of(text) or "")
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        rc, result = run_module({"files": [{"url": srv.url("big.gguf"), "sha256": sha}], "dest": str(dest),
                                 "free_margin_mib": 0, "timeout": 5, "retry_delay": 0.3, "token": TOKEN,
                                 "progress": str(progress)}, capsys)
    finally:
        stop.set()
        watcher.join()
    assert rc == 0 and len(result["retried"]) == 1, result
    assert not progress.exists() and sorted(p.name for p in dest.iterdir()) == [".big.gguf.verified", "big.gguf"]
    assert any(text.endswith("of 2.3 MiB (41%), retrying in 0.3 s") for text in seen), seen
    assert not [text for text in raw if TOKEN in text or "127.0.0.1" in text or "http" in text]
