# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Plan how llama-server splits a model's layers over RPC workers and local GPUs.

:func:`plan_split` runs five steps, each a function of its own:

1. :func:`validate_request`: the options and the model facts make sense;
   then split_units' :func:`resolve_slots`: the slot count (``n_parallel`` 0:
   one per ``MIN_SHARED_SLOT_CTX`` tokens of a unified cache or ``MIN_SLOT_CTX``
   of a split one, at most ``MAX_AUTO_SLOTS``) and the context each request can use;
2. :func:`size_fleet`: the model's units and their bytes at the context
   (split_units), the devices in llama.cpp's order and what each can hold
   (split_devices);
3. :func:`split_policies.choose_split`: how many units each device gets under
   the policy (balanced, even, fewest_hops, fit) or a manual ``tensor_split``;
4. :func:`assemble_plan`: endpoints whose devices all got no units are left
   out of ``--rpc`` (llama-server would still connect to them, and wait for
   them at start, for nothing), the device list is renamed accordingly, and
   each device gets its layers and memory figures;
5. :func:`explain_plan`: the explanation lines and the warnings.

``tensor_split`` is emitted as integer unit counts, which llama.cpp maps back to
exactly those layer ranges (split_units). Stdlib only; shared by the Ansible
modules and ``llamafleet.core.split_plan``.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Mapping, Sequence

from .constants import MAX_DEVICES
from .gpu_devices import usable_mib
from .split_devices import (
    DEFAULT_COMPUTE_MIB,
    check_device_count,
    describe_devices,
    elect_orchestrator,
    gpu_memory_mib,
    label,
    model_devices,
    size_devices,
)
from .split_cpu import (
    CPU_LAYERS_VARIABLE,
    check_cpu_layers,
    check_fixed,
    cpu_entry,
    orchestrator_cpu,
    takes_part,
    without_first,
)
from .split_policies import DEFAULT_POLICY, POLICIES, check_counts_fit, choose_split, estimate_ms
from .split_units import (
    DEFAULT_N_UBATCH,
    KV_TYPES,
    MAX_AUTO_SLOTS,
    MAX_SLOTS,
    MIB,
    MIN_SHARED_SLOT_CTX,
    MIN_SLOT_CTX,
    PlanError,
    assign_layers,
    check_facts,
    generation_bound,
    kv_bytes_per_layer,
    kv_cells,
    layers_from_split,
    range_text,
    resolve_slots,
    shared_cache,
    size_units,
)

