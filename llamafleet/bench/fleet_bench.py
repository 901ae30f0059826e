# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's side of ``playbooks/bench.yml``: check the matrix, measure a point, write the report.

playbooks/bench.yml (role llamafleet.cluster.bench) calls, with the Python that
runs ansible-playbook, each of these subcommands, which read one JSON object on
standard input and print one JSON object:

- ``needs``: nothing -> ``missing``, what the controller lacks of the ``llamafleet[bench]`` extra
  (matplotlib for the plots, ...), and ``message``, the pip command that installs it; bench.yml asserts
  it first, before anything touches the cluster.
- ``validate``: the bench_* variables and the inventory's worker names -> the
  run folder (created) and the matrix's points, or the errors, each naming
  its variable. Nothing on the fleet is touched before this passes.
- ``measure``: one point (its workers, latency, policy), the plan llama_server
  made for it, the load time read from the journal and the proxies' stats at
  the end of the load -> streamed completions and the concurrency sweep
  against llama-server (llamafleet.bench.measure), the point written as
  ``points/NNN.json`` in the run folder, and a progress line.
- ``record``: a point that did not run (its plan does not fit, or a step
  failed), written the same way with its status.
- ``report``: every point of the run folder -> llamafleet.bench.report's
  files (results.json, CSV, report.md, PNG plots, the fitted model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..core.split_policies import POLICIES
from . import measure
from .report import Point, Repetition, load_points, write_report
from .rpcproxy import MODES

POINTS_DIR = "points"
# add_host group of the first N workers, the llama_server role's llama_server_workers_group for a point.
GROUP = "llamafleet_bench_workers_%d"
START_FILE = "started"
# Milliseconds: 1 s of one-way latency per link is not a network any more.
MAX_LATENCY_MS = 1000.0
# A split policy of the bench only: balanced, told each link's round trip (the deploy's measured one plus the
# point's injected latency, both ways), as deploy.yml plans with llama_server_link_rtt_ms=auto on such a link.
AUTO_POLICY = "auto"
BENCH_POLICIES = (*POLICIES, AUTO_POLICY)
# bench.yml has this many build slots (a playbook cannot loop over plays; each slot is an import of
# playbooks/bench_build.yml that runs only when bench_builds is that long).
MAX_BUILDS = 3
# What a build of bench_builds may set: the llamacpp_build variables that decide what is built. bench.yml sets
# them on every host for the build's matrix and sets them back afterwards.
BUILD_KEYS = ("llamacpp_build_source_type", "llamacpp_build_git_repo", "llamacpp_build_git_version",
              "llamacpp_build_archive_url", "llamacpp_build_archive_sha256", "llamacpp_build_archive_subdir",
              "llamacpp_build_version", "llamacpp_build_cmake_args", "llamacpp_build_native",
              "llamacpp_build_cuda_architectures", "llamacpp_build_rocm_targets")
_BUILD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,39}$")


def _numbers(value: Any, name: str, errors: list[str], *, integer: bool, minimum: float) -> list[float]:
    """``value`` as a non-empty list of numbers >= ``minimum``; appends an error naming ``name`` otherwise."""
    if not isinstance(value, list) or not value:
        errors.append("%s must be a non-empty list, not %r" % (name, value))
        return []
    out: list[float] = []
    for item in value:
        number: float | None
        if isinstance(item, bool):
            number = None
        elif isinstance(item, (int, float)):
            number = float(item)
        elif isinstance(item, str):
            try:
                number = float(item.strip())
            except ValueError:
                number = None
        else:
            number = None
        if number is None or not math.isfinite(number):
            errors.append("%s: %r is not a number" % (name, item))
        elif integer and number != int(number):
            errors.append("%s: %r is not a whole number" % (name, item))
        elif number < minimum:
            errors.append("%s: %r is below %s" % (name, item, int(minimum) if minimum == int(minimum) else minimum))
        else:
            out.append(number)
    return out


