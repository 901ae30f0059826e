"""Weight-cache hashes, cache seeding and the HELLO probe against real llama.cpp binaries on 127.0.0.1.

These tests start a real ``ggml-rpc-server -c`` and a real ``llama-server --rpc``
loading a synthetic 321 MB llama model (14 tensors over the 10 MiB hash
threshold) and check that:

- the cache files rpc-server writes have exactly the names and sizes that
  llamafleet.core.rpc_cache computes from the GGUF file;
- a cache seeded by rpc_cache.seed_cache (no server involved) makes the first
  load of a fresh rpc-server receive almost nothing, with the same greedy output;
- rpc_proto.rpc_hello reads the version rpc-server announces, and reports a
  server busy with another client as such.

Binaries come from $LLAMAFLEET_LLAMACPP_BIN (a llama.cpp ``build/bin``), else the
dev build under /var/cache/llamafleet; without them every test is skipped.
Needs the ``gguf`` and ``numpy`` packages for the synthetic model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llamafleet.core import rpc_cache, rpc_proto
from llamafleet.core.fnv import hash_ranges
from tests.unit.needs import needs, require

REPO = Path(__file__).resolve().parents[2]
DEV_BUILD = Path("/var/cache/llamafleet/dev/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")
RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server", "llama-rpc-server")


def _bin_dir() -> Path | None:
    configured = os.environ.get("LLAMAFLEET_LLAMACPP_BIN")
    candidate = Path(configured) if configured else DEV_BUILD
    return candidate if candidate.is_dir() else None


BIN_DIR = _bin_dir()


def _find(names: tuple[str, ...]) -> Path | None:
    if BIN_DIR is None:
        return None
    for name in names:
        if (BIN_DIR / name).is_file() and os.access(BIN_DIR / name, os.X_OK):
            return BIN_DIR / name
    return None


RPC_SERVER = _find(RPC_SERVER_NAMES)
LLAMA_SERVER = _find(("llama-server",))

if os.environ.get("LLAMAFLEET_LLAMACPP_BIN") and (RPC_SERVER is None or LLAMA_SERVER is None):
    raise RuntimeError("LLAMAFLEET_LLAMACPP_BIN=%s holds no ggml-rpc-server and llama-server"
                       % os.environ["LLAMAFLEET_LLAMACPP_BIN"])

pytestmark = needs(
    RPC_SERVER is not None and LLAMA_SERVER is not None,
    "llama.cpp binaries (ggml-rpc-server and llama-server) in %s: set LLAMAFLEET_LLAMACPP_BIN to a llama.cpp "
    "build/bin directory" % (os.environ.get("LLAMAFLEET_LLAMACPP_BIN") or DEV_BUILD),
)


def free_port() -> int:
    """A TCP port nobody listens on right now (bound once by the kernel's choice, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Proc:
    """A started server: its process and the file collecting its output."""

    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def started(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Proc]:
    """Run argv in its own process group, output to ``log``; kill the group however the block ends."""
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {})}, start_new_session=True)
    proc = Proc(popen, log)
    try:
        yield proc
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGTERM)
            try:
                popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(timeout=10)