__all__ = [
    "DEFAULT_COMPUTE_MIB", "DEFAULT_N_UBATCH", "DEFAULT_POLICY", "KV_TYPES", "MAX_AUTO_SLOTS", "MAX_DEVICES",
    "MIN_SHARED_SLOT_CTX", "MIN_SLOT_CTX", "POLICIES", "PlanError", "assemble_plan", "assign_layers", "describe_devices",
    "elect_orchestrator", "explain_plan", "gpu_memory_mib", "keep_deployed", "kv_bytes_per_layer", "kv_cells",
    "layers_from_split", "model_devices", "plan_split", "request_key", "resolve_slots", "size_fleet",
    "validate_request",
]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_request(model: Mapping[str, Any], ctx_size: int = 0, n_parallel: int = 1,
                     compute_mib: int = DEFAULT_COMPUTE_MIB, policy: str = DEFAULT_POLICY,
                     link_rtt_ms: float | None = None, tensor_split: Sequence[Any] | None = None) -> dict[str, Any]:
    """Step 1: check the options against each other and the model facts; the context to plan for.

    Returns ``{"n_layer", "ctx" (ctx_size, or the model's training context),
    "policy"}``. Raises PlanError naming the option to change.
    """
    n_layer = check_facts(model)
    if not _is_int(n_parallel) or not 0 <= n_parallel <= MAX_SLOTS:
        raise PlanError("n_parallel is %r, expected 0 (automatic) or a number of slots up to %d (llama-server -np)"
                        % (n_parallel, MAX_SLOTS))
    if not _is_int(ctx_size) or ctx_size < 0:
        raise PlanError("ctx_size is %r, expected 0 (the model's context) or a positive integer" % (ctx_size,))
    if not _is_int(compute_mib) or compute_mib < 0:
        raise PlanError("compute_mib is %r, expected a non-negative integer (MiB)" % (compute_mib,))
    if policy not in POLICIES:
        raise PlanError("policy is %r, expected one of %s" % (policy, ", ".join(POLICIES)))
    if link_rtt_ms is not None and (isinstance(link_rtt_ms, bool) or not isinstance(link_rtt_ms, (int, float))
                                    or not math.isfinite(link_rtt_ms) or link_rtt_ms < 0):
        raise PlanError("link_rtt_ms is %r, expected a round trip in ms (a number >= 0)" % (link_rtt_ms,))
    if tensor_split is not None and policy != DEFAULT_POLICY:
        raise PlanError("tensor_split sets the split by hand and policy %s would set it too: leave tensor_split "
                        "empty to use the policy, or the policy at %s" % (policy, DEFAULT_POLICY))
    ctx = ctx_size or int(model.get("n_ctx_train") or 0)
    if ctx <= 0:
        raise PlanError("ctx_size is 0 and the model declares no training context: set ctx_size")
    return {"n_layer": n_layer, "ctx": ctx, "policy": policy}