def check_builds(value: Any, errors: list[str]) -> list[dict[str, Any]]:
    """bench_builds as ``[{"name", "vars"}]`` (empty: the deployed build only); appends errors naming it."""
    if value in (None, []):
        return []
    if not isinstance(value, list):
        errors.append("bench_builds must be a list of {name, vars}, not %r" % (value,))
        return []
    if len(value) > MAX_BUILDS:
        errors.append("bench_builds: %d builds asked, bench.yml compares at most %d" % (len(value), MAX_BUILDS))
    out: list[dict[str, Any]] = []
    for i, build in enumerate(value):
        where = "bench_builds[%d]" % i
        if not isinstance(build, dict) or set(build) - {"name", "vars"}:
            errors.append("%s must be a mapping with name and vars, not %r" % (where, build))
            continue
        name, variables = build.get("name"), build.get("vars") or {}
        if not isinstance(name, str) or not _BUILD_NAME.match(name):
            errors.append("%s.name %r: 1-40 letters, digits, '.', '_', '+' or '-'" % (where, name))
        elif name in {b["name"] for b in out}:
            errors.append("%s.name %r is used twice" % (where, name))
        if not isinstance(variables, dict):
            errors.append("%s.vars must be a mapping of llamacpp_build variables, not %r" % (where, variables))
            continue
        for key in variables:
            if key not in BUILD_KEYS:
                errors.append("%s.vars: %r is not a build setting (use %s)" % (where, key, ", ".join(BUILD_KEYS)))
        out.append({"name": name, "vars": variables})
    return out


def _positive_int(value: Any, name: str, errors: list[str], minimum: int = 1) -> int:
    got = _numbers([value], name, errors, integer=True, minimum=minimum)
    return int(got[0]) if got else minimum


def check_results_dir(path: str) -> str | None:
    """None when ``path`` can be created and written; otherwise why not."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / (".bench-write-test.%d" % os.getpid())
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except OSError as exc:
        return "%s cannot be written: %s" % (path, exc.strerror or exc)
    return None


# The extra that holds what bench.yml needs on the controller (pyproject.toml's optional dependencies).
BENCH_EXTRA = "bench"


def extra_requirements(extra: str = BENCH_EXTRA) -> list[str]:
    """The requirements of llamafleet's ``extra`` as installed (its metadata), else as a checkout's
    pyproject.toml declares them."""
    from importlib import metadata

    try:
        declared = metadata.requires("llamafleet") or []
    except metadata.PackageNotFoundError:
        declared = []
    marker = re.compile(r";\s*extra\s*==\s*[\"']%s[\"']\s*$" % re.escape(extra))
    found = [marker.sub("", r).strip() for r in declared if marker.search(r)]
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not found and pyproject.is_file():
        import tomllib

        found = list(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["optional-dependencies"][extra])
    return found


def controller_needs(requirements: list[str] | None = None) -> dict[str, Any]:
    """What the controller lacks of ``requirements`` (default: the bench extra's): ``missing`` (each a
    requirement with what is installed, if anything) and ``message`` (what to install, with which pip)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    missing = []
    for text in extra_requirements() if requirements is None else requirements:
        req = Requirement(text)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(f"{req} ({have} installed)")
    message = ""
    if missing:
        message = (f"bench.yml needs on the controller: {', '.join(missing)}; install llamafleet's bench extra into "
                   f"the Python that runs ansible-playbook: {sys.executable} -m pip install 'llamafleet[{BENCH_EXTRA}]'"
                   " (from a checkout: pip install '.[bench]'); nothing on the cluster was touched")
    return {"missing": missing, "message": message}


def api_key(data: dict[str, Any]) -> str:
    """The API key of a ``measure`` step: read from ``api_key_file`` (a 0600 file the playbook wrote on the
    controller, so that the key is never on a command line), else ``LLAMAFLEET_API_KEY``, else none."""
    path = data.get("api_key_file")
    if path:
        return Path(str(path)).read_text(encoding="utf-8").strip()
    return os.environ.get("LLAMAFLEET_API_KEY", "")


