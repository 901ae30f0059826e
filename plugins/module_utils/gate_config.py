# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The serving gate's configuration (``gate.json``, written by the llama_server role): its defaults, the
workers llama-server connects to, degraded mode, and the checks that name the offending key.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .host_observation import normalize_address


# Configuration defaults (seconds unless named otherwise).
DEFAULT_LISTEN_HOST = "0.0.0.0"
DEFAULT_UPSTREAM_HOST = "127.0.0.1"
DEFAULT_DEADLINE = 10.0
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_STALL_SECONDS = 4.0
# A stall answers clients 503 at once; llama-server is restarted only once it has lasted this long
# (a short blip heals by TCP's own retransmission, and a restart costs a model load).
DEFAULT_RESTART_AFTER = 30.0
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_CANARY_INTERVAL = 30.0
DEFAULT_CANARY_DEADLINE = 60.0
DEFAULT_RESTART_GRACE = 15.0
DEFAULT_MAX_CONNECTIONS = 256
# Degraded mode: seconds down before the gate serves without a lost worker, seconds between HELLO probes of
# the workers while it decides (or of the lost one while degraded), answers in a row that bring the full plan back.
DEFAULT_DEGRADE_AFTER = 45.0
DEFAULT_DEGRADE_PROBE_INTERVAL = 10.0
DEFAULT_RETURN_PROBES = 3
FULL_PLAN = "full"
PLAN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Worker:
    """One rpc-server endpoint llama-server connects to."""

    host: str
    address: str
    port: int


@dataclass(frozen=True)
class Degrade:
    """Degraded mode: ``plans`` maps each worker host to the name of the plan without it (None: the model does
    not fit without it, ``reasons`` says why). After ``after`` seconds down with one worker host not answering
    HELLO (``probe`` + ``--timeout S HOST:PORT``), the gate writes ``{"plan": NAME}`` to ``request_file``; once
    the host has answered ``return_probes`` probes in a row, ``{"plan": "full"}``."""

    plans: dict[str, str | None]
    reasons: dict[str, str]
    request_file: str
    probe: tuple[str, ...]
    after: float = DEFAULT_DEGRADE_AFTER
    probe_interval: float = DEFAULT_DEGRADE_PROBE_INTERVAL
    return_probes: int = DEFAULT_RETURN_PROBES


@dataclass(frozen=True)
class Config:
    """The gate's validated configuration (see load_config)."""

    listen_port: int
    upstream_port: int
    unit: str
    workers: tuple[Worker, ...]
    listen_host: str = DEFAULT_LISTEN_HOST
    upstream_host: str = DEFAULT_UPSTREAM_HOST
    api_key_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    deadline: float = DEFAULT_DEADLINE
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    stall_seconds: float = DEFAULT_STALL_SECONDS
    restart_after: float = DEFAULT_RESTART_AFTER
    poll_interval: float = DEFAULT_POLL_INTERVAL
    canary_interval: float = DEFAULT_CANARY_INTERVAL
    canary_deadline: float = DEFAULT_CANARY_DEADLINE
    restart_grace: float = DEFAULT_RESTART_GRACE
    # where the gate writes its state (JSON); none without one (the role names constants.GATE_STATE_PATH)
    state_file: str | None = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    degrade: Degrade | None = None
    # the KV cells llama-server's slots share (--kv-unified with more than one slot): the gate admits generations
    # whose tokens fit together (gate_budget.py); 0: no shared cache to guard
    kv_budget: int = 0
    # llama-server's -n, the bound of a generation that gives none; 0: none
    default_max_tokens: int = 0


_NUMBER_KEYS = ("deadline", "request_timeout", "stall_seconds", "restart_after", "poll_interval", "canary_interval", "canary_deadline",
                "restart_grace")
_OPTIONAL_PATH_KEYS = ("api_key_file", "tls_cert", "tls_key")
_TOKEN_KEYS = ("kv_budget", "default_max_tokens")
_KNOWN_KEYS = frozenset(("listen_host", "listen_port", "upstream_host", "upstream_port", "unit", "workers",
                         "state_file", "max_connections", "degrade") + _NUMBER_KEYS + _OPTIONAL_PATH_KEYS + _TOKEN_KEYS)