def size_fleet(workers: Sequence[Mapping[str, Any]], orchestrator: Mapping[str, Any] | None,
               model: Mapping[str, Any], ctx: int, n_parallel: int = 1, cache_type_k: str = "f16",
               cache_type_v: str | None = None, kv_unified: bool = False, n_ubatch: int = DEFAULT_N_UBATCH,
               compute_mib: int = DEFAULT_COMPUTE_MIB,
               link_rtt_ms: float | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Step 2: the devices in llama.cpp's order with what each can hold, and the model's units with their bytes."""
    devices = model_devices(workers, orchestrator)
    check_device_count(devices)
    size_devices(devices, workers, compute_mib, link_rtt_ms)
    sizing = size_units(model, ctx, n_parallel, cache_type_k, cache_type_v, kv_unified, n_ubatch)
    return devices, sizing


def _drop_idle_endpoints(workers: Sequence[Mapping[str, Any]], orchestrator: Mapping[str, Any] | None,
                         devices: list[dict[str, Any]], counts: list[int], compute_mib: int,
                         link_rtt_ms: float | None) -> tuple[list[dict[str, Any]], list[int], list[dict[str, Any]]]:
    """Leave out of ``--rpc`` every endpoint whose devices all get no units; rename the rest as llama.cpp will."""
    idle = []
    for position, worker in enumerate(workers):
        served = [(dev, count) for dev, count in zip(devices, counts) if dev["worker"] == position]
        if served and all(count == 0 for dummy, count in served):
            idle.append(position)
    if not idle:
        return devices, counts, []
    excluded = [{"host": str(workers[p]["host"]),
                 "endpoint": next(d["endpoint"] for d in devices if d["worker"] == p),
                 "devices": [d["name"] for d in devices if d["worker"] == p]} for p in idle]
    kept = [w for p, w in enumerate(workers) if p not in idle]
    kept_counts = [c for d, c in zip(devices, counts) if d["worker"] not in idle]
    renamed = model_devices(kept, orchestrator)
    size_devices(renamed, kept, compute_mib, link_rtt_ms)
    return renamed, kept_counts, excluded


def _device_entry(dev: Mapping[str, Any], start: int | None, count: int | None, sizing: Mapping[str, Any]) -> dict:
    entry = {key: dev[key] for key in ("position", "name", "buffer_name", "host", "endpoint", "local", "backend",
                                       "description", "free_mib", "usable_mib")}
    if count is None:  # policy fit: llama.cpp decides at load time
        entry.update(layers=None, weights_mib=None, kv_mib=None, compute_mib=None, total_mib=None, fill_pct=None)
        return entry
    n_layer = sizing["n_layer"]
    layers = range(start, min(start + count, n_layer))
    has_output = count > 0 and start + count == sizing["units"]
    weights = sum(sizing["layer_bytes"][i] for i in layers) + (sizing["output_bytes"] if has_output else 0)
    kv = sum(sizing["kv"][i] for i in layers)
    margin = dev["compute_mib"] * MIB if count > 0 else 0
    total = weights + kv + margin
    entry.update(
        layers={"start": start, "end": start + count, "count": count, "output": has_output,
                "range": range_text(start, count, n_layer)},
        weights_mib=_mib(weights), kv_mib=_mib(kv), compute_mib=_mib(margin), total_mib=_mib(total),
        fill_pct=round(100.0 * total / (dev["usable_mib"] * MIB), 1) if dev["usable_mib"] > 0 else None,
    )
    return entry


def assemble_plan(workers: Sequence[Mapping[str, Any]], orchestrator: Mapping[str, Any] | None,
                  devices: list[dict[str, Any]], sizing: Mapping[str, Any], choice: Mapping[str, Any],
                  ctx: int, n_parallel: int = 1, cache_type_k: str = "f16", cache_type_v: str | None = None,
                  compute_mib: int = DEFAULT_COMPUTE_MIB, link_rtt_ms: float | None = None,
                  slots: Mapping[str, Any] | None = None, cpu_count: int = 0,
                  cpu: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Step 4: the plan for the chosen unit counts (without explanation and warnings).

    Endpoints whose devices all get no units are dropped (``excluded``) and the
    remaining devices renamed as llama.cpp names them without those endpoints.
    ``slots`` is :func:`resolve_slots`' answer (it wins over ``n_parallel``);
    without it, ``n_parallel`` slots with a KV cache per slot. The first
    ``cpu_count`` units stay on the orchestrator's ``cpu`` (split_cpu): ``ngl``
    is the unit count less them, and the devices' units start after them.
    """
    slots = slots or resolve_slots(ctx, n_parallel)
    counts = choice["counts"]
    excluded: list[dict[str, Any]] = []
    ngl = sizing["units"] - cpu_count
    if counts is not None:
        devices, counts, excluded = _drop_idle_endpoints(workers, orchestrator, devices, list(counts), compute_mib,
                                                         link_rtt_ms)
        # llama.cpp must map the emitted split and -ngl back to exactly these counts, the CPU's units first.
        placed = assign_layers(counts, sizing["n_layer"], ngl)
        reproduced = [placed.count(index) for index in range(len(counts))]
        if reproduced != counts or placed[:cpu_count] != [-1] * cpu_count:  # pragma: no cover - the invariant
            raise AssertionError("-ngl %d -ts %r maps to %r in llama.cpp, not the planned counts" % (ngl, counts, placed))
    entries = []
    start = cpu_count
    for index, dev in enumerate(devices):
        count = None if counts is None else counts[index]
        entries.append(_device_entry(dev, start, count, sizing))
        start += count or 0
    rpc: list[str] = []
    for dev in devices:
        if dev["endpoint"] and dev["endpoint"] not in rpc:
            rpc.append(dev["endpoint"])
    used = [dev for index, dev in enumerate(devices) if counts is None or counts[index] > 0]
    if cpu_count and cpu is not None:
        used.append(cpu)
    compute = sum(dev["compute_mib"] for dev in used) * MIB
    orchestrator_host = str(orchestrator.get("host")) if orchestrator and orchestrator.get("host") else None
    estimate = choice["estimates"].get(choice["policy"])
    return {
        "identity": plan_identity(entries, rpc, counts, choice["policy"], cpu_count),
        "rpc": rpc,
        "devices": entries,
        "device_names": [d["name"] for d in entries],
        "tensor_split": counts,
        "tensor_split_arg": ",".join(str(c) for c in counts) if counts is not None else "",
        "manual": choice["policy"] == "manual",
        "policy": choice["policy"],
        "requested_policy": choice["requested"],
        "estimate": estimate,
        "excluded": excluded,
        "ngl": ngl if counts is not None else None,
        "cpu_layers": cpu_count,
        "cpu": cpu_entry(cpu, cpu_count, sizing),
        "n_layer": sizing["n_layer"],
        "split_mode": "layer",
        "ctx_size": ctx,
        "n_parallel": slots["n_parallel"],
        "n_parallel_auto": slots["n_parallel_auto"],
        "kv_unified": slots["kv_unified"],
        "slot_ctx": slots["slot_ctx"],
        "kv_cells": sizing["kv_cells"],
        "cache_type_k": cache_type_k,
        "cache_type_v": cache_type_v or cache_type_k,
        "orchestrator": orchestrator_host,
        "host_mib": _mib(sizing["host_bytes"]),
        "totals": {
            "weights_mib": _mib(sum(sizing["layer_bytes"]) + sizing["output_bytes"]),
            "kv_mib": _mib(sum(sizing["kv"])),
            "compute_mib": _mib(compute),
            "usable_mib": sum(dev["usable_mib"] for dev in devices) + (cpu["usable_mib"] if cpu_count and cpu else 0),
            "total_mib": _mib(sum(sizing["costs"]) + compute),
        },
    }


def explain_plan(plan: Mapping[str, Any], choice: Mapping[str, Any], model: Mapping[str, Any],
                 orchestrator: Mapping[str, Any] | None,
                 compute_mib: int = DEFAULT_COMPUTE_MIB) -> tuple[list[str], list[str]]:
    """Step 5: the explanation lines and the warnings of an assembled plan."""
    units = plan["n_layer"] + 1
    where = plan["orchestrator"] or "the orchestrator"
    lines = [
        "%s: %d layers + output = %d units, ctx %d (%d KV cells, K %s, V %s)"
        % (model.get("arch", "model"), plan["n_layer"], units, plan["ctx_size"], plan["kv_cells"],
           plan["cache_type_k"], plan["cache_type_v"]),
        _slots_line(plan),
        "device order (llama.cpp): RPC devices in --rpc order, then local %s"
        % ("GPUs" if any(d["local"] for d in plan["devices"]) else "GPUs (none on %s)" % where),
        choice["reason"],
    ]
    if plan["policy"] in ("balanced", "fewest_hops"):
        lines.append("capacity: usable memory (free - reserve, capped) minus the compute margin (%d MiB unless "
                     "a device sets its own)" % compute_mib)
    for name, estimate in sorted(choice["estimates"].items()):
        if estimate is not None:
            lines.append("estimated per token (%s): %.3f ms reading weights and KV + %d round trip(s) %.3f ms = "
                         "%.3f ms" % (name, estimate["compute_ms"], estimate["hops"], estimate["rtt_ms"],
                                      estimate["total_ms"]))
    lines.append(choice.get("cpu_reason") or "orchestrator CPU: no layers")
    if plan.get("cpu"):
        cpu = plan["cpu"]
        lines.append("%-7s %-22s %-10s units %-14s %3d  %8.1f MiB of %6d MiB usable (%s%%), after the %.1f MiB that "
                     "stay there; -ngl %d" % ("CPU", "local", cpu["host"], cpu["layers"]["range"], cpu["layers"]["count"],
                                              cpu["total_mib"], cpu["usable_mib"], cpu["fill_pct"], cpu["held_mib"],
                                              plan["ngl"]))
    for dev in plan["devices"]:
        if dev["layers"] is None:
            lines.append("%-7s %-22s %-10s units decided by llama.cpp, %6d MiB usable"
                         % (dev["name"], dev["endpoint"] or "local", dev["host"], dev["usable_mib"]))
            continue
        lines.append("%-7s %-22s %-10s units %-14s %3d  %8.1f MiB of %6d MiB usable (%s%%)"
                     % (dev["name"], dev["endpoint"] or "local", dev["host"], dev["layers"]["range"],
                        dev["layers"]["count"], dev["total_mib"], dev["usable_mib"], dev["fill_pct"]))
    for gone in plan["excluded"]:
        lines.append("not in --rpc: %s (%s): its devices get no units, so llama-server neither connects to it nor "
                     "waits for it at start" % (gone["host"], gone["endpoint"]))
    lines.append("input embedding and %.1f MiB of other tensors stay in %s's RAM" % (plan["host_mib"], where))

    warnings = []
    for dev in plan["devices"]:
        if dev["layers"] is not None and dev["layers"]["count"] == 0:
            warnings.append("%s gets no layers; it still takes a backend slot: remove it or give it more memory"
                            % label(dev))
    if plan["policy"] != "fewest_hops":
        for gone in plan["excluded"]:
            warnings.append("worker %s (%s) gets no layers and is left out of --rpc: give it more memory or remove "
                            "it from the workers" % (gone["host"], gone["endpoint"]))
    if plan["policy"] == "fit" and plan["totals"]["total_mib"] > plan["totals"]["usable_mib"]:
        warnings.append("the model at ctx_size %d needs %.0f MiB with KV and compute margins, the devices have %d "
                        "MiB usable: llama.cpp's fit will keep layers on %s's CPU"
                        % (plan["ctx_size"], plan["totals"]["total_mib"], plan["totals"]["usable_mib"], where))
    _check_orchestrator_ram(orchestrator, plan["host_mib"], warnings)
    return lines, warnings


def _slots_line(plan: Mapping[str, Any]) -> str:
    """The explanation line of the slots, e.g. ``8 slots (auto: 4096 ctx / 512), unified KV cache of 4096
    tokens shared by all slots, up to 4096 tokens per request``."""
    count = plan["n_parallel"]
    line = "%d slot%s" % (count, "" if count == 1 else "s")
    if plan["n_parallel_auto"]:
        per_slot = MIN_SHARED_SLOT_CTX if plan["kv_unified"] else MIN_SLOT_CTX
        capped = plan["ctx_size"] // per_slot > MAX_AUTO_SLOTS
        line += " (auto: %d ctx / %d%s)" % (plan["ctx_size"], per_slot,
                                            ", at most %d" % MAX_AUTO_SLOTS if capped else "")
    if count == 1:
        line += ", KV cache of %d tokens" % plan["kv_cells"]
    elif plan["kv_unified"]:
        line += ", unified KV cache of %d tokens shared by all slots" % plan["kv_cells"]
    else:
        line += ", KV cache split per slot: %d x %d tokens" % (count, plan["kv_cells"] // count)
    line += ", up to %d tokens per request" % plan["slot_ctx"]
    if plan["slot_ctx"] < plan["kv_cells"] // (1 if plan["kv_unified"] else count):
        line += " (the model's training context)"
    if plan.get("kv_budget"):
        line += "; the serving gate admits generations while their tokens fit the cache together"
    if plan.get("max_tokens"):
        line += ", one without max_tokens generates at most %d (-n)" % plan["max_tokens"]
    return line


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
               n_ubatch: int = DEFAULT_N_UBATCH,
               policy: str = DEFAULT_POLICY,
               link_rtt_ms: float | None = None,
               cpu_layers: str | int = 0,
               keep: Mapping[str, Any] | None = None,
               max_tokens: int = 0) -> dict[str, Any]:
    """Plan llama-server's ``--rpc``, device order and ``--tensor-split`` for a fleet.

    :param workers: rpc-server hosts in inventory (= ``--rpc``) order, each
        ``{"host", "address", "port", "devices": [device dicts as gpu_facts
        returns], "rtt_ms" (optional, the measured round trip to it)}``.
    :param orchestrator: ``{"host", "devices": [...]}``, the llama-server host;
        its GPUs are used after the RPC devices; CPU entries are ignored.
    :param model: model facts (:func:`gguf_facts.model_facts`).
    :param ctx_size: total context (``-c``); 0 means the model's training context.
    :param n_parallel: slots (``-np``); 0 chooses them from the context
        (split_units.auto_slots). With a non-unified KV cache each slot gets its
        share of the context, rounded up to 256, and a share under 256 is refused.
    :param kv_unified: one KV cache of ``ctx_size`` tokens shared by all slots
        (``--kv-unified``): each request can use the whole context.
    :param cache_type_k: KV cache type for K (``-ctk``), ``cache_type_v`` for V
        (defaults to the K type).
    :param compute_mib: compute-buffer margin per device (a device dict's own
        ``compute_mib`` wins); see ``split_devices.DEFAULT_COMPUTE_MIB``.
    :param tensor_split: manual ``-ts`` ratios, one per device in llama.cpp's
        order; the planner then only checks that they fit.
    :param policy: ``balanced``, ``even``, ``fewest_hops`` or ``fit`` (split_policies).
    :param link_rtt_ms: the round trip to every worker that gives no ``rtt_ms``;
        with round trips known, ``balanced`` takes the ``fewest_hops`` plan when
        its estimated time per token is lower.
    :param cpu_layers: layers left on the orchestrator's CPU (its CPU entry in
        ``orchestrator["devices"]`` gives the memory): ``auto`` (on a CPU fleet
        the CPU joins the split policy), ``0`` or a number (split_cpu).
    :param max_tokens: the bound of a generation that gives none (llama-server ``-n``): above 0 as given, -1 none,
        0 automatic (split_units.generation_bound); the plan's ``max_tokens`` (0: none) and ``kv_budget`` (the
        shared cache the serving gate guards, 0: none).
    :param keep: the deployed plan's ``keep`` entry: its split is kept while it was made for the same request
        (:func:`request_key`) and still fits the memory measured now (:func:`keep_deployed`).
    :returns: the plan (see the module's RETURN documentation in rpc_plan).
    :raises PlanError: with a message that says what to change.
    """
    request = validate_request(model, ctx_size, n_parallel, compute_mib, policy, link_rtt_ms, tensor_split)
    slots = resolve_slots(request["ctx"], n_parallel, kv_unified, int(model.get("n_ctx_train") or 0))
    devices, sizing = size_fleet(workers, orchestrator, model, request["ctx"], slots["n_parallel"], cache_type_k,
                                 cache_type_v, kv_unified, n_ubatch, compute_mib, link_rtt_ms)
    choice, cpu, cpu_count = _choose_with_cpu(cpu_layers, workers, orchestrator, devices, sizing, request, compute_mib,
                                              tensor_split)
    key = request_key(devices, cpu, sizing, request["policy"], tensor_split, cpu_layers)
    choice, cpu_count = keep_deployed(keep, key, choice, cpu_count, cpu, devices, sizing)
    plan = assemble_plan(workers, orchestrator, devices, sizing, choice, request["ctx"], slots["n_parallel"],
                         cache_type_k, cache_type_v, compute_mib, link_rtt_ms, slots, cpu_count, cpu)
    plan["kv_budget"] = shared_cache(plan["kv_cells"], plan["n_parallel"], plan["kv_unified"])
    plan["max_tokens"] = generation_bound(max_tokens, plan["kv_cells"], plan["n_parallel"], plan["kv_unified"])
    plan["keep"] = {"request_key": key, "counts": None if choice["counts"] is None else list(choice["counts"]),
                    "cpu_layers": cpu_count, "policy": choice["policy"]}
    plan["explanation"], plan["warnings"] = explain_plan(plan, choice, model, orchestrator, compute_mib)
    return plan


# What a request is, without the memory readings and round trips that change from run to run: the devices in llama.cpp's
# order (what they are, not what is free on them), what each unit of the model costs at this context and KV type, and
# the settings that shape a split. Two deploys with the same request key may keep the same split.
REQUEST_DEVICE_KEYS = ("name", "host", "backend", "endpoint", "description", "local", "compute_mib")


def request_key(devices: Sequence[Mapping[str, Any]], cpu: Mapping[str, Any] | None, sizing: Mapping[str, Any],
                policy: str, tensor_split: Sequence[float] | None, cpu_layers: str | int) -> str:
    """A short hash of what was asked of the planner (see :data:`REQUEST_DEVICE_KEYS`), memory readings left out."""
    stable = {"devices": [{key: dev.get(key) for key in REQUEST_DEVICE_KEYS} for dev in devices],
              "cpu": None if cpu is None else {key: cpu.get(key) for key in REQUEST_DEVICE_KEYS},
              "costs": list(sizing["costs"]), "host_bytes": sizing["host_bytes"], "policy": policy,
              "tensor_split": None if tensor_split is None else list(tensor_split), "cpu_layers": str(cpu_layers)}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def _kept_counts(keep: Mapping[str, Any], devices: Sequence[Mapping[str, Any]], cpu: Mapping[str, Any] | None,
                 sizing: Mapping[str, Any]) -> tuple[list[int], int] | None:
    """The deployed split in ``keep`` when it is a whole split of these devices (None when it is not)."""
    counts, cpu_count = keep.get("counts"), keep.get("cpu_layers") or 0
    if not isinstance(counts, list) or len(counts) != len(devices) or not isinstance(cpu_count, int):
        return None
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) or cpu_count < 0:
        return None
    if sum(counts) + cpu_count != sizing["units"] or (cpu_count and cpu is None):
        return None
    return list(counts), cpu_count