def validate(settings: dict[str, Any]) -> dict[str, Any]:
    """Check the bench_* variables; the matrix's points, or ``errors`` (each naming its variable).

    ``settings``: the bench_* variables as the playbook has them, ``workers``
    (the inventory's worker names, in order) and ``run_id``.
    """
    errors: list[str] = []
    workers = list(settings.get("workers") or [])
    if not workers:
        errors.append("the inventory has no workers (group %s)" % settings.get("workers_group", "llamafleet_workers"))
    counts_in = settings.get("bench_worker_counts")
    counts = [int(n) for n in _numbers(counts_in, "bench_worker_counts", errors, integer=True, minimum=1)] \
        if counts_in not in (None, []) else list(range(1, len(workers) + 1))
    for n in counts:
        if workers and n > len(workers):
            errors.append("bench_worker_counts: %d workers asked, the inventory has %d (%s)"
                          % (n, len(workers), ", ".join(workers)))
    latencies = _numbers(settings.get("bench_latencies_ms"), "bench_latencies_ms", errors, integer=False, minimum=0)
    for value in latencies:
        if value > MAX_LATENCY_MS:
            errors.append("bench_latencies_ms: %g is above %g ms" % (value, MAX_LATENCY_MS))
    policies = settings.get("bench_policies")
    if not isinstance(policies, list) or not policies:
        errors.append("bench_policies must be a non-empty list, not %r" % (policies,))
        policies = []
    for policy in policies:
        if policy not in BENCH_POLICIES:
            errors.append("bench_policies: unknown policy %r (use %s)" % (policy, ", ".join(BENCH_POLICIES)))
    builds = check_builds(settings.get("bench_builds"), errors)
    bandwidths_in = settings.get("bench_bandwidths_mbit")
    bandwidths = _numbers(bandwidths_in, "bench_bandwidths_mbit", errors, integer=False, minimum=0) \
        if bandwidths_in not in (None, []) else [0.0]
    if settings.get("bench_proxy_mode") not in MODES:
        errors.append("bench_proxy_mode: unknown mode %r (use %s)" % (settings.get("bench_proxy_mode"), ", ".join(MODES)))
    _positive_int(settings.get("bench_repetitions"), "bench_repetitions", errors)
    _positive_int(settings.get("bench_n_predict"), "bench_n_predict", errors, minimum=2)
    _positive_int(settings.get("bench_sweep_n_predict"), "bench_sweep_n_predict", errors, minimum=2)
    concurrency = settings.get("bench_concurrency")
    if concurrency not in (None, []):
        for n in _numbers(concurrency, "bench_concurrency", errors, integer=True, minimum=1):
            if n > measure.MAX_CLIENTS:
                errors.append("bench_concurrency: %d is above %d clients" % (n, measure.MAX_CLIENTS))
    if settings.get("bench_sweep_seconds") not in (None, ""):
        _numbers([settings.get("bench_sweep_seconds")], "bench_sweep_seconds", errors, integer=False, minimum=0)
    port = _positive_int(settings.get("bench_proxy_port"), "bench_proxy_port", errors)
    if port + len(workers) > 65536:
        errors.append("bench_proxy_port: %d + %d workers runs past port 65535" % (port, len(workers)))
    results_dir = str(settings.get("bench_results_dir") or "")
    if not results_dir:
        errors.append("bench_results_dir must name a folder")
    if errors:
        return {"errors": errors}
    problem = check_results_dir(results_dir)
    if problem:
        return {"errors": ["bench_results_dir: " + problem]}
    run_dir = Path(results_dir).resolve() / str(settings.get("run_id") or time.strftime("%Y%m%dT%H%M%S"))
    (run_dir / POINTS_DIR).mkdir(parents=True, exist_ok=True)
    (run_dir / START_FILE).write_text("%f\n" % time.time(), encoding="utf-8")
    points = matrix(workers, counts, latencies, list(policies), bandwidths, [b["name"] for b in builds])
    return {"errors": [], "run_dir": str(run_dir), "points": points, "builds": builds,
            "build_keys": sorted({key for b in builds for key in b["vars"]}),
            "groups": [{"group": GROUP % n, "workers": workers[:n]} for n in sorted(set(counts))],
            # the library's folder on the controller: the bench role ships bench/rpcproxy.py from it to the hosts
            "library_dir": str(Path(__file__).resolve().parents[1])}


def matrix(workers: list[str], counts: list[int], latencies: list[float], policies: list[str],
           bandwidths: list[float] | None = None, builds: list[str] | None = None) -> list[dict[str, Any]]:
    """The points, numbered from 1: each build ("": the deployed one) × count × policy × bandwidth cap (0: none)
    × latency (latency varies fastest)."""
    points = []
    for build, n, policy, bandwidth, latency in itertools.product(builds or [""], counts, policies,
                                                                  bandwidths or [0.0], latencies):
        points.append({"index": len(points) + 1, "nodes": n, "workers": workers[:n], "group": GROUP % n,
                       "latency_ms": latency, "policy": policy, "bandwidth_mbit": bandwidth, "build": build})
    return points