@contextlib.contextmanager
def rpc_server(cache_root: Path, log: Path, debug: bool = False) -> Iterator[tuple[int, Proc]]:
    """ggml-rpc-server -c on 127.0.0.1 with LLAMA_CACHE=cache_root (cache files land in cache_root/rpc)."""
    port = free_port()
    env = {"LLAMA_CACHE": str(cache_root)}
    if debug:
        env["GGML_RPC_DEBUG"] = "1"
    argv = [str(RPC_SERVER), "-H", "127.0.0.1", "-p", str(port), "-c", "-t", "1"]
    with started(argv, log, env) as proc:
        try:
            rpc_proto.wait_for_hello("127.0.0.1", port, timeout=30, interval=0.2)
        except rpc_proto.RPCError as exc:
            pytest.fail("rpc-server did not come up: %s\n%s" % (exc, proc.output()))
        yield port, proc


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextlib.contextmanager
def llama_server(model: Path, rpc_port: int, log: Path) -> Iterator[tuple[int, float, Proc]]:
    """llama-server with every layer on the rpc-server; yields (port, seconds until /health said 200, proc)."""
    port = free_port()
    argv = [str(LLAMA_SERVER), "-m", str(model), "--rpc", "127.0.0.1:%d" % rpc_port, "-ngl", "99",
            "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "256", "-np", "1"]
    start = time.monotonic()
    with started(argv, log) as proc:
        deadline = start + 180
        while True:
            if proc.popen.poll() is not None:
                pytest.fail("llama-server exited with %s while loading:\n%s" % (proc.popen.returncode, proc.output()))
            try:
                status = _get("http://127.0.0.1:%d/health" % port, timeout=2)[0]
            except OSError:
                status = 0
            if status == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail("llama-server did not load in 180 s:\n%s" % proc.output())
            time.sleep(0.1)
        yield port, time.monotonic() - start, proc


def complete(port: int, prompt: str = "The capital of France is", tokens: int = 8) -> list[int]:
    """Greedy completion; returns the generated token ids."""
    body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0, "return_tokens": True}).encode()
    request = urllib.request.Request("http://127.0.0.1:%d/completion" % port, data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["tokens_predicted"] == tokens
    return answer["tokens"]


SET_TENSOR = re.compile(r"^\[set_tensor\] .*size: (\d+)$", re.MULTILINE)
CACHE_HIT = re.compile(r"^\[set_tensor_hash\] .*size: (\d+), hash: ([0-9a-f]+)$", re.MULTILINE)


def uploaded_bytes(rpc_log: str) -> tuple[int, int]:
    """(bytes received through SET_TENSOR, tensors served from the cache) in a GGML_RPC_DEBUG=1 log."""
    return sum(int(m) for m in SET_TENSOR.findall(rpc_log)), len(CACHE_HIT.findall(rpc_log))


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(importlib.util.find_spec("gguf") and importlib.util.find_spec("numpy"), "the gguf and numpy packages")
    from llamafleet.bench import synth

    path = tmp_path_factory.mktemp("model") / "synth-llama-2x2560.gguf"
    synth.write_model(path, synth.SynthSpec())
    return path


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """The hash helper: built from the role's source when a C compiler exists, else next to the binaries."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler:
        out = tmp_path_factory.mktemp("helper") / "llamafleet-fnv1a64"
        source = REPO / "roles" / "llamacpp_build" / "files" / "llamafleet-fnv1a64.c"
        subprocess.run([compiler, "-O2", "-pthread", "-o", str(out), str(source)], check=True)
        return str(out)
    installed = _find(("llamafleet-fnv1a64",))
    return str(installed) if installed else None


@pytest.fixture(scope="module")
def expected(synth_model: Path, helper: str | None) -> dict[str, int]:
    """Cache file name -> size, as rpc_cache computes it from the GGUF file."""
    hashed = rpc_cache.model_hashes(str(synth_model), hasher=rpc_cache.make_hasher(helper, jobs=2))
    assert hashed.tensors_over_threshold == 14
    return {entry.name: entry.size for entry in hashed.entries}


def cache_listing(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if rpc_cache.CACHE_NAME.match(p.name)}


def test_rpc_hello_reads_the_version_rpc_server_announces(tmp_path: Path) -> None:
    with rpc_server(tmp_path / "cache", tmp_path / "rpc.log") as (port, proc):
        version = rpc_proto.rpc_hello("127.0.0.1", port, timeout=5)
        # probes must leave the single client slot free: a second one answers at once
        assert rpc_proto.rpc_hello("127.0.0.1", port, timeout=5) == version
        banner = re.search(r"Starting RPC server v(\d+)\.(\d+)\.(\d+)", proc.output())
        assert banner, proc.output()
        assert version == tuple(int(n) for n in banner.groups())


def test_rpc_hello_reports_a_busy_server_and_does_not_kill_it(tmp_path: Path) -> None:
    with rpc_server(tmp_path / "cache", tmp_path / "rpc.log") as (port, proc):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as holder:
            holder.sendall(rpc_proto.hello_request())
            assert len(holder.recv(64)) > 0  # the server now serves this client, and only it
            with pytest.raises(rpc_proto.RPCTimeout, match="serves one client at a time"):
                rpc_proto.rpc_hello("127.0.0.1", port, timeout=1)
        # the abandoned probe is served next: with a plain close, rpc-server would die of SIGPIPE here
        assert rpc_proto.wait_for_hello("127.0.0.1", port, timeout=10, interval=0.2).version[0] >= 7
        assert proc.popen.poll() is None, proc.output()


def test_rpc_hello_module_through_ansible(tmp_path: Path) -> None:
    ansible = Path(sys.executable).parent / "ansible"
    require(ansible.is_file(), "ansible next to %s" % sys.executable)
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
           "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    tree = tmp_path / "tree"  # ansible -t writes each host's result there as JSON
    with rpc_server(tmp_path / "cache", tmp_path / "rpc.log") as (port, dummy):
        def run(args: str) -> tuple[int, dict]:
            proc = subprocess.run([str(ansible), "localhost", "-i", "localhost,", "-c", "local", "-t", str(tree),
                                   "-e", "ansible_python_interpreter=%s" % sys.executable,
                                   "-m", "llamafleet.cluster.rpc_hello", "-a", args], env=env, capture_output=True,
                                  timeout=120, check=False)
            return proc.returncode, json.loads((tree / "localhost").read_text())

        rc, ok = run("host=127.0.0.1 port=%d timeout=10 expect_major=7" % port)
        assert rc == 0 and ok["version"] == "7.0.0" and ok["changed"] is False, ok
        rc, wrong = run("host=127.0.0.1 port=%d timeout=10 expect_major=6" % port)
        assert rc != 0 and "speaks RPC protocol 7.0.0, expected major version 6" in wrong["msg"]
    rc, gone = run("host=127.0.0.1 port=%d timeout=2" % port)
    assert rc != 0 and "127.0.0.1:%d did not answer HELLO: connection refused" % port in gone["msg"]


def test_cache_files_written_by_rpc_server_match_our_hashes(tmp_path: Path, synth_model: Path,
                                                            expected: dict[str, int], helper: str | None) -> None:
    cache_root = tmp_path / "llama-cache"
    with rpc_server(cache_root, tmp_path / "rpc.log", debug=True) as (rpc_port, rpc):
        with llama_server(synth_model, rpc_port, tmp_path / "server.log") as (dummy, seconds, dummy):
            sent, hits = uploaded_bytes(rpc.output())
    written = cache_listing(cache_root / "rpc")
    assert written == expected, "rpc-server wrote %s, rpc_cache computed %s" % (written, expected)
    for name, size in written.items():
        assert hash_ranges(cache_root / "rpc" / name, [(0, size)], helper=helper) == [name]
    assert hits == 0
    assert sent >= sum(expected.values())
    print("cold load: %.2f s, %.1f MB received by rpc-server" % (seconds, sent / 1e6))


def test_seeded_cache_makes_the_first_load_send_almost_nothing(tmp_path: Path, synth_model: Path,
                                                               expected: dict[str, int], helper: str | None) -> None:
    cold_root, warm_root = tmp_path / "cold", tmp_path / "warm"
    with rpc_server(cold_root, tmp_path / "rpc-cold.log", debug=True) as (rpc_port, rpc):
        with llama_server(synth_model, rpc_port, tmp_path / "server-cold.log") as (port, cold_seconds, dummy):
            cold_sent = uploaded_bytes(rpc.output())[0]
            cold_tokens = complete(port)

    seeded = rpc_cache.seed_cache(str(synth_model), str(warm_root / "rpc"), helper=helper, jobs=2)
    assert sorted(seeded.seeded_files) == sorted(expected) and seeded.seeded_bytes == sum(expected.values())
    assert not rpc_cache.seed_cache(str(synth_model), str(warm_root / "rpc"), helper=helper).changed

    with rpc_server(warm_root, tmp_path / "rpc-warm.log", debug=True) as (rpc_port, rpc):
        with llama_server(synth_model, rpc_port, tmp_path / "server-warm.log") as (port, warm_seconds, dummy):
            warm_sent, hits = uploaded_bytes(rpc.output())
            warm_tokens = complete(port)
    assert hits == 14
    assert warm_sent < 0.02 * cold_sent, (warm_sent, cold_sent)
    assert cold_sent - warm_sent >= sum(expected.values())
    assert warm_tokens == cold_tokens
    # rpc-server wrote nothing new: every large tensor came from the seeded files
    assert cache_listing(warm_root / "rpc") == expected
    print("cold load %.2f s / %.1f MB sent; seeded load %.2f s / %.2f MB sent"
          % (cold_seconds, cold_sent / 1e6, warm_seconds, warm_sent / 1e6))
