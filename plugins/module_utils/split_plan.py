# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Plan how llama-server splits a model's layers over RPC workers and local GPUs.

What llama.cpp does, and what this module therefore reproduces (read from
llama.cpp commit 0c1e570):

* Device order (src/llama.cpp, ``llama_prepare_model_devices``): every RPC
  device first, in ``--rpc`` endpoint order and, within an endpoint, in the
  order that rpc-server serves its devices; then the local discrete GPUs;
  local integrated GPUs only when there is no discrete one. The CPU is never
  in the list. ``--tensor-split`` and ``--device`` index this list.
* Names (ggml/src/ggml-rpc/ggml-rpc.cpp): RPC devices are ``RPC0``, ``RPC1``
  ... counted over all endpoints (``--device`` uses these names); their buffers
  are named ``RPC<index on that server>[<endpoint>]``, which is what the load
  log prints. Local devices are ``CUDA0``, ``ROCm0``, ``Vulkan0``, ``MTL0`` ...
* Layers (src/llama-model.cpp, ``load_tensors``): the repeating layers and the
  output layer form ``n_layer + 1`` units; the ``-ts`` values become float32
  cumulative fractions and unit ``i`` goes to the first device whose fraction
  is greater than ``i / (n_layer + 1)``. The output layer is therefore last, on
  the last device that receives any unit. The input embedding stays on the CPU
  of the orchestrator. :func:`layers_from_split` is that computation.
* At most 15 devices (GGML_SCHED_MAX_BACKENDS is 16 including the CPU, and
  ``-ts`` refuses 16 values).

The planner gives each device a share of the model proportional to its usable
memory (free minus reserve, capped by ``max_mib``, minus a compute margin),
never more than the device can hold, and emits ``tensor_split`` as the integer
unit counts, which llama.cpp maps back to exactly those layer ranges.

Stdlib only; shared by the Ansible modules and ``llamafleet.core.split_plan``.
"""

from __future__ import annotations

import bisect
import math
import struct
from typing import Any, Iterable, Mapping, Sequence

from .gpu_parsers import GGML_PREFIX, usable_mib

MIB = 1024 * 1024
GIB = 1024 * MIB

# GGML_SCHED_MAX_BACKENDS is 16 and the CPU backend always takes one slot;
# llama_max_devices() is 16 and "-ts" refuses 16 or more values.
MAX_DEVICES = 15

# Compute-buffer margin per device, MiB. The scheduler reserves a compute
# buffer on every device for a ubatch (512 tokens by default); measured on
# llama.cpp 0c1e570 it is tens of MiB for small models and a few hundred MiB
# for 70B-class models with flash attention. 512 MiB covers those with room;
# give ``compute_mib`` (per plan, or per device dict) to tighten or widen it.
DEFAULT_COMPUTE_MIB = 512

DEFAULT_N_UBATCH = 512
KV_PAD = 256  # llama_context pads n_ctx (and n_ctx_seq) to a multiple of 256

# KV cache element types llama-server accepts for -ctk/-ctv: (elements per block, bytes per block).
KV_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}


class PlanError(ValueError):
    """The fleet, the model and the options do not make a plan; the message says what to change."""


# ---------------------------------------------------------------------------
# llama.cpp's -ts -> layer mapping
# ---------------------------------------------------------------------------

def _f32(value: float) -> float:
    """Round to IEEE single precision, as llama.cpp's ``float`` arithmetic does."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def assign_layers(split: Sequence[float], n_layer: int, n_gpu_layers: int | None = None) -> list[int]:
    """The device index of each of the ``n_layer + 1`` units under ``-ts split``, as llama.cpp decides.

    Mirrors ``llama_model_base::load_tensors`` (src/llama-model.cpp): the split
    values are summed in float32 into cumulative fractions, and unit ``il`` goes
    to ``upper_bound(fractions, float(il - i_gpu_start) / act_gpu_layers)``.
    Units that stay on the CPU (fewer ``n_gpu_layers`` than units) get ``-1``.
    An all-zero split means "by free memory" in llama.cpp, which depends on the
    devices at load time and is refused here.
    """
    if n_layer <= 0:
        raise ValueError("n_layer must be positive, got %r" % (n_layer,))
    if not split:
        raise ValueError("split is empty")
    if any(v < 0 or math.isnan(v) for v in split):
        raise ValueError("split has negative values: %r" % (list(split),))
    if all(v == 0 for v in split):
        raise ValueError("an all-zero split makes llama.cpp split by free memory at load time")
    units = n_layer + 1
    ngl = units if n_gpu_layers is None or n_gpu_layers < 0 else n_gpu_layers
    i_gpu_start = max(units - ngl, 0)
    act_gpu_layers = min(ngl, units)

    cumulative: list[float] = []
    total = _f32(0.0)
    for value in split:
        total = _f32(total + _f32(float(value)))
        cumulative.append(total)
    fractions = [_f32(c / total) for c in cumulative]

    result = []
    for il in range(units):
        if il < i_gpu_start or il - i_gpu_start >= act_gpu_layers:
            result.append(-1)
            continue
        x = _f32(_f32(float(il - i_gpu_start)) / _f32(float(act_gpu_layers)))
        result.append(bisect.bisect_right(fractions, x))
    return result


