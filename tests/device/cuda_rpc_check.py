#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The CUDA check, run on a lent NVIDIA machine by tests/device/cuda_rpc_check.sh (see there).

    python3 -m tests.device.cuda_rpc_check args CAP          the CMake arguments the role renders for CUDA on CAP
    python3 -m tests.device.cuda_rpc_check run BIN OUT WORK  probe, rpc-server with the rendered argv, loads
    python3 -m tests.device.cuda_rpc_check serve BIN OUT WORK  probe, then the plan served by llama-server

``run`` writes ``OUT/report.json``: what gpu_facts' probe reads on the machine (nvidia-smi, rpc-server's own device
listing), the rpc-server argv the rpc_server role renders (``-d CUDA0 -c``), and four loads of one synthetic model by
llama-bench: local on CUDA0, then through rpc-server (and the byte-counting relay) with an empty cache, with the
cache rpc-server wrote, and with a cache that ``rpc_cache.seed_cache`` wrote from the GGUF alone. Only the standard
library, the project's own modules and what the machine has (numpy, and the gguf wheel carried for the model).

``serve`` plans the split as llama_server's rpc_plan does (``split_plan.plan_split`` on gpu_facts' devices and the
model's GGUF facts) for two shapes (SERVE_SHAPES: an orchestrator without a GPU, and one whose own CUDA0 sits beside
the worker's RPC0), starts llama-server with the argv the role renders (``-lv 5``), asks for a completion, and writes
``OUT/serve.json``: each shape's plan, llama.cpp's load log against it (``log_parse.compare_with_plan``) and its
model, KV and compute buffers per device against the plan's figures (``log_parse.buffers_against_plan``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llamafleet.core.gguf_facts import model_facts
from llamafleet.core.gpu_probe import collect_devices, read_text_file
from llamafleet.core.llama_flags import (render_llama_server_argv, render_rpc_server_argv, rpc_server_features,
                                         server_features)
from llamafleet.core.log_parse import buffers_against_plan, compare_with_plan, parse_load_log
from llamafleet.core.split_plan import plan_split
from llamafleet.core.llamacpp_build import cmake_args
from llamafleet.core.rpc_cache import seed_cache

# The device rpc-server serves (CPU for a dry run of this script on a machine without a GPU).
DEVICE = os.environ.get("LLAMAFLEET_CHECK_DEVICE", "CUDA0")
RPC_PORT = 50052
RELAY_PORT = 50100
SERVER_PORT = 8090
# 2 layers of a 2,048-wide llama in Q8_0 (111 MB): 6 tensors over rpc-server's 10 MiB hash threshold.
MODEL_ARGS = ["--layers", "2", "--hidden", "2048", "--ffn", "5632", "--heads", "16", "--kv-heads", "16",
              "--type", "q8_0", "--quiet"]