def _port(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError("gate config: %s must be a port number (1-65535), got %r" % (key, value))
    return value


def _text(raw: dict[str, Any], key: str, default: str | None) -> str | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("gate config: %s must be a non-empty string, got %r" % (key, value))
    return value


def _seconds(raw: dict[str, Any], keys: tuple[str, ...], defaults: type, prefix: str = "") -> dict[str, float]:
    """``keys`` of ``raw`` as seconds > 0 (missing: the dataclass ``defaults``' own value)."""
    numbers = {}
    for key in keys:
        value = raw.get(key, getattr(defaults, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError("gate config: %s%s must be a number of seconds > 0, got %r" % (prefix, key, value))
        numbers[key] = float(value)
    return numbers


def _count(raw: dict[str, Any], key: str, default: int, prefix: str = "") -> int:
    """``key`` of ``raw`` as an integer >= 1 (missing: ``default``)."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("gate config: %s%s must be an integer >= 1, got %r" % (prefix, key, value))
    return value


def _tokens(raw: dict[str, Any], key: str) -> int:
    """``key`` of ``raw`` as a number of tokens >= 0 (missing: 0)."""
    value = raw.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("gate config: %s must be a number of tokens >= 0, got %r" % (key, value))
    return value


def plan_workers(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gate config's ``workers`` from a split plan's devices: each remote RPC endpoint once, in the
    plan's order, as {host, address, port} (``[v6]:port`` endpoints unbracketed)."""
    workers: list[dict[str, Any]] = []
    for device in devices:
        endpoint = device.get("endpoint")
        if device.get("local") or not endpoint or any(w["endpoint"] == endpoint for w in workers):
            continue
        address, _sep, port = endpoint.rpartition(":")
        workers.append({"host": device["host"], "endpoint": endpoint, "address": address.strip("[]"),
                        "port": int(port)})
    return workers


def degrade_plans(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The gate config's ``degrade`` plans and reasons from rpc_plan's ``degraded`` entries: each worker host ->
    the name of the plan without it, or None when the model does not fit without it."""
    return {"plans": {entry["without"]: entry["name"] if entry["fits"] else None for entry in entries},
            "reasons": {entry["without"]: entry["reason"] for entry in entries}}


def _workers(value: Any) -> tuple[Worker, ...]:
    if not isinstance(value, list):
        raise ValueError("gate config: workers must be a list of {host, address, port}, got %r" % (value,))
    workers = []
    for index, item in enumerate(value):
        where = "workers[%d]" % index
        if not isinstance(item, dict):
            raise ValueError("gate config: %s must be a mapping with host, address and port" % where)
        for key in ("host", "address"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise ValueError("gate config: %s.%s must be a non-empty string, got %r" % (where, key, item.get(key)))
        port = item.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError("gate config: %s.port must be a port number (1-65535), got %r" % (where, port))
        workers.append(Worker(item["host"], normalize_address(item["address"]), port))
    return tuple(workers)


def _degrade(value: Any, hosts: list[str]) -> Degrade | None:
    """``degrade``: null (off) or {plans: {host: name|null}, reasons: {host: text}, request_file, probe: [argv],
    after, probe_interval, return_probes}; every worker host needs an entry in plans (a host that holds no
    layer in the full plan may have one too)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("gate config: degrade must be null or a mapping, got %r" % (value,))
    unknown = sorted(set(value) - {"plans", "reasons", "request_file", "probe", "after", "probe_interval",
                                   "return_probes"})
    if unknown:
        raise ValueError("gate config: unknown key degrade.%s" % ", degrade.".join(unknown))
    plans = value.get("plans")
    if not isinstance(plans, dict) or not set(hosts) <= set(plans):
        raise ValueError("gate config: degrade.plans must name a plan (or null) for each worker host (%s), got %r"
                         % (", ".join(sorted(set(hosts))), plans))
    for host, name in plans.items():
        if name is not None and (not isinstance(name, str) or not PLAN_NAME.match(name) or name == FULL_PLAN):
            raise ValueError("gate config: degrade.plans.%s must be a plan file name or null, got %r" % (host, name))
    reasons = value.get("reasons", {})
    if not isinstance(reasons, dict) or not all(isinstance(text, str) for text in reasons.values()):
        raise ValueError("gate config: degrade.reasons must map hosts to text, got %r" % (reasons,))
    probe = value.get("probe")
    if not isinstance(probe, list) or not probe or not all(isinstance(word, str) and word for word in probe):
        raise ValueError("gate config: degrade.probe must be a command (a list of words), got %r" % (probe,))
    numbers = _seconds(value, ("after", "probe_interval"), Degrade, "degrade.")
    return_probes = _count(value, "return_probes", DEFAULT_RETURN_PROBES, "degrade.")
    request_file = _text(value, "request_file", None)
    if request_file is None:
        raise ValueError("gate config: degrade.request_file is required")
    return Degrade(dict(plans), dict(reasons), request_file, tuple(probe), return_probes=return_probes, **numbers)


def load_config(raw: dict[str, Any]) -> Config:
    """Validate the decoded JSON config; a ValueError names the offending key."""
    if not isinstance(raw, dict):
        raise ValueError("gate config: expected a JSON object")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise ValueError("gate config: unknown key %s" % ", ".join(unknown))
    for key in ("listen_port", "upstream_port", "unit", "workers"):
        if key not in raw:
            raise ValueError("gate config: %s is required" % key)
    numbers = _seconds(raw, _NUMBER_KEYS, Config)
    max_connections = _count(raw, "max_connections", DEFAULT_MAX_CONNECTIONS)
    # an empty path means none (the role writes every key)
    paths = {key: _text(raw, key, None) if raw.get(key) != "" else None for key in _OPTIONAL_PATH_KEYS}
    if (paths["tls_cert"] is None) != (paths["tls_key"] is None):
        raise ValueError("gate config: tls_cert and tls_key go together (%s is missing)"
                         % ("tls_key" if paths["tls_key"] is None else "tls_cert"))
    workers = _workers(raw["workers"])
    return Config(
        listen_port=_port(raw, "listen_port"), upstream_port=_port(raw, "upstream_port"),
        unit=str(_text(raw, "unit", None)), workers=workers,
        degrade=_degrade(raw.get("degrade"), [worker.host for worker in workers]),
        listen_host=str(_text(raw, "listen_host", DEFAULT_LISTEN_HOST)),
        upstream_host=str(_text(raw, "upstream_host", DEFAULT_UPSTREAM_HOST)),
        state_file=_text(raw, "state_file", None), max_connections=max_connections,
        **{key: _tokens(raw, key) for key in _TOKEN_KEYS}, **paths, **numbers)