def layers_from_split(split: Sequence[float], n_layer: int, n_gpu_layers: int | None = None) -> list[int]:
    """How many of the ``n_layer + 1`` units (layers plus output) llama.cpp puts on each device for ``-ts split``.

    >>> layers_from_split([3, 1], 31)
    [24, 8]
    """
    counts = [0] * len(split)
    for device in assign_layers(split, n_layer, n_gpu_layers):
        if device >= 0:
            counts[device] += 1
    return counts


# ---------------------------------------------------------------------------
# Model and context sizing
# ---------------------------------------------------------------------------

def _pad(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def kv_cells(ctx_size: int, n_parallel: int, kv_unified: bool = False) -> int:
    """KV cells llama-server allocates for ``-c ctx_size -np n_parallel`` (src/llama-context.cpp)."""
    n_ctx = _pad(ctx_size, KV_PAD)
    if kv_unified or n_parallel <= 1:
        return n_ctx
    n_ctx_seq = _pad(n_ctx // n_parallel, KV_PAD)
    return n_ctx_seq * n_parallel


def _swa_layers(facts: Mapping[str, Any], n_layer: int) -> list[bool] | None:
    """Which layers use sliding-window attention, or None when the facts do not say."""
    window = facts.get("sliding_window")
    if not isinstance(window, Mapping) or not window.get("n_swa"):
        return None
    pattern = window.get("pattern")
    if isinstance(pattern, bool):
        return None
    if isinstance(pattern, int) and pattern > 0:
        # llama_hparams::set_swa_pattern(n_pattern): every n_pattern-th layer is dense.
        return [il % pattern < pattern - 1 for il in range(n_layer)]
    if isinstance(pattern, list) and len(pattern) == n_layer and all(isinstance(p, bool) for p in pattern):
        return list(pattern)
    return None


def _per_layer_width(facts: Mapping[str, Any], key: str, n_layer: int) -> list[int]:
    value = facts.get(key)
    if isinstance(value, list):
        if len(value) != n_layer:
            raise PlanError("model facts %s has %d values, expected n_layer = %d" % (key, len(value), n_layer))
        return [int(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n_layer
    per_token = facts.get("kv_bytes_per_token_f16")
    if isinstance(per_token, int) and per_token > 0:
        return [per_token // n_layer // 4] * n_layer  # half K, half V, 2 bytes each
    raise PlanError("model facts lack %s and kv_bytes_per_token_f16: cannot size the KV cache" % key)


def _kv_type(name: str, option: str) -> tuple[int, int]:
    try:
        return KV_TYPES[name.lower()]
    except (KeyError, AttributeError):
        raise PlanError("%s is %r; llama-server accepts %s" % (option, name, ", ".join(KV_TYPES))) from None


def kv_bytes_per_layer(facts: Mapping[str, Any], ctx_size: int, n_parallel: int = 1,
                       cache_type_k: str = "f16", cache_type_v: str | None = None,
                       kv_unified: bool = False, n_ubatch: int = DEFAULT_N_UBATCH,
                       swa: bool = True) -> list[int]:
    """Bytes of K and V cache for each layer at this context.

    Layers with sliding-window attention (when the facts give the window and
    pattern, and ``swa`` is true) hold ``min(context, n_swa + n_ubatch)`` cells
    per sequence, as llama_kv_cache_iswa sizes them; other layers hold every cell.
    """
    n_layer = int(facts["n_layer"])
    k_widths = _per_layer_width(facts, "n_embd_k_gqa", n_layer)
    v_widths = _per_layer_width(facts, "n_embd_v_gqa", n_layer)
    k_blk, k_bytes = _kv_type(cache_type_k, "cache_type_k")
    v_blk, v_bytes = _kv_type(cache_type_v or cache_type_k, "cache_type_v")
    cells = kv_cells(ctx_size, n_parallel, kv_unified)
    swa_layers = _swa_layers(facts, n_layer) if swa else None
    swa_cells = cells
    if swa_layers is not None:
        n_swa = int(facts["sliding_window"]["n_swa"])
        streams = 1 if kv_unified else max(n_parallel, 1)
        size_base = cells // streams
        per_stream = _pad(min(size_base, n_swa * (max(n_parallel, 1) if kv_unified else 1) + n_ubatch), KV_PAD)
        swa_cells = min(per_stream, size_base) * streams
    result = []
    for il in range(n_layer):
        layer_cells = swa_cells if swa_layers is not None and swa_layers[il] else cells
        k = k_widths[il] * layer_cells // k_blk * k_bytes
        v = v_widths[il] * layer_cells // v_blk * v_bytes
        result.append(k + v)
    return result


def _check_facts(facts: Mapping[str, Any]) -> int:
    for key in ("n_layer", "layer_bytes", "output_bytes"):
        if key not in facts:
            raise PlanError("model facts lack %r (use gguf.model_facts on the model file)" % key)
    n_layer = facts["n_layer"]
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer <= 0:
        raise PlanError("model facts n_layer is %r, expected a positive integer" % (n_layer,))
    if len(facts["layer_bytes"]) != n_layer:
        raise PlanError("model facts layer_bytes has %d values, expected n_layer = %d"
                        % (len(facts["layer_bytes"]), n_layer))
    return n_layer


# ---------------------------------------------------------------------------
# Devices in llama.cpp's order
# ---------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def model_devices(workers: Sequence[Mapping[str, Any]],
                  orchestrator: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The model's device list, in the order llama.cpp builds it, before any sizing.

    Each entry: ``position``, ``name`` (``RPC0`` / ``CUDA0``), ``buffer_name``
    (as the load log prints it), ``host``, ``endpoint`` (None for local),
    ``local``, ``backend``, ``description`` and ``device`` (the input dict).
    """
    devices: list[dict[str, Any]] = []
    seen_endpoints: dict[str, str] = {}
    rpc_count = 0
    for position, worker in enumerate(workers):
        host = worker.get("host")
        if not host:
            raise PlanError("workers[%d] has no 'host'" % position)
        address = worker.get("address") or host
        port = worker.get("port") or 50052
        if isinstance(port, str) and port.strip().isdigit():
            port = int(port)
        if not _is_int(port) or not 0 < port < 65536:
            raise PlanError("worker %s: port %r is not a TCP port" % (host, port))
        if ":" in str(address):
            raise PlanError("worker %s: address %r is not an IPv4 address or host name "
                            "(rpc-server binds numeric IPv4 only)" % (host, address))
        endpoint = "%s:%d" % (address, port)
        if endpoint in seen_endpoints:
            raise PlanError("workers %s and %s both use endpoint %s; llama.cpp would connect once and the "
                            "split would no longer match its devices" % (seen_endpoints[endpoint], host, endpoint))
        seen_endpoints[endpoint] = str(host)
        served = list(worker.get("devices") or [])
        if not served:
            raise PlanError("worker %s (%s) exposes no devices: give its rpc-server devices "
                            "(gpu_facts rpc_devices) in workers[%d].devices" % (host, endpoint, position))
        for local_index, dev in enumerate(served):
            devices.append({
                "position": len(devices),
                "name": "RPC%d" % rpc_count,
                "buffer_name": "RPC%d[%s]" % (local_index, endpoint),
                "host": str(host),
                "endpoint": endpoint,
                "local": False,
                "backend": dev.get("backend", "other"),
                "description": dev.get("name") or dev.get("ggml_name") or "device %d" % local_index,
                "device": dev,
            })
            rpc_count += 1

    if orchestrator:
        host = str(orchestrator.get("host") or "orchestrator")
        gpus = [d for d in (orchestrator.get("devices") or []) if d.get("backend") != "cpu"]
        backends = sorted({d.get("backend") for d in gpus})
        if len(backends) > 1:
            raise PlanError("orchestrator %s lists GPUs of several backends (%s); give only the devices of "
                            "llama-server's build backend (llama.cpp drops duplicates it cannot be told about)"
                            % (host, ", ".join(str(b) for b in backends)))
        if gpus and host in seen_endpoints.values():
            raise PlanError("host %s is both a worker and the orchestrator with local GPUs: its GPUs would be "
                            "used twice; remove it from the workers" % host)
        discrete = [d for d in gpus if not d.get("integrated")]
        chosen = discrete if discrete else [d for d in gpus if d.get("integrated")]
        for dev in sorted(chosen, key=lambda d: int(d.get("index", 0))):
            backend = str(dev.get("backend"))
            name = dev.get("ggml_name") or ("%s%d" % (GGML_PREFIX.get(backend, backend.upper()),
                                                      int(dev.get("index", 0))))
            devices.append({
                "position": len(devices),
                "name": name,
                "buffer_name": name,
                "host": host,
                "endpoint": None,
                "local": True,
                "backend": backend,
                "description": dev.get("name") or name,
                "device": dev,
            })
    return devices


def describe_devices(devices: Iterable[Mapping[str, Any]]) -> str:
    """``RPC0 lab2:50052, RPC1 lab3:50052, CUDA0 (local)`` for error messages."""
    parts = []
    for dev in devices:
        where = dev["endpoint"] if dev.get("endpoint") else "%s local" % dev.get("host")
        parts.append("%s %s" % (dev["name"], where))
    return ", ".join(parts)


def _label(dev: Mapping[str, Any]) -> str:
    where = dev["endpoint"] if dev.get("endpoint") else "local"
    return "%s (host %s, %s, %s)" % (dev["name"], dev["host"], where, dev["description"])


# ---------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------

def _prefix(costs: Sequence[int]) -> list[int]:
    out = [0]
    for cost in costs:
        out.append(out[-1] + cost)
    return out


def _min_starts(prefix: Sequence[int], capacities: Sequence[int]) -> list[int]:
    """``starts[i]``: the first unit from which devices i.. can hold every remaining unit (backward greedy).

    ``starts[n]`` is the number of units (nothing left for no devices). Taking
    as many trailing units as fit on each device, from the last one back, is
    optimal for contiguous placement in a fixed order.
    """
    units = len(prefix) - 1
    starts = [units] * (len(capacities) + 1)
    end = units
    for i in range(len(capacities) - 1, -1, -1):
        start = end
        while start > 0 and prefix[end] - prefix[start - 1] <= capacities[i]:
            start -= 1
        starts[i] = start
        end = start
    return starts


def _proportional_counts(costs: Sequence[int], capacities: Sequence[int]) -> list[int] | None:
    """Contiguous unit counts proportional to ``capacities``, none over its capacity; None if impossible.

    Device by device, the target is the device's capacity share of what is
    left, rounded to the nearest unit boundary, then clamped between what the
    device can hold and what the devices after it cannot: a device that cannot
    take its share keeps what fits and the rest is shared by those after it.
    """
    prefix = _prefix(costs)
    units = len(costs)
    starts = _min_starts(prefix, capacities)
    if starts[0] != 0:
        return None
    counts = []
    pos = 0
    for i, capacity in enumerate(capacities):
        if i == len(capacities) - 1:
            end = units
        else:
            remaining_capacity = sum(capacities[i:])
            share = (prefix[units] - prefix[pos]) * capacity / remaining_capacity if remaining_capacity else 0
            goal = prefix[pos] + share
            # the unit boundary nearest to the goal (a tie goes to the earlier boundary)
            end = bisect.bisect_left(prefix, goal, pos, units + 1)
            if end > units:
                end = units
            elif end > pos and goal - prefix[end - 1] <= prefix[end] - goal:
                end -= 1
            upper = pos
            while upper < units and prefix[upper + 1] - prefix[pos] <= capacity:
                upper += 1
            lower = max(starts[i + 1], pos)
            end = min(max(end, lower), upper)
        counts.append(end - pos)
        pos = end
    return counts


def plan_split(workers: Sequence[Mapping[str, Any]],
               orchestrator: Mapping[str, Any] | None,
               model: Mapping[str, Any],
               ctx_size: int = 0,
               n_parallel: int = 1,
               cache_type_k: str = "f16",
               cache_type_v: str | None = None,
               compute_mib: int = DEFAULT_COMPUTE_MIB,
               tensor_split: Sequence[float] | None = None,
               kv_unified: bool = False,
               n_ubatch: int = DEFAULT_N_UBATCH) -> dict[str, Any]:
    """Plan llama-server's ``--rpc``, device order and ``--tensor-split`` for a fleet.

    :param workers: rpc-server hosts in inventory (= ``--rpc``) order, each
        ``{"host", "address", "port", "devices": [device dicts as gpu_facts returns]}``.
    :param orchestrator: ``{"host", "devices": [...]}``, the llama-server host;
        its GPUs are used after the RPC devices; CPU entries are ignored.
    :param model: model facts (:func:`gguf.model_facts`).
    :param ctx_size: total context (``-c``); 0 means the model's training context.
    :param n_parallel: slots (``-np``); with a non-unified KV cache the context is
        rounded up per slot.
    :param cache_type_k: KV cache type for K (``-ctk``), ``cache_type_v`` for V
        (defaults to the K type).
    :param compute_mib: compute-buffer margin per device (a device dict's own
        ``compute_mib`` wins).
    :param tensor_split: manual ``-ts`` ratios, one per device in llama.cpp's
        order; the planner then only checks that they fit.
    :returns: the plan (see the module's RETURN documentation in rpc_plan).
    :raises PlanError: with a message that says what to change.
    """
    n_layer = _check_facts(model)
    if not _is_int(n_parallel) or n_parallel < 1:
        raise PlanError("n_parallel is %r, expected a positive integer (llama-server -np)" % (n_parallel,))
    if not _is_int(ctx_size) or ctx_size < 0:
        raise PlanError("ctx_size is %r, expected 0 (the model's context) or a positive integer" % (ctx_size,))
    if not _is_int(compute_mib) or compute_mib < 0:
        raise PlanError("compute_mib is %r, expected a non-negative integer (MiB)" % (compute_mib,))
    ctx = ctx_size or int(model.get("n_ctx_train") or 0)
    if ctx <= 0:
        raise PlanError("ctx_size is 0 and the model declares no training context: set ctx_size")

    devices = model_devices(workers, orchestrator)
    if not devices:
        raise PlanError("no devices to place the model on: add workers (rpc-server hosts) or give the "
                        "orchestrator's GPUs")
    if len(devices) > MAX_DEVICES:
        raise PlanError("%d devices (%s); one llama-server can use at most %d GPU and RPC devices "
                        "(GGML_SCHED_MAX_BACKENDS = 16 including the CPU): split the fleet into clusters"
                        % (len(devices), describe_devices(devices), MAX_DEVICES))

    kv = kv_bytes_per_layer(model, ctx, n_parallel, cache_type_k, cache_type_v, kv_unified, n_ubatch)
    layer_bytes = [int(b) for b in model["layer_bytes"]]
    costs = [layer_bytes[i] + kv[i] for i in range(n_layer)] + [int(model["output_bytes"])]
    units = n_layer + 1

    usable = []
    compute = []
    for dev in devices:
        raw = dev["device"]
        free = raw.get("free_mib") if raw.get("free_mib") is not None else raw.get("total_mib")
        dev["free_mib"] = free
        dev["usable_mib"] = usable_mib(raw)
        margin = raw.get("compute_mib", compute_mib)
        dev["compute_mib"] = int(margin)
        usable.append(dev["usable_mib"] * MIB)
        compute.append(int(margin) * MIB)

    manual = tensor_split is not None
    if manual:
        counts = _manual_counts(tensor_split, devices, n_layer)
    else:
        for dev, use, margin in zip(devices, usable, compute):
            if use <= 0:
                raise PlanError("%s has no usable memory (free %s MiB, reserve %s MiB, max %s MiB): fix its "
                                "figures or overrides, or remove it from the workers"
                                % (_label(dev), dev["free_mib"], dev["device"].get("reserve_mib", 0),
                                   dev["device"].get("max_mib")))
            if use <= margin:
                raise PlanError("%s has %d MiB usable, not more than its compute margin of %d MiB: give it more "
                                "memory, lower compute_mib, or remove it from the workers"
                                % (_label(dev), use // MIB, margin // MIB))
        capacities = [u - m for u, m in zip(usable, compute)]
        need = sum(costs) + sum(compute)
        have = sum(usable)
        if need > have:
            raise PlanError("the model at ctx_size %d needs %.1f GiB (weights %.1f, KV %.1f, compute %.1f), the "
                            "fleet has %.1f GiB free on %d devices: add hosts or lower the context (ctx_size)"
                            % (ctx, need / GIB, sum(layer_bytes + [int(model["output_bytes"])]) / GIB,
                               sum(kv) / GIB, sum(compute) / GIB, have / GIB, len(devices)))
        found = _proportional_counts(costs, capacities)
        if found is None:
            largest = max(costs)
            raise PlanError("the model at ctx_size %d needs %.1f GiB and the fleet has %.1f GiB free, but its "
                            "layers (up to %.0f MiB each, the output layer %.0f MiB on the last device) do not "
                            "pack into the devices in llama.cpp's order (%s): add hosts or lower the context "
                            "(ctx_size)" % (ctx, need / GIB, have / GIB, largest / MIB, costs[-1] / MIB,
                                            describe_devices(devices)))
        counts = found

    # llama.cpp must map the emitted split back to exactly these counts.
    reproduced = layers_from_split(counts, n_layer)
    if reproduced != counts:  # pragma: no cover - guards the invariant documented above
        raise AssertionError("tensor_split %r maps to %r in llama.cpp, not the planned counts" % (counts, reproduced))

    explanation: list[str] = []
    warnings: list[str] = []
    pos = 0
    out_devices = []
    for dev, count, use, margin in zip(devices, counts, usable, compute):
        weights = sum(layer_bytes[i] for i in range(pos, min(pos + count, n_layer)))
        has_output = count > 0 and pos + count == units
        if has_output:
            weights += int(model["output_bytes"])
        kv_dev = sum(kv[i] for i in range(pos, min(pos + count, n_layer)))
        margin_used = margin if count > 0 else 0
        total = weights + kv_dev + margin_used
        if manual and count > 0 and total > use:
            raise PlanError("tensor_split puts %d units (%.0f MiB with KV and compute margin) on %s, which has "
                            "%d MiB usable: lower its value, or leave tensor_split unset to let the planner split "
                            "by memory" % (count, total / MIB, _label(dev), use // MIB))
        layers = {
            "start": pos,
            "end": pos + count,
            "count": count,
            "output": has_output,
            "range": _range_text(pos, count, n_layer),
        }
        out_devices.append({
            "position": dev["position"],
            "name": dev["name"],
            "buffer_name": dev["buffer_name"],
            "host": dev["host"],
            "endpoint": dev["endpoint"],
            "local": dev["local"],
            "backend": dev["backend"],
            "description": dev["description"],
            "layers": layers,
            "weights_mib": _mib(weights),
            "kv_mib": _mib(kv_dev),
            "compute_mib": _mib(margin_used),
            "total_mib": _mib(total),
            "free_mib": dev["free_mib"],
            "usable_mib": use // MIB,
            "fill_pct": round(100.0 * total / use, 1) if use > 0 else None,
        })
        if count == 0:
            warnings.append("%s gets no layers; it still takes a connection and a backend slot: "
                            "remove it or give it more memory" % _label(dev))
        pos += count

    rpc = []
    for dev in devices:
        if dev["endpoint"] and dev["endpoint"] not in rpc:
            rpc.append(dev["endpoint"])
    host_bytes = int(model.get("token_embd_bytes") or 0) + int(model.get("other_bytes") or 0)
    totals = {
        "weights_mib": _mib(sum(layer_bytes) + int(model["output_bytes"])),
        "kv_mib": _mib(sum(kv)),
        "compute_mib": _mib(sum(compute[i] for i, c in enumerate(counts) if c > 0)),
        "usable_mib": sum(u for u in usable) // MIB,
    }
    totals["total_mib"] = _mib(sum(costs) + sum(compute[i] for i, c in enumerate(counts) if c > 0))
    orchestrator_host = str(orchestrator.get("host")) if orchestrator and orchestrator.get("host") else None

    explanation.append("%s: %d layers + output = %d units, ctx %d x %d slots (%d KV cells, K %s, V %s)"
                       % (model.get("arch", "model"), n_layer, units, ctx, n_parallel,
                          kv_cells(ctx, n_parallel, kv_unified), cache_type_k, cache_type_v or cache_type_k))
    explanation.append("device order (llama.cpp): RPC devices in --rpc order, then local %s"
                       % ("GPUs" if any(d["local"] for d in devices) else "GPUs (none on %s)"
                          % (orchestrator_host or "the orchestrator")))
    if manual:
        explanation.append("tensor_split given: %s -> units %s" % (list(tensor_split), counts))
    else:
        explanation.append("split by usable memory (free - reserve, capped, minus %d MiB compute margin)"
                           % compute_mib)
    for dev in out_devices:
        explanation.append("%-7s %-22s %-10s units %-14s %3d  %8.1f MiB of %6d MiB usable (%s%%)"
                           % (dev["name"], dev["endpoint"] or "local", dev["host"], dev["layers"]["range"],
                              dev["layers"]["count"], dev["total_mib"], dev["usable_mib"], dev["fill_pct"]))
    explanation.append("input embedding and %.1f MiB of other tensors stay in %s's RAM"
                       % (host_bytes / MIB, orchestrator_host or "the orchestrator"))
    _check_orchestrator_ram(orchestrator, host_bytes, warnings)

    return {
        "rpc": rpc,
        "devices": out_devices,
        "device_names": [d["name"] for d in out_devices],
        "tensor_split": counts,
        "tensor_split_arg": ",".join(str(c) for c in counts),
        "manual": manual,
        "ngl": units,
        "n_layer": n_layer,
        "split_mode": "layer",
        "ctx_size": ctx,
        "n_parallel": n_parallel,
        "kv_cells": kv_cells(ctx, n_parallel, kv_unified),
        "cache_type_k": cache_type_k,
        "cache_type_v": cache_type_v or cache_type_k,
        "orchestrator": orchestrator_host,
        "host_mib": _mib(host_bytes),
        "totals": totals,
        "explanation": explanation,
        "warnings": warnings,
    }


def _manual_counts(tensor_split: Sequence[Any], devices: Sequence[Mapping[str, Any]], n_layer: int) -> list[int]:
    values = list(tensor_split)
    if len(values) != len(devices):
        raise PlanError("tensor_split: %d values given, there are %d devices in this order: %s"
                        % (len(values), len(devices), describe_devices(devices)))
    numbers = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
            raise PlanError("tensor_split[%d] (%s) is %r, expected a number" % (i, devices[i]["name"], value))
        if value < 0:
            raise PlanError("tensor_split[%d] (%s) is negative (%r): use 0 to give a device no layers"
                            % (i, devices[i]["name"], value))
        numbers.append(float(value))
    if all(v == 0 for v in numbers):
        raise PlanError("tensor_split is all zeros, which makes llama.cpp split by free memory at load time: "
                        "leave tensor_split unset to let the planner split by memory")
    return layers_from_split(numbers, n_layer)


def _check_orchestrator_ram(orchestrator: Mapping[str, Any] | None, host_bytes: int, warnings: list[str]) -> None:
    if not orchestrator:
        return
    cpus = [d for d in orchestrator.get("devices") or [] if d.get("backend") == "cpu"]
    if cpus and usable_mib(cpus[0]) * MIB < host_bytes:
        warnings.append("orchestrator %s has %d MiB of usable RAM for the %.0f MiB that stay on its CPU"
                        % (orchestrator.get("host"), usable_mib(cpus[0]), host_bytes / MIB))


def _range_text(start: int, count: int, n_layer: int) -> str:
    if count == 0:
        return "-"
    end = start + count - 1
    if end == n_layer:  # the last unit is the output layer
        if count == 1:
            return "output"
        return "%d-%d+output" % (start, end - 1) if end - 1 > start else "%d+output" % start
    return "%d-%d" % (start, end) if end > start else "%d" % start


def _mib(nbytes: float) -> float:
    return round(nbytes / MIB, 1)


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
