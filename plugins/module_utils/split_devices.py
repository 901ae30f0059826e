# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The model's devices in llama.cpp's order, what each can hold, and the orchestrator election.

Read from llama.cpp commit 0c1e570:

* Device order (src/llama.cpp, ``llama_prepare_model_devices``): every RPC
  device first, in ``--rpc`` endpoint order and, within an endpoint, in the
  order that rpc-server serves its devices; then the local discrete GPUs;
  local integrated GPUs only when there is no discrete one. The CPU is never
  in the list. ``--tensor-split`` and ``--device`` index this list.
* Names (ggml/src/ggml-rpc/ggml-rpc.cpp): RPC devices are ``RPC0``, ``RPC1``
  ... counted over all endpoints (``--device`` uses these names); their buffers
  are named ``RPC<index on that server>[<endpoint>]``, which is what the load
  log prints. Local devices are ``CUDA0``, ``ROCm0``, ``Vulkan0``, ``MTL0`` ...
* At most 15 devices (GGML_SCHED_MAX_BACKENDS is 16 including the CPU, and
  ``-ts`` refuses 16 values): ``constants.MAX_DEVICES``.

Stdlib only.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from .constants import MAX_DEVICES, RPC_SERVER_PORT
from .gpu_devices import GGML_PREFIX, usable_mib
from .split_units import MIB, PlanError

# The compute margin: memory kept free on every device that holds units, for the
# compute buffer llama.cpp's scheduler reserves there (one ubatch, 512 tokens by
# default), MiB. This is the one place the value is decided; the rpc_plan module
# and the llama_server role default to it (a unit test checks they agree).
# Measured on llama.cpp 0c1e570 (tests/unit/fixtures/llamacpp/*lv4*, *lv5*): gemma-3-270m
# on CPU rpc-servers reserves 25.5 to 41.6 MiB per device (2.0 MiB on a device that
# holds only the output layer) and 14 to 26 MiB on the orchestrator's CPU. The buffer
# grows with n_ubatch x n_embd, with the vocabulary on the device that holds the
# output layer and, without flash attention, with n_ubatch x context x heads; for
# 70B-class models it is a few hundred MiB. 512 MiB covers those with room and costs
# a few percent of an 8 GiB or larger device; give ``compute_mib`` (per plan, or per
# device dict) to tighten it for small devices or widen it for large ubatches.
DEFAULT_COMPUTE_MIB = 512

# Nominal memory bandwidth, GB/s, of a device whose dict gives no ``bandwidth_gbs``.
# Only ratios between devices matter to the cost estimate (split_policies); with no
# figures given every device counts as equally fast.
DEFAULT_BANDWIDTH_GBS = 50.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def worker_endpoint(worker: Mapping[str, Any], position: int) -> str:
    """``address:port`` of a worker (address defaults to the host, port to rpc-server's); PlanError if invalid."""
    host = worker.get("host")
    if not host:
        raise PlanError("workers[%d] has no 'host'" % position)
    address = worker.get("address") or host
    port = worker.get("port") or RPC_SERVER_PORT
    if isinstance(port, str) and port.strip().isdigit():
        port = int(port)
    if not _is_int(port) or not 0 < port < 65536:
        raise PlanError("worker %s: port %r is not a TCP port" % (host, port))
    if ":" in str(address):
        raise PlanError("worker %s: address %r is not an IPv4 address or host name "
                        "(rpc-server binds numeric IPv4 only)" % (host, address))
    return "%s:%d" % (address, port)