def run(argv: list[str], timeout: float = 120, **kw: Any) -> tuple[int, str, str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    return proc.returncode, proc.stdout, proc.stderr


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError("nothing listens on 127.0.0.1:%d after %d s" % (port, timeout))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(bench_bin: str, model: str, rpc: str | None, log: Path) -> dict[str, Any]:
    argv = [bench_bin, "-m", model, "-ngl", "99", "-p", "128", "-n", "32", "-r", "2", "-o", "json"]
    if rpc:
        argv += ["--rpc", rpc]
    started = time.monotonic()
    rc, out, err = run(argv, timeout=180)
    took = time.monotonic() - started
    with log.open("a") as f:
        f.write("$ %s\n(rc=%d, %.1f s)\n%s\n%s\n" % (" ".join(argv), rc, took, out, err[-4000:]))
    results = json.loads(out) if rc == 0 and out.strip().startswith("[") else []
    return {"rc": rc, "seconds": round(took, 2),
            "tok_s": {("pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]): round(r["avg_ts"], 1)
                      for r in results},
            "devices": sorted({r.get("devices", r.get("backends", "")) for r in results})}


def rpc_load(rpc_argv: list[str], cache_home: Path, bench_bin: str, model: str, work: Path, log: Path
             ) -> dict[str, Any]:
    """One llama-bench run through the relay to a fresh rpc-server whose LLAMA_CACHE is ``cache_home``."""
    stats = work / "relay.json"
    stats.unlink(missing_ok=True)
    env = dict(os.environ, LLAMA_CACHE=str(cache_home))
    server_log = (work / "rpc-server.log").open("a")
    server = subprocess.Popen(rpc_argv, env=env, stdout=server_log, stderr=subprocess.STDOUT)
    relay = subprocess.Popen([sys.executable, "-m", "llamafleet.bench.rpcproxy", "--listen",
                              "127.0.0.1:%d" % RELAY_PORT, "--upstream", "127.0.0.1:%d" % RPC_PORT,
                              "--delay-ms", "0", "--mode", "compute", "--armed", "--stats", str(stats),
                              "--stats-interval", "0.2"])
    try:
        wait_port(RPC_PORT)
        wait_port(RELAY_PORT)
        result = bench(bench_bin, model, "127.0.0.1:%d" % RELAY_PORT, log)
        time.sleep(0.6)
    finally:
        stop(relay)
        stop(server)
        server_log.close()
    counters = json.loads(stats.read_text()) if stats.exists() else {}
    result["bytes_to_rpc_server"] = counters.get("bytes_to_upstream")
    result["set_tensor_hash"] = counters.get("commands", {}).get("SET_TENSOR_HASH", {}).get("count")
    result["set_tensor_bytes"] = counters.get("commands", {}).get("SET_TENSOR", {}).get("payload_bytes")
    cache = cache_home / "rpc"
    # (the seeding's own index, a dotfile, is not one of rpc-server's files)
    names = [p.name for p in cache.iterdir()] if cache.is_dir() else []
    result["cache_files"] = sorted(name for name in names if not name.startswith("."))
    return result


def main_run(bin_dir: Path, out: Path, work: Path) -> int:
    bench_bin = str(bin_dir / "llama-bench")
    found, rpc_argv, rpc_help = probe(bin_dir)
    (out / "ggml-rpc-server_help.txt").write_text(rpc_help)
    report: dict[str, Any] = {"gpu_facts": found, "rpc_server_argv": rpc_argv}
    print("devices", json.dumps(found["devices"]), "errors", found["errors"], flush=True)
    print(json.dumps({"rpc_server_argv": rpc_argv}), flush=True)
    print("rpc_devices", json.dumps(found["rpc_devices"]), flush=True)

    model, report["model"] = make_model(work)
    if report["model"]["rc"]:
        (out / "report.json").write_text(json.dumps(report, indent=1))
        return 1
    log = out / "llama-bench.txt"
    report["local_cuda"] = bench(bench_bin, model, None, log)
    print("local", report["local_cuda"], flush=True)
    loads = {}
    for name, home in (("rpc_empty_cache", work / "cache-a"), ("rpc_cache_it_wrote", work / "cache-a")):
        loads[name] = rpc_load(rpc_argv, home, bench_bin, model, work, log)
        print(name, {k: v for k, v in loads[name].items() if k != "cache_files"}, flush=True)
    seeded = work / "cache-b"
    started = time.monotonic()
    result = seed_cache(model, str(seeded / "rpc"))
    loads["seed"] = {"seconds": round(time.monotonic() - started, 1), "seeded_files": len(result.seeded_files),
                     "seeded_bytes": result.seeded_bytes, "hasher": result.hasher,
                     "warnings": list(result.warnings)[:3]}
    loads["rpc_cache_we_seeded"] = rpc_load(rpc_argv, seeded, bench_bin, model, work, log)
    print("rpc_cache_we_seeded", {k: v for k, v in loads["rpc_cache_we_seeded"].items() if k != "cache_files"},
          flush=True)
    loads["same_cache_files"] = (loads["rpc_cache_it_wrote"]["cache_files"]
                                 == loads["rpc_cache_we_seeded"]["cache_files"])
    report["loads"] = loads
    shutil.copy(work / "rpc-server.log", out / "rpc-server.log")
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


def probe(bin_dir: Path) -> tuple[dict[str, Any], list[str], str]:
    """gpu_facts' probe of this machine, the rpc-server argv the rpc_server role renders for DEVICE, and
    rpc-server's --help (what the argv's features were read from)."""
    rpc_bin = str(bin_dir / "ggml-rpc-server")
    found = collect_devices(lambda argv: run(list(argv)), shutil.which, read_text_file, backends=["cuda", "cpu"],
                            rpc_server=rpc_bin)
    rc, help_out, help_err = run([rpc_bin, "--help"])
    argv = render_rpc_server_argv(rpc_bin, rpc_server_features(help_out + help_err), host="127.0.0.1", port=RPC_PORT,
                                  devices=[DEVICE], cache=True)
    return found, argv, help_out + help_err


def make_model(work: Path) -> tuple[str, dict[str, Any]]:
    """The synthetic model (MODEL_ARGS) in ``work``, written once: its path and how the writing went."""
    model = work / "synth.gguf"
    started = time.monotonic()
    rc, err = 0, ""
    if not model.exists():
        rc, dummy, err = run([sys.executable, "-m", "llamafleet.bench.synth", str(model), *MODEL_ARGS], timeout=300)
    return str(model), {"rc": rc, "bytes": model.stat().st_size if rc == 0 else None,
                        "seconds": round(time.monotonic() - started, 1), "err": err[-500:]}


# The two shapes serve plans and runs: the orchestrator without a GPU of its own (CUDA hidden from llama-server, the
# GPU worker's rpc-server holds every layer), and the orchestrator with its own CUDA0 beside the worker's RPC0 (the
# same GPU here), where the plan's -ts order must be llama.cpp's device order.
SERVE_SHAPES = ("cpu_orchestrator", "gpu_orchestrator")


def main_serve(bin_dir: Path, out: Path, work: Path) -> int:
    found, rpc_argv, dummy = probe(bin_dir)
    model, written = make_model(work)
    if written["rc"]:
        (out / "serve.json").write_text(json.dumps({"model": written}, indent=1))
        return 1
    report: dict[str, Any] = {"devices": found["devices"], "rpc_devices": found["rpc_devices"],
                              "rpc_server_argv": rpc_argv, "shapes": {}}
    failed = 0
    for shape in SERVE_SHAPES:
        try:
            result = serve_shape(shape, bin_dir, found, rpc_argv, model, out, work)
        except Exception as exc:  # one shape's failure must not hide the other's result
            result = {"error": "%s: %s" % (type(exc).__name__, exc)}
        report["shapes"][shape] = result
        print(shape, json.dumps({k: result.get(k) for k in ("error", "llama_server_argv", "health_s", "completion",
                                                            "compare_with_plan", "buffers", "buffer_problems")},
                                default=str), flush=True)
        if result.get("error") or result.get("completion", {}).get("rc") != 0 or result.get("compare_with_plan"):
            failed += 1
        (out / "serve.json").write_text(json.dumps(report, indent=1, default=str))
    return 1 if failed else 0


def serve_shape(shape: str, bin_dir: Path, found: dict[str, Any], rpc_argv: list[str], model: str, out: Path,
                work: Path) -> dict[str, Any]:
    """Plans the split as llama_server's rpc_plan does (``split_plan.plan_split`` on gpu_facts' devices and the
    model's GGUF facts), starts rpc-server and llama-server with the argv the roles render (``-lv 5``), asks for a
    completion, and compares llama.cpp's load log and buffers with the plan."""
    server_bin = str(bin_dir / "llama-server")
    rc, h_out, h_err = run([server_bin, "--help"])
    worker = {"host": "gpu", "address": "127.0.0.1", "port": RPC_PORT, "devices": found["rpc_devices"]}
    env = dict(os.environ)
    if shape == "gpu_orchestrator":
        orchestrator = {"host": "orchestrator", "devices": found["devices"]}
    else:
        orchestrator = None
        env["CUDA_VISIBLE_DEVICES"] = ""
    plan = plan_split([worker], orchestrator, model_facts(model), ctx_size=4096, n_parallel=4, kv_unified=True)
    argv = render_llama_server_argv(server_bin, plan, server_features(h_out + h_err), model, host="127.0.0.1",
                                    port=SERVER_PORT, log_verbosity=5)
    report: dict[str, Any] = {"llama_server_argv": argv, "plan": plan}
    print(shape, "llama-server", " ".join(argv), flush=True)
    server_log = work / ("llama-server-%s.log" % shape)
    rpc_env = dict(os.environ, LLAMA_CACHE=str(work / ("cache-%s" % shape)))
    with (work / ("rpc-server-%s.log" % shape)).open("w") as rlog, server_log.open("w") as slog:
        rpc = subprocess.Popen(rpc_argv, env=rpc_env, stdout=rlog, stderr=subprocess.STDOUT)
        server = None
        try:
            wait_port(RPC_PORT)
            server = subprocess.Popen(argv, env=env, stdout=slog, stderr=subprocess.STDOUT)
            report["health_s"] = wait_health(SERVER_PORT, 180)
            started = time.monotonic()
            body = json.dumps({"prompt": "The quick brown fox", "n_predict": 32, "ignore_eos": True}).encode()
            rc, o, e = run(["curl", "-sf", "-H", "Content-Type: application/json", "-d", body.decode(),
                            "http://127.0.0.1:%d/completion" % SERVER_PORT], timeout=120)
            answer = json.loads(o) if rc == 0 else {}
            report["completion"] = {"rc": rc, "seconds": round(time.monotonic() - started, 2),
                                    "tokens": answer.get("tokens_predicted"), "timings": answer.get("timings")}
        finally:
            if server is not None:
                stop(server)
            stop(rpc)
            shutil.copy(server_log, out / server_log.name)
    parsed = parse_load_log(server_log.read_text(errors="replace"))
    report["compare_with_plan"] = compare_with_plan(plan, parsed)
    report["buffers"], report["buffer_problems"] = buffers_against_plan(plan, parsed)
    return report


def wait_health(port: int, timeout: float) -> float:
    """Seconds until llama-server's /health answers 200 (its model loaded)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        rc, o, e = run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:%d/health" % port],
                       timeout=10)
        if o.strip() == "200":
            return round(time.monotonic() - started, 1)
        time.sleep(0.5)
    raise TimeoutError("llama-server: /health not 200 after %d s" % timeout)


def main(argv: list[str]) -> int:
    if argv[:1] == ["args"]:
        print("\n".join(cmake_args({"backend": "cuda", "cuda_architectures": argv[1], "ccache": False}, "x86_64")))
        return 0
    if argv[:1] == ["serve"]:
        return main_serve(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    if argv[:1] == ["run"]:
        return main_run(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
