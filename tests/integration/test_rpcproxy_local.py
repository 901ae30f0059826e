"""The RPC latency proxy in front of a real ggml-rpc-server on 127.0.0.1: the delay it adds, measured through it.

- For each mode, round trips of real RPC commands (an empty graph computed and
  recomputed, 4 KiB read and written with GET_TENSOR / SET_TENSOR, GET_ALIGNMENT)
  are timed through the proxy disarmed and armed: the difference of the medians
  is within 10% of the asked delay for the commands the mode delays, and under
  10% of it for the others.
- A real llama-server loads a tiny synthetic model through the proxy while it is
  disarmed (nothing delayed, the weights counted as SET_TENSOR bytes), then
  streams completions disarmed and armed: every generated token pays the delay
  once (one device: inputs, compute and logits travel as one burst).
- The proxy's own cost: armed at --delay-ms 0 it adds under 1 ms to the median
  GRAPH_COMPUTE and GET_TENSOR round trip compared with rpc-server straight
  (``pytest -s`` prints both medians).
- --rate-mbit: a 4 MiB SET_TENSOR through the proxy takes its size at the cap's
  rate, within 10%.

The proxy runs as its command line does on a host (``python -m
llamafleet.bench.rpcproxy``), armed and disarmed by signals, read through its
stats file. Binaries as for test_llamacpp_local.py: $LLAMAFLEET_LLAMACPP_BIN
(a llama.cpp ``build/bin``), else the dev build; without them every test is skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamafleet.bench import measure
from llamafleet.bench.rpcproxy import delayed_commands
from llamafleet.core.rpc_proto import Cmd
from tests.rpc_client import RpcClient, added_delay_ms, measure_round_trip, set_tensor_payload
from tests.integration import test_llamacpp_local as local
from tests.unit.needs import needs, require

pytestmark = local.pytestmark

DELAY_MS = 20.0
SAMPLES = 25
PROMPT = "The capital of France is"  # about 25 tokens of the synthetic model's character vocabulary
PROBED = (Cmd.GRAPH_COMPUTE, Cmd.GRAPH_RECOMPUTE, Cmd.GET_TENSOR, Cmd.SET_TENSOR, Cmd.GET_ALIGNMENT)


@contextlib.contextmanager
def proxy(upstream: int, mode: str, stats: Path, log: Path, delay_ms: float = DELAY_MS,
          extra: tuple[str, ...] = ()) -> Iterator[tuple[int, subprocess.Popen]]:
    """The proxy's command line (plus ``extra``) in front of 127.0.0.1:upstream, disarmed unless ``extra``
    says ``--armed``; yields (its port, its process)."""
    port = local.free_port()
    argv = [sys.executable, "-m", "llamafleet.bench.rpcproxy", "--listen", "127.0.0.1:%d" % port,
            "--upstream", "127.0.0.1:%d" % upstream, "--delay-ms", str(delay_ms), "--mode", mode,
            "--stats", str(stats), "--stats-interval", "0.1", *extra]
    with local.started(argv, log) as proc:
        read_stats(stats, lambda s: True)
        yield port, proc.popen


def read_stats(path: Path, test, timeout: float = 10.0) -> dict:
    """The proxy's stats file once ``test`` holds for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            stats = json.loads(path.read_text())
            if test(stats):
                return stats
        time.sleep(0.02)
    pytest.fail("the proxy's stats never satisfied the test: %s" % (path.read_text() if path.exists() else "none"))


def arm(proc: subprocess.Popen, stats: Path, armed: bool) -> dict:
    proc.send_signal(signal.SIGUSR1 if armed else signal.SIGUSR2)
    return read_stats(stats, lambda s: s["armed"] is armed)


@pytest.mark.parametrize("mode", ["compute", "transfer", "all"])
def test_delay_added_to_real_commands_is_the_asked_one(tmp_path: Path, mode: str) -> None:
    added = {}
    with local.rpc_server(tmp_path / "cache", tmp_path / "rpc.log") as (upstream, rpc):
        with proxy(upstream, mode, tmp_path / "stats.json", tmp_path / "proxy.log") as (port, proc):
            for command in PROBED:
                plain = measure_round_trip("127.0.0.1", port, command, samples=SAMPLES)
                arm(proc, tmp_path / "stats.json", True)
                slowed = measure_round_trip("127.0.0.1", port, command, samples=SAMPLES)
                arm(proc, tmp_path / "stats.json", False)
                added[command.name] = added_delay_ms(plain, slowed)
        assert rpc.popen.poll() is None, rpc.output()
    for command in PROBED:
        if command in delayed_commands(mode):
            assert abs(added[command.name] - DELAY_MS) <= 0.1 * DELAY_MS, added
        else:
            assert abs(added[command.name]) < 0.1 * DELAY_MS, added


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(importlib.util.find_spec("gguf") and importlib.util.find_spec("numpy"), "the gguf and numpy packages")
    from llamafleet.bench import synth

    path = tmp_path_factory.mktemp("model") / "synth-llama-2x256.gguf"
    synth.write_model(path, synth.SynthSpec(layers=2, hidden=256, ffn=512, heads=4, kv_heads=4, context=512))
    return path


