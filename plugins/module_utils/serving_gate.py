# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The orchestrator's serving gate: a front door for llama-server and a watchdog for its RPC links.

llama-server talks to its rpc-server workers over TCP without timeouts: a
silent partition to one worker blocks it forever inside a computation while
``/health`` keeps answering 200. The gate listens where clients connect,
relays each request to llama-server on loopback (one upstream connection per
request, ``Connection: close``, responses streamed as they arrive) and keeps a
cluster state, ``serving``, ``loading`` or ``down``, with a reason:

- ``down``: requests get an immediate 503 with a JSON error in llama-server's
  shape and ``Retry-After`` (``/health`` included); going down ends every
  request in flight at once (an SSE stream gets an error event first);
  ``loading``: requests are relayed (llama-server answers 503 "Loading model"
  itself until it is ready);
- the watchdog polls every ``poll_interval`` seconds: the unit's process
  (``systemctl show``), llama-server's ``/health``, and the kernel's view of
  llama-server's connections to the workers (``ss -tinHO``: a link with
  unacknowledged data and no ACK for ``stall_seconds``, seen on two polls in a
  row, is stalled; so is a link that has waited that long for the worker's
  answer while the worker's host, which answered ping before, answers ping no
  more). It never connects to an rpc-server (one client at a time,
  backlog 1). A canary completion every ``canary_interval`` seconds keeps RPC
  traffic flowing on an idle cluster; one that misses ``canary_deadline``
  while ``/metrics`` shows no progress means the cluster is stuck;
- stuck or stalled: SIGKILL to llama-server's MainPID; systemd restarts it,
  its ExecStartPre waits for the workers, it loads and serves again.

Run on the orchestrator as ``python3 -m llamafleet_host.serving_gate --config /etc/llamafleet/gate.json``; the
same entry point runs each worker's rpc-server guard (``guard PORT=UNIT ...``, rpc_guard.py) and the
orchestrator's root plan switch (``switch ...``, plan_switch.py).

This file is the entry point only (nothing imports it, so it is loaded once, as ``__main__`` on the hosts). The
gate's parts, one module per concern, each imported relatively from the same package:

- ``gate_config.py``: the configuration (``gate.json``): defaults, workers, degraded mode, validation;
- ``http_wire.py``: HTTP/1.1 heads, body framing, the chunked codec, error answers, a one-shot client;
- ``gate_metrics.py``: Prometheus text exposition and the gate's own metrics (``/llamafleet/metrics``);
- ``host_observation.py``: what the host shows (``ss``, ``systemctl show``, ``/proc``, ``/metrics``, ping)
  and how commands are run;
- ``link_state.py``: each worker's link from llama-server: ok, stalled, waiting for an answer, lost;
- ``gate_decision.py``: the cluster state and whether to restart llama-server, pure (``decide``);
- ``gate_proxy.py``: the proxy and the state it enforces (``Gate``);
- ``gate_watchdog.py``: the poll loop: observe, decide, act, publish (``Watchdog``);
- ``rpc_guard.py``: the workers' rpc-server guard;
- ``plan_switch.py``: the root service that puts a degraded plan in place;
- ``atomic_file.py``: files written whole or not at all.

Stdlib only: module_utils files of the collection, installed on the hosts in the host package
(constants.HOST_PACKAGE, constants.HOST_SCRIPTS) with ``systemd_show.py``, the one reader of ``systemctl show``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from .gate_config import Config, load_config
from .gate_proxy import Gate, log
from .gate_watchdog import Watchdog
from .plan_switch import switch_main
from .rpc_guard import guard_main


async def serve(cfg: Config) -> None:
    """Run the gate and its watchdog until SIGTERM or SIGINT."""
    gate = Gate(cfg)
    await gate.start()
    log("listening on %s:%d%s, relaying to %s:%d"
        % (cfg.listen_host, cfg.listen_port, " (TLS)" if cfg.tls_cert else "", cfg.upstream_host, cfg.upstream_port))
    watchdog = Watchdog(gate, cfg)
    gate.metrics_text, gate.metrics_key = watchdog.metrics_text, watchdog.api_key
    task = asyncio.ensure_future(watchdog.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log("stopping")
    task.cancel()
    await gate.stop()
    watchdog.write_state()


def main(argv: list[str] | None = None) -> int:
    """``python3 -m llamafleet_host.serving_gate --config /etc/llamafleet/gate.json`` (or ``guard ...``, see
    rpc_guard.guard_main; or ``switch ...``, see plan_switch.switch_main)."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["guard"]:
        return guard_main(argv[1:])
    if argv[:1] == ["switch"]:
        return switch_main(argv[1:])

    parser = argparse.ArgumentParser(prog="llamafleet-gate", description="llamafleet's serving gate for llama-server")
    parser.add_argument("--config", required=True, help="the gate's JSON configuration")
    parser.add_argument("--check", action="store_true", help="validate the configuration and exit")
    args = parser.parse_args(argv)
    try:
        with open(args.config, encoding="utf-8") as handle:
            cfg = load_config(json.load(handle))
    except (OSError, ValueError) as exc:
        sys.stderr.write("llamafleet-gate: %s: %s\n" % (args.config, exc))
        return 2
    if args.check:
        return 0
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        sys.stderr.write("llamafleet-gate: %s\n" % exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
