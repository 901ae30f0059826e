# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Prometheus text exposition: the renderer (the gate's own metrics, and the workers', rpc_metrics.py), the gate's
metrics (:data:`GATE_METRICS`: its state, the model loads and the clock behind them, each worker link's figures from
the kernel), and the answer to :data:`GATE_METRICS_PATH`.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .gate_decision import STATES
from .http_wire import RequestHead, error_response


# The gate's own metrics, answered by the gate in every state (with the API key when one is set; never while the
# key the config names cannot be read).
GATE_METRICS_PATH = "/llamafleet/metrics"
Sample = tuple[str, Mapping[str, str], float]
# name: (type, help) of the gate's metrics, in the order it lists them.
GATE_METRICS: dict[str, tuple[str, str]] = {
    "llamafleet_gate_state": (
        "gauge", "1 for the cluster state the gate enforces now (label state: serving, loading or down), else 0."),
    "llamafleet_gate_state_since_seconds": ("gauge", "Unix time the gate entered its current state."),
    "llamafleet_gate_requests_total": ("counter", "Client requests the gate read (its own metrics excluded)."),
    "llamafleet_gate_rejected_total": ("counter", "Client requests the gate answered 503 itself."),
    "llamafleet_gate_aborted_total": ("counter", "Requests in flight the gate ended because the cluster went down."),
    "llamafleet_gate_in_flight": ("gauge", "Requests relayed to llama-server now."),
    # The KV budget (gate_budget.py), only where the slots share a cache.
    "llamafleet_gate_kv_budget_tokens": ("gauge", "KV cells llama-server's slots share, which the gate keeps "
                                                  "generations within."),
    "llamafleet_gate_kv_reserved_tokens": ("gauge", "Tokens the generations admitted now may hold in the shared cache."),
    "llamafleet_gate_kv_waiting": ("gauge", "Generations waiting for room in the shared cache."),
    "llamafleet_gate_restarts_total": (
        "counter", "llama-server restarts the watchdog made (SIGKILL when stuck or stalled; systemd starts it again)."),
    "llamafleet_gate_degraded": (
        "gauge", "1 while llama-server runs a plan without a lost worker host (llama_server_degrade), else 0."),
    "llamafleet_llama_server_load_seconds": (
        "gauge", "Seconds the last model load took: from llama-server's start (systemd's ExecMainStartTimestamp) to "
                 "its first /health 200, as the gate's poll saw it. Absent until the gate saw a load end."),
    "llamafleet_llama_server_ready_since_seconds": (
        "gauge", "Unix time llama-server's last load ended (its first /health 200)."),
    "llamafleet_llama_server_loads_total": ("counter", "Model loads the gate saw end since it started."),
    # Each worker's link from llama-server as the kernel sees it (ss -tin, the watchdog's last poll), label worker
    # ("host:port"); see link_samples. Absent while ss gives no answer; the tcp_info series absent while the link is
    # lost. The counters are the kernel's: they start again at 0 with each new connection (a restart).
    "llamafleet_gate_link_connected": (
        "gauge", "1 while llama-server holds an established connection to the worker, else 0 (lost)."),
    "llamafleet_gate_link_rtt_seconds": ("gauge", "Smoothed round-trip time of the link (tcpi_rtt)."),
    "llamafleet_gate_link_rttvar_seconds": ("gauge", "Round-trip time variation of the link (tcpi_rttvar)."),
    "llamafleet_gate_link_sent_bytes_total": (
        "counter", "Bytes llama-server sent the worker and it acknowledged (tcpi_bytes_acked)."),
    "llamafleet_gate_link_received_bytes_total": (
        "counter", "Bytes llama-server received from the worker (tcpi_bytes_received)."),
    "llamafleet_gate_link_retransmits_total": ("counter", "Segments retransmitted to the worker (tcpi_total_retrans)."),
    "llamafleet_gate_link_unacked_bytes": (
        "gauge", "Bytes sent to the worker and not acknowledged yet (Send-Q less notsent)."),
    "llamafleet_gate_link_notsent_bytes": (
        "gauge", "Bytes llama-server wrote for the worker that are not sent yet (tcpi_notsent_bytes)."),
    "llamafleet_gate_link_stalled_polls": (
        "gauge", "Watchdog polls in a row the link has looked stalled (0: not stalled)."),
    "llamafleet_gate_link_stalls_total": (
        "counter", "Stalls of the link: its stalled polls reached the count the gate acts on."),
}
# The tcp_info figures of link_state.link_traffic: metric -> (key, scale).
LINK_TRAFFIC = {
    "llamafleet_gate_link_rtt_seconds": ("rtt_ms", 0.001),
    "llamafleet_gate_link_rttvar_seconds": ("rttvar_ms", 0.001),
    "llamafleet_gate_link_sent_bytes_total": ("sent_bytes", 1),
    "llamafleet_gate_link_received_bytes_total": ("received_bytes", 1),
    "llamafleet_gate_link_retransmits_total": ("retransmits", 1),
    "llamafleet_gate_link_unacked_bytes": ("unacked_bytes", 1),
    "llamafleet_gate_link_notsent_bytes": ("notsent_bytes", 1),
}


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as the text format writes it (integers without a fraction)."""
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return "%d" % number if number.is_integer() and abs(number) < 2 ** 53 else repr(number)


def render_exposition(metrics: Mapping[str, tuple[str, str]], samples: Sequence[Sample]) -> str:
    """Prometheus text exposition of ``samples``: each metric of ``metrics`` (name: (type, help)) that has
    samples, in that order, with its HELP and TYPE lines and its samples sorted by labels. A sample of a name
    not in ``metrics`` is a ValueError."""
    unknown = sorted({name for name, _labels, _value in samples} - set(metrics))
    if unknown:
        raise ValueError("unknown metric(s): %s" % ", ".join(unknown))
    lines = []
    for name, (kind, text) in metrics.items():
        rows = sorted((sorted(labels.items()), value) for metric, labels, value in samples if metric == name)
        if not rows:
            continue
        lines += ["# HELP %s %s" % (name, text.replace("\\", "\\\\").replace("\n", "\\n")),
                  "# TYPE %s %s" % (name, kind)]
        for labels, value in rows:
            label_text = ",".join('%s="%s"' % (key, _escape_label(str(val))) for key, val in labels)
            lines.append("%s%s %s" % (name, "{%s}" % label_text if label_text else "", format_value(value)))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class LoadClock:
    """What the gate knows of llama-server's model loads: the process it watches (``pid``, and when systemd
    started it, monotonic seconds), whether its load has ended, and the last load that did."""

    pid: int = 0
    started: float | None = None
    ready: bool = False
    last_seconds: float | None = None
    ready_at: float | None = None  # Unix time
    loads: int = 0


def track_load(clock: LoadClock, pid: int, started: float | None, health: int | str | None, now: float,
               wall: float) -> LoadClock:
    """One poll: a new ``pid`` begins a load (``started``: systemd's start of it, monotonic seconds; unknown:
    ``now``); its first /health 200 ends it, and the load took ``now - started``. ``pid`` 0 (not running)
    forgets the process, so a restart of the same pid number is a new load too."""
    if pid <= 0:
        return LoadClock(last_seconds=clock.last_seconds, ready_at=clock.ready_at, loads=clock.loads)
    if pid != clock.pid:
        clock = LoadClock(pid, started if started is not None else now, False, clock.last_seconds, clock.ready_at,
                          clock.loads)
    if health == 200 and not clock.ready:
        begun = clock.started if clock.started is not None else now
        return LoadClock(pid, clock.started, True, max(0.0, now - begun), wall, clock.loads + 1)
    return clock


def gate_samples(state: str, since: float, counters: Mapping[str, int], in_flight: int, restarts: int,
                 degraded: bool | None, load: LoadClock, budget: tuple[int, int, int] | None = None) -> list[Sample]:
    """The gate's metrics (:data:`GATE_METRICS`) from its state; ``degraded`` None: degraded mode is off;
    ``budget``: (capacity, reserved, waiting) of its KV budget, None without one."""
    samples: list[Sample] = [("llamafleet_gate_state", {"state": name}, 1 if name == state else 0) for name in STATES]
    samples += [("llamafleet_gate_state_since_seconds", {}, since),
                ("llamafleet_gate_requests_total", {}, counters.get("requests", 0)),
                ("llamafleet_gate_rejected_total", {}, counters.get("rejected_503", 0)),
                ("llamafleet_gate_aborted_total", {}, counters.get("aborted", 0)),
                ("llamafleet_gate_in_flight", {}, in_flight),
                ("llamafleet_gate_restarts_total", {}, restarts),
                ("llamafleet_llama_server_loads_total", {}, load.loads)]
    if degraded is not None:
        samples.append(("llamafleet_gate_degraded", {}, 1 if degraded else 0))
    if budget is not None:
        names = ("llamafleet_gate_kv_budget_tokens", "llamafleet_gate_kv_reserved_tokens", "llamafleet_gate_kv_waiting")
        samples += [(name, {}, value) for name, value in zip(names, budget)]
    if load.last_seconds is not None:
        samples.append(("llamafleet_llama_server_load_seconds", {}, round(load.last_seconds, 3)))
    if load.ready_at is not None:
        samples.append(("llamafleet_llama_server_ready_since_seconds", {}, round(load.ready_at, 3)))
    return samples


def link_samples(links: Mapping[str, Mapping[str, Any]] | None, stall_polls: Mapping[str, int],
                 stalls: Mapping[str, int]) -> list[Sample]:
    """The worker links' metrics, one series per worker (label ``worker``): ``links`` as link_state.worker_links
    gives them (None: ss gave no answer, and only the stall counters are known), ``stall_polls`` by link name
    (link_state.count_stalls), ``stalls`` by worker label (link_state.count_stall_events)."""
    samples: list[Sample] = [("llamafleet_gate_link_stalls_total", {"worker": worker}, count)
                             for worker, count in stalls.items()]
    for name, info in (links or {}).items():
        label = {"worker": info["worker"]}
        traffic = info["traffic"]
        samples += [("llamafleet_gate_link_connected", label, 1 if traffic else 0),
                    ("llamafleet_gate_link_stalled_polls", label, stall_polls.get(name, 0))]
        if traffic is None:
            continue  # lost: no tcp_info to show
        for metric, (key, scale) in LINK_TRAFFIC.items():
            if traffic[key] is not None:
                samples.append((metric, label, traffic[key] if scale == 1 else round(traffic[key] * scale, 6)))
    return samples


def bearer_ok(req: RequestHead, key: str | None) -> bool:
    """True when no key is set, or ``req`` carries ``Authorization: Bearer <key>`` (compared in constant time)."""
    if not key:
        return True
    expected = ("Bearer %s" % key).encode("utf-8")
    return any(hmac.compare_digest(value.strip().encode("utf-8"), expected) for value in req.get("authorization"))


def metrics_response(req: RequestHead, key: str | None, text: str, key_required: bool) -> bytes:
    """The answer to ``GET``/``HEAD`` :data:`GATE_METRICS_PATH`: 401 without the API key (when one is set),
    else ``text`` as Prometheus text format. Fails closed: with ``key_required`` (the config names an
    api_key_file) but no ``key`` (the file missing, unreadable or empty), 503 and never the metrics."""
    if key_required and not key:
        return error_response(503, "the gate's metrics are closed: its API key file is missing, unreadable or empty",
                              body=req.method != "HEAD")
    if not bearer_ok(req, key):
        return error_response(401, "the gate's metrics need the API key (Authorization: Bearer)",
                              body=req.method != "HEAD")
    payload = text.encode("utf-8")
    head = ["HTTP/1.1 200 OK", "Content-Type: text/plain; version=0.0.4; charset=utf-8",
            "Content-Length: %d" % len(payload), "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (payload if req.method != "HEAD" else b"")