def progress_line(index: int, total: int, elapsed_s: float) -> str:
    """``point 3/8 done, 2m10s elapsed, about 3m30s left`` (the estimate: the mean point so far)."""
    left = elapsed_s / index * (total - index) if index else 0.0
    return "point %d/%d done, %s elapsed, about %s left" % (index, total, _duration(elapsed_s), _duration(left))


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return "%dm%02ds" % divmod(seconds, 60) if seconds >= 60 else "%ds" % seconds


_MONOTONIC = re.compile(r"^\[\s*(\d+\.\d+)\]")


def load_seconds(start_usec: Any, journal_line: str) -> float | None:
    """Seconds from llama-server's start to its ``model loaded`` line.

    ``start_usec``: the unit's ExecMainStartTimestampMonotonic (µs);
    ``journal_line``: that line in ``journalctl -o short-monotonic`` form.
    None when either is missing.
    """
    match = _MONOTONIC.match(journal_line.strip())
    try:
        start = int(str(start_usec).strip()) / 1e6
    except ValueError:
        return None
    if not match or start <= 0:
        return None
    return round(float(match.group(1)) - start, 3)


def rpc_hops(plan: dict[str, Any]) -> int | None:
    """How many RPC devices the plan gives layers (the hops a token crosses); None without a plan.

    A plan device (rpc_plan's ``plan.devices``) is remote unless ``local``; its
    ``layers`` is ``{"count": n, ...}``.
    """
    devices = plan.get("devices") if isinstance(plan, dict) else None
    if not isinstance(devices, list):
        return None
    excluded = {(d.get("name") if isinstance(d, dict) else d) for d in plan.get("excluded") or []}
    return sum(1 for d in devices
               if not d.get("local") and d.get("name") not in excluded and _layer_count(d.get("layers")) > 0)


def _layer_count(layers: Any) -> int:
    return int(layers.get("count", 0)) if isinstance(layers, dict) else int(layers or 0)


def bytes_per_worker(hosts: list[str], stats: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes each worker was sent up to the end of the load, by host: ``hosts[i]``'s proxy counted ``stats[i]``."""
    out: dict[str, int] = {}
    for host, counters in zip(hosts, stats):
        out[host] = out.get(host, 0) + int((counters or {}).get("bytes_to_upstream", 0))
    return out


def weights_per_worker(plan: dict[str, Any]) -> dict[str, int]:
    """Bytes of weights the plan gives each worker host (its RPC devices together): what its cache can supply."""
    out: dict[str, int] = {}
    for device in (plan.get("devices") if isinstance(plan, dict) else None) or []:
        if device.get("local") or not device.get("host") or device.get("weights_mib") is None:
            continue
        out[device["host"]] = out.get(device["host"], 0) + int(float(device["weights_mib"]) * 1024 * 1024)
    return out


def point_path(run_dir: Path, index: int) -> Path:
    return run_dir / POINTS_DIR / ("%03d.json" % index)


def write_point(run_dir: Path, index: int, point: Point, extra: dict[str, Any]) -> Path:
    """Write ``points/NNN.json``: the report's Point fields and what else the run knows of it."""
    path = point_path(run_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(point), **extra}, indent=2) + "\n", encoding="utf-8")
    return path


def _point(spec: dict[str, Any], status: str = "ok") -> Point:
    return Point(nodes=int(spec["nodes"]), latency_ms=float(spec["latency_ms"]), policy=str(spec["policy"]),
                 bandwidth_mbit=float(spec.get("bandwidth_mbit") or 0.0), build=str(spec.get("build") or ""),
                 status=status)