@needs(local.LLAMA_SERVER is not None, "llama-server next to the rpc-server")
def test_llama_server_loads_undelayed_then_every_token_pays_the_delay(tmp_path: Path, tiny_model: Path) -> None:
    stats_path = tmp_path / "stats.json"
    with local.rpc_server(tmp_path / "cache", tmp_path / "rpc.log") as (upstream, _rpc):
        with proxy(upstream, "compute", stats_path, tmp_path / "proxy.log") as (port, proc):
            with local.llama_server(tiny_model, port, tmp_path / "llama.log") as (http_port, _load_s, server):
                loaded = read_stats(stats_path, lambda s: s["commands"].get("SET_TENSOR", {}).get("count"))
                url = "http://127.0.0.1:%d" % http_port
                plain = [measure.stream_completion(url, PROMPT, n_predict=32, timeout=60) for _ in range(3)]
                before = arm(proc, stats_path, True)
                slowed = [measure.stream_completion(url, PROMPT, n_predict=32, timeout=120) for _ in range(3)]
                after = arm(proc, stats_path, False)
                assert server.popen.poll() is None, server.output()
    assert all(r.ok and r.tokens == 32 for r in plain + slowed), [r.error for r in plain + slowed]
    # Loading ran disarmed: weights went through as SET_TENSOR, nothing was held back.
    assert loaded["delayed_commands"] == 0 and loaded["commands"]["SET_TENSOR"]["payload_bytes"] > 1_000_000
    computes = sum(after["commands"][c]["delayed"] - before["commands"].get(c, {}).get("delayed", 0)
                   for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"))
    assert computes >= 3 * 32  # a compute (or recompute of a reused graph) per generated token was delayed
    per_token_plain = 1 / statistics.median(r.tok_s for r in plain)
    per_token_slowed = 1 / statistics.median(r.tok_s for r in slowed)
    # One device: each token is one burst (inputs, compute, logits) ending in one round trip, delayed once.
    assert 0.9 * DELAY_MS <= (per_token_slowed - per_token_plain) * 1000 <= 1.3 * DELAY_MS


OVERHEAD_SAMPLES = 200
MAX_OVERHEAD_MS = 1.0


@pytest.mark.parametrize("command", [Cmd.GRAPH_COMPUTE, Cmd.GET_TENSOR])
def test_the_proxy_at_zero_delay_adds_under_a_millisecond(tmp_path: Path, command: Cmd) -> None:
    """Armed, mode all, --delay-ms 0: every frame takes the delay line's path, nothing waits."""
    with local.rpc_server(tmp_path / "cache", tmp_path / "rpc.log") as (upstream, rpc):
        with proxy(upstream, "all", tmp_path / "stats.json", tmp_path / "proxy.log", delay_ms=0,
                   extra=("--armed",)) as (port, _proc):
            direct = measure_round_trip("127.0.0.1", upstream, command, samples=OVERHEAD_SAMPLES)
            relayed = measure_round_trip("127.0.0.1", port, command, samples=OVERHEAD_SAMPLES)
            stats = read_stats(tmp_path / "stats.json", lambda s: s["commands"].get(command.name, {}).get(
                "delayed", 0) >= OVERHEAD_SAMPLES)
        assert rpc.popen.poll() is None, rpc.output()
    added = added_delay_ms(direct, relayed)
    print("\n%s round trip: direct median %.3f ms, through the proxy (armed, 0 ms) median %.3f ms, added %.3f ms"
          % (command.name, 1000 * statistics.median(direct), 1000 * statistics.median(relayed), added))
    assert stats["armed"] is True and stats["delay_ms"] == 0
    assert added < MAX_OVERHEAD_MS


RATE_MBIT = 80.0
TENSOR_BYTES = 4 << 20


def test_set_tensor_through_a_rate_cap_takes_its_size_at_the_rate(tmp_path: Path) -> None:
    """4 MiB of SET_TENSOR, then GET_ALIGNMENT (answered once the server took it), disarmed: the cap holds anyway."""
    asked_s = TENSOR_BYTES * 8 / (RATE_MBIT * 1e6)
    with local.rpc_server(tmp_path / "cache", tmp_path / "rpc.log") as (upstream, rpc):
        with proxy(upstream, "transfer", tmp_path / "stats.json", tmp_path / "proxy.log",
                   extra=("--rate-mbit", str(RATE_MBIT))) as (port, _proc):
            with RpcClient("127.0.0.1", port) as client:
                request = set_tensor_payload(client.alloc_tensor(TENSOR_BYTES), bytes(TENSOR_BYTES))
                start = time.perf_counter()
                client.send(Cmd.SET_TENSOR, request)
                client.call(Cmd.GET_ALIGNMENT, struct.pack("<I", 0))
                took = time.perf_counter() - start
            stats = read_stats(tmp_path / "stats.json", lambda s: s["rate_wait_ms"] > 0)
        assert rpc.popen.poll() is None, rpc.output()
    print("\nSET_TENSOR of %d bytes at --rate-mbit %g: %.1f ms (%.1f Mbit/s), asked %.1f ms"
          % (TENSOR_BYTES, RATE_MBIT, 1000 * took, TENSOR_BYTES * 8 / took / 1e6, 1000 * asked_s))
    assert stats["rate_mbit"] == RATE_MBIT and stats["armed"] is False and stats["delayed_commands"] == 0
    assert abs(took - asked_s) <= 0.1 * asked_s