def _rpc_devices(workers: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    devices: list[dict[str, Any]] = []
    seen_endpoints: dict[str, str] = {}
    for position, worker in enumerate(workers):
        endpoint = worker_endpoint(worker, position)
        host = str(worker["host"])
        if endpoint in seen_endpoints:
            raise PlanError("workers %s and %s both use endpoint %s; llama.cpp would connect once and the "
                            "split would no longer match its devices" % (seen_endpoints[endpoint], host, endpoint))
        seen_endpoints[endpoint] = host
        served = list(worker.get("devices") or [])
        if not served:
            raise PlanError("worker %s (%s) exposes no devices: give its rpc-server devices "
                            "(gpu_facts rpc_devices) in workers[%d].devices" % (host, endpoint, position))
        for local_index, dev in enumerate(served):
            devices.append({
                "position": len(devices),
                "name": "RPC%d" % len(devices),
                "buffer_name": "RPC%d[%s]" % (local_index, endpoint),
                "host": host,
                "endpoint": endpoint,
                "worker": position,
                "local": False,
                "backend": dev.get("backend", "other"),
                "description": dev.get("name") or dev.get("ggml_name") or "device %d" % local_index,
                "device": dev,
            })
    return devices, seen_endpoints


def _local_devices(orchestrator: Mapping[str, Any], worker_hosts: Iterable[str], first: int) -> list[dict[str, Any]]:
    host = str(orchestrator.get("host") or "orchestrator")
    gpus = [d for d in (orchestrator.get("devices") or []) if d.get("backend") != "cpu"]
    backends = sorted({d.get("backend") for d in gpus})
    if len(backends) > 1:
        raise PlanError("orchestrator %s lists GPUs of several backends (%s); give only the devices of "
                        "llama-server's build backend (llama.cpp drops duplicates it cannot be told about)"
                        % (host, ", ".join(str(b) for b in backends)))
    if gpus and host in worker_hosts:
        raise PlanError("host %s is both a worker and the orchestrator with local GPUs: its GPUs would be "
                        "used twice; remove it from the workers" % host)
    discrete = [d for d in gpus if not d.get("integrated")]
    chosen = discrete if discrete else [d for d in gpus if d.get("integrated")]
    devices = []
    for dev in sorted(chosen, key=lambda d: int(d.get("index", 0))):
        backend = str(dev.get("backend"))
        name = dev.get("ggml_name") or ("%s%d" % (GGML_PREFIX.get(backend, backend.upper()), int(dev.get("index", 0))))
        devices.append({
            "position": first + len(devices),
            "name": name,
            "buffer_name": name,
            "host": host,
            "endpoint": None,
            "worker": None,
            "local": True,
            "backend": backend,
            "description": dev.get("name") or name,
            "device": dev,
        })
    return devices


def model_devices(workers: Sequence[Mapping[str, Any]],
                  orchestrator: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The model's device list, in the order llama.cpp builds it, before any sizing.

    Each entry: ``position``, ``name`` (``RPC0`` / ``CUDA0``), ``buffer_name``
    (as the load log prints it), ``host``, ``endpoint`` (None for local),
    ``worker`` (index in ``workers``, None for local), ``local``, ``backend``,
    ``description`` and ``device`` (the input dict).
    """
    devices, seen_endpoints = _rpc_devices(workers)
    if orchestrator:
        devices += _local_devices(orchestrator, seen_endpoints.values(), len(devices))
    return devices


def check_device_count(devices: Sequence[Mapping[str, Any]]) -> None:
    """PlanError when there are no devices, or more than one llama-server can address."""
    if not devices:
        raise PlanError("no devices to place the model on: add workers (rpc-server hosts) or give the "
                        "orchestrator's GPUs")
    if len(devices) > MAX_DEVICES:
        raise PlanError("%d devices (%s); one llama-server can use at most %d GPU and RPC devices "
                        "(GGML_SCHED_MAX_BACKENDS = 16 including the CPU): split the fleet into clusters"
                        % (len(devices), describe_devices(devices), MAX_DEVICES))


def rtt_ms(worker: Mapping[str, Any], default: float | None) -> float | None:
    """The measured round trip to a worker, ms: its own ``rtt_ms``, else ``default``; PlanError if invalid."""
    value = worker.get("rtt_ms", default)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if not _is_number(value) or value < 0:
        raise PlanError("worker %s: rtt_ms is %r, expected a round trip in ms (a number >= 0)"
                        % (worker.get("host"), value))
    return float(value)


def size_devices(devices: Sequence[dict[str, Any]], workers: Sequence[Mapping[str, Any]],
                 compute_mib: int, link_rtt_ms: float | None = None) -> None:
    """Add what each device can hold and what reaching it costs, in place.

    ``free_mib``; ``usable_mib`` (free, or total, minus ``reserve_mib``, capped by
    ``max_mib``); ``compute_mib`` (the device dict's own margin, else the plan's);
    ``capacity`` (bytes the units may take: usable minus the margin); ``rtt_ms``
    (0 for local GPUs; for RPC devices the worker's ``rtt_ms``, else
    ``link_rtt_ms``, else None: not measured); ``bandwidth_gbs`` (the device
    dict's, else :data:`DEFAULT_BANDWIDTH_GBS`).
    """
    for dev in devices:
        raw = dev["device"]
        dev["free_mib"] = raw.get("free_mib") if raw.get("free_mib") is not None else raw.get("total_mib")
        dev["usable_mib"] = usable_mib(raw)
        margin = raw.get("compute_mib", compute_mib)
        if not _is_int(margin) or margin < 0:
            raise PlanError("%s: compute_mib is %r, expected a non-negative integer (MiB)" % (label(dev), margin))
        dev["compute_mib"] = margin
        dev["capacity"] = (dev["usable_mib"] - margin) * MIB
        dev["rtt_ms"] = 0.0 if dev["local"] else rtt_ms(workers[dev["worker"]], link_rtt_ms)
        bandwidth = raw.get("bandwidth_gbs", DEFAULT_BANDWIDTH_GBS)
        if not _is_number(bandwidth) or bandwidth <= 0:
            raise PlanError("%s: bandwidth_gbs is %r, expected a positive number (GB/s)" % (label(dev), bandwidth))
        dev["bandwidth_gbs"] = float(bandwidth)


def check_capacity(dev: Mapping[str, Any]) -> None:
    """PlanError when a device has no room for any unit once its compute margin is kept."""
    if dev["usable_mib"] <= 0:
        raise PlanError("%s has no usable memory (free %s MiB, reserve %s MiB, max %s MiB): fix its "
                        "figures or overrides, or remove it from the workers"
                        % (label(dev), dev["free_mib"], dev["device"].get("reserve_mib", 0),
                           dev["device"].get("max_mib")))
    if dev["capacity"] <= 0:
        raise PlanError("%s has %d MiB usable, not more than its compute margin of %d MiB: give it more "
                        "memory, lower compute_mib, or remove it from the workers"
                        % (label(dev), dev["usable_mib"], dev["compute_mib"]))


def describe_devices(devices: Iterable[Mapping[str, Any]]) -> str:
    """``RPC0 lab2:50052, RPC1 lab3:50052, CUDA0 (local)`` for error messages."""
    parts = []
    for dev in devices:
        where = dev["endpoint"] if dev.get("endpoint") else "%s local" % dev.get("host")
        parts.append("%s %s" % (dev["name"], where))
    return ", ".join(parts)


def label(dev: Mapping[str, Any]) -> str:
    """``RPC1 (host w2, 10.0.0.12:50052, cuda GPU 0)``: a device named for messages."""
    where = dev["endpoint"] if dev.get("endpoint") else "local"
    return "%s (host %s, %s, %s)" % (dev["name"], dev["host"], where, dev["description"])


# ---------------------------------------------------------------------------
# Orchestrator election
# ---------------------------------------------------------------------------

def gpu_memory_mib(devices: Iterable[Mapping[str, Any]]) -> int:
    """Total GPU memory of a host's devices (CPU entries count 0)."""
    return sum(int(d.get("total_mib") or 0) for d in devices if d.get("backend") != "cpu")


def elect_orchestrator(hosts: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Mapping[str, Any]]],
                       pinned: str | None = None) -> str:
    """The host to run llama-server: the most total GPU memory, ties broken by host name.

    ``hosts`` is a list of ``{"host", "devices"}`` or a mapping host -> devices.
    ``pinned`` (the inventory's choice) wins when given, and must be one of the hosts.
    """
    if isinstance(hosts, Mapping):
        entries = [(str(h), list(d or [])) for h, d in hosts.items()]
    else:
        entries = []
        for position, entry in enumerate(hosts):
            if not entry.get("host"):
                raise PlanError("hosts[%d] has no 'host'" % position)
            entries.append((str(entry["host"]), list(entry.get("devices") or [])))
    if not entries:
        raise PlanError("no hosts to elect an orchestrator from")
    names = [entry[0] for entry in entries]
    if pinned:
        if pinned not in names:
            raise PlanError("the pinned orchestrator %s is not one of the hosts: %s" % (pinned, ", ".join(names)))
        return pinned
    return min(entries, key=lambda e: (-gpu_memory_mib(e[1]), e[0]))[0]