def elapsed(run_dir: Path) -> float:
    """Seconds since validate started the run."""
    try:
        return time.time() - float((run_dir / START_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0.0


def run_measure(data: dict[str, Any]) -> dict[str, Any]:
    """Measure one point against the llama-server at ``data['url']``; write it; its summary and progress."""
    spec, run_dir = data["point"], Path(data["run_dir"])
    point = _point(spec)
    point.load_s = load_seconds(data.get("start_usec"), data.get("loaded_line", ""))
    point.bytes_per_worker = bytes_per_worker(data.get("proxy_hosts") or [], data.get("proxy_stats") or [])
    point.weights_per_worker = weights_per_worker(data.get("plan") or {})
    point.hops = rpc_hops(data.get("plan") or {})
    point.plan_policy = str((data.get("plan") or {}).get("policy") or "")
    point.build_id = str(data.get("build_id") or "")
    key = api_key(data)

    def one(n_predict: int) -> measure.StreamResult:
        return measure.stream_completion(data["url"], n_predict=n_predict, api_key=key,
                                         timeout=float(data.get("timeout", 300)))

    results = [one(int(data["n_predict"])) for _ in range(int(data["repetitions"]))]
    point.repetitions = [Repetition.from_dict(asdict(r)) for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok})
    sweep_n = int(data.get("sweep_n_predict", data["n_predict"]))
    seconds = float(data.get("sweep_seconds") or 0)
    point.sweep = [asdict(measure.sweep(lambda: one(sweep_n), int(n), requests=None if seconds else int(n),
                                        duration_s=seconds or None))
                   for n in data.get("concurrency") or []]
    if not point.repetitions:
        point.status = "failed: " + "; ".join(errors or ["no completion"])
    write_point(run_dir, int(spec["index"]), point, {"workers": spec["workers"], "errors": errors,
                                                       "proxy_stats": data.get("proxy_stats") or []})
    tok_s = [r.tok_s for r in point.repetitions if r.tok_s]
    return {"status": point.status, "tok_s": round(sorted(tok_s)[len(tok_s) // 2], 2) if tok_s else None,
            "load_s": point.load_s, "bytes_per_worker": point.bytes_per_worker,
            "weights_per_worker": point.weights_per_worker, "hops": point.hops,
            "plan_policy": point.plan_policy,
            "progress": progress_line(int(spec["index"]), int(data["total"]), elapsed(run_dir))}


def run_record(data: dict[str, Any]) -> dict[str, Any]:
    """Write a point that did not run, with why."""
    spec, run_dir = data["point"], Path(data["run_dir"])
    reason = " ".join(str(data.get("status") or "failed").split())
    point = _point(spec, status=reason if reason.startswith(("failed", "does not fit")) else "failed: " + reason)
    write_point(run_dir, int(spec["index"]), point, {"workers": spec["workers"]})
    return {"status": point.status,
            "progress": progress_line(int(spec["index"]), int(data["total"]), elapsed(run_dir))}


def run_report(data: dict[str, Any]) -> dict[str, Any]:
    """Write the report of every point in the run folder; its files, the fitted model and the table."""
    run_dir = Path(data["run_dir"])
    points = sorted(run_dir.glob(POINTS_DIR + "/*.json"))
    raw = [json.loads(p.read_text(encoding="utf-8")) for p in points]
    merged = run_dir / "points.json"
    merged.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    lines: list[str] = []
    paths = write_report(load_points(merged), run_dir, echo=lines.append)
    return {"run_dir": str(run_dir), "files": {k: str(v) for k, v in paths.items()}, "fits": lines,
            "table": (run_dir / "report.md").read_text(encoding="utf-8").splitlines(),
            "elapsed": _duration(elapsed(run_dir))}


COMMANDS = {"needs": lambda data: controller_needs(), "validate": validate, "measure": run_measure, "record": run_record, "report": run_report}


def main(argv: list[str] | None = None) -> int:
    """``python -m llamafleet.bench.fleet_bench COMMAND < input.json``: print the command's JSON answer."""
    parser = argparse.ArgumentParser(prog="python -m llamafleet.bench.fleet_bench",
                                     description="The controller's steps of playbooks/bench.yml (JSON in, JSON out).")
    parser.add_argument("command", choices=sorted(COMMANDS))
    args = parser.parse_args(argv)
    try:
        data = json.loads(sys.stdin.read() or "{}")
    except ValueError as exc:
        parser.error("standard input is not JSON: %s" % exc)
    print(json.dumps(COMMANDS[args.command](data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