def keep_deployed(keep: Mapping[str, Any] | None, key: str, choice: dict[str, Any], cpu_count: int,
                  cpu: Mapping[str, Any] | None, devices: Sequence[Mapping[str, Any]],
                  sizing: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The choice to plan with: the deployed split (``keep``) while it answers the same request key and still fits
    the memory measured now, else the fresh ``choice``; and the CPU's units.

    Free memory moves a little between two runs (page cache, a service's own growth), and a balanced split follows
    it: without this, a deploy that changes nothing could still move a layer from one worker to another, restart
    llama-server and send tensors over the LAN. The fresh split is taken when the request changed (model, context,
    KV type, devices, settings), when the deployed split no longer fits (the reason is in the explanation), or when
    there is nothing deployed to keep, or when the fresh plan chose another policy (balanced takes fewest_hops when
    the round trips measured now make fewer workers pay, split_policies.worth_fewer_hops, which has its own margin).
    """
    if not keep or choice["counts"] is None or keep.get("request_key") != key:
        return choice, cpu_count
    if keep.get("policy") != choice["policy"]:
        # the round trips measured now make balanced choose another policy (or back): that is a new plan
        return choice, cpu_count
    kept = _kept_counts(keep, devices, cpu, sizing)
    if kept is None or kept == (list(choice["counts"]), cpu_count):
        return choice, cpu_count
    counts, kept_cpu = kept
    try:
        if kept_cpu:
            check_counts_fit([cpu] + list(devices), [kept_cpu] + counts, sizing["costs"], "the deployed split",
                             "re-planning")
        else:
            check_counts_fit(devices, counts, sizing["costs"], "the deployed split", "re-planning")
    except PlanError as exc:
        return dict(choice, reason="%s; the deployed split (units %s) no longer fits: %s" % (
            choice["reason"], counts, exc)), cpu_count
    policy = choice["policy"]
    fresh = "CPU %d + %s" % (cpu_count, choice["counts"]) if cpu_count else str(choice["counts"])
    costs = sizing["costs"][kept_cpu:]
    return dict(choice, policy=policy, counts=counts, estimates={policy: estimate_ms(devices, counts, costs)},
                reason="kept the deployed split (units %s%s, policy %s): it still fits the memory measured now; a "
                       "fresh plan would give %s" % (counts, ", %d on the CPU" % kept_cpu if kept_cpu else "", policy,
                                                     fresh)), kept_cpu


def _choose_with_cpu(cpu_layers: str | int, workers: Sequence[Mapping[str, Any]],
                     orchestrator: Mapping[str, Any] | None, devices: Sequence[dict[str, Any]],
                     sizing: Mapping[str, Any], request: Mapping[str, Any], compute_mib: int,
                     tensor_split: Sequence[float] | None) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """Step 3 with the orchestrator's CPU (split_cpu): the choice over llama.cpp's devices, the CPU device, its units."""
    policy = request["policy"]
    setting = check_cpu_layers(cpu_layers, request["n_layer"])
    cpu = orchestrator_cpu(orchestrator, workers, compute_mib, sizing["host_bytes"])
    joins, reason = takes_part(setting, cpu, devices, policy, tensor_split is not None, sizing)
    if joins:
        choice = choose_split(policy, [cpu] + list(devices), sizing, request["ctx"])
        cpu_count, choice["counts"] = choice["counts"][0], choice["counts"][1:]
    else:
        cpu_count = setting if isinstance(setting, int) else 0
        if cpu_count and policy == "fit":
            raise PlanError("%s is %d and policy fit lets llama.cpp choose -ngl: set it to 0 or auto, or choose "
                            "another policy" % (CPU_LAYERS_VARIABLE, cpu_count))
        check_fixed(cpu, cpu_count, sizing, orchestrator.get("host") if orchestrator else None)
        choice = choose_split(policy, devices, without_first(sizing, cpu_count), request["ctx"], tensor_split)
    choice["cpu_reason"] = reason
    return choice, cpu, cpu_count


def _check_orchestrator_ram(orchestrator: Mapping[str, Any] | None, host_mib: float, warnings: list[str]) -> None:
    if not orchestrator:
        return
    cpus = [d for d in orchestrator.get("devices") or [] if d.get("backend") == "cpu"]
    if cpus and usable_mib(cpus[0]) < host_mib:
        warnings.append("orchestrator %s has %d MiB of usable RAM for the %.0f MiB that stay on its CPU"
                        % (orchestrator.get("host"), usable_mib(cpus[0]), host_mib))


def _mib(nbytes: float) -> float:
    return round(nbytes / MIB, 1)


# What a plan is, without the figures that change from run to run (free memory, fill, estimates): the devices (name,
# host, backend, endpoint, description, layers), the RPC endpoints, the split and the policy.
IDENTITY_DEVICE_KEYS = ("name", "host", "backend", "endpoint", "description", "local", "layers")


def plan_identity(entries: Sequence[Mapping[str, Any]], rpc: Sequence[str], counts: Sequence[int] | None,
                  policy: str, cpu_layers: int = 0) -> str:
    """A short hash of what the plan is (:data:`IDENTITY_DEVICE_KEYS` of each device, the RPC endpoints, the split,
    the policy): equal for two runs that plan the same thing, whatever the memory readings. The deployed plan
    file is rewritten when it changes, even when llama-server's unit does not (a worker that changed backend)."""
    stable = {"devices": [{key: dev.get(key) for key in IDENTITY_DEVICE_KEYS} for dev in entries],
              "rpc": list(rpc), "tensor_split": None if counts is None else list(counts), "policy": policy}
    if cpu_layers:  # left out when 0, so the plans deployed before CPU layers existed keep their identity
        stable["cpu_layers"] = cpu_layers
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode("utf-8")).hexdigest()[:16]
