# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Split policies: how many of the model's units each device gets.

Every policy places contiguous runs of units on the devices in llama.cpp's
order (split_devices) and never more than a device can hold: its usable memory
less its compute margin, called its *capacity* here. A unit's *load* is its
bytes at the planned context: the layer's weights and KV cache, or the output
matrix for the last unit.

``balanced`` (the default)
    The contiguous split that minimises ``sum(load_d ** 2 / capacity_d)`` over
    the devices, ``load_d`` being the bytes of the units device ``d`` holds
    (the output matrix counted on the device that holds the last unit).
    Without indivisible units that minimum is ``load_d`` proportional to
    ``capacity_d``: every device filled to the same fraction of what it can
    hold. With them it is the nearest split in that sense, computed exactly
    (dynamic programming over the unit boundaries). A device with memory then
    gets no units only when the units force it: fewer units than devices, or a
    share so far below its neighbouring unit (under about half of it) that
    taking that unit would unbalance more than it relieves, or no room for the
    unit that would fall to it (the output matrix can only go last). Ties go to
    the earlier devices, as llama.cpp's own ``-ts 1,1,1`` does.
``even``
    The same number of units on every device (what ``-ts 1,1,...`` gives), the
    output matrix counted as one unit; refused when a device cannot hold its
    share.
``fewest_hops``
    The fewest RPC devices that hold the model at the planned context, split
    ``balanced`` among them: the orchestrator's own GPUs first (they cost no
    network hop), then RPC devices by most capacity (ties in ``--rpc`` order),
    one more at a time until the model fits. The chosen devices keep llama.cpp's
    order (RPC in ``--rpc`` order, local GPUs last).
``fit``
    No split: llama-server gets no ``-ts`` and no ``-ngl`` and fits the model to
    the devices' free memory itself at load time (its ``--fit``, on by default).

Latency (``balanced`` with measured round trips). For one batch llama.cpp runs
the devices one after another (its pipeline parallelism overlaps only the
ubatches of a long prompt), and each RPC device that holds units costs at least
one network round trip per token (its input activations go out and its outputs
are read back before the next device can start). The planner's estimate of one
decoding step is therefore::

    t_token ~ sum over devices of load_d / bandwidth_d  +  sum over used RPC devices of rtt_d

(bandwidth from the device's ``bandwidth_gbs``, else the same nominal figure for
every device; local GPUs cost no round trip). Spreading layers over more
devices of equal speed buys memory headroom, not per-token speed, so extra hops
give time back only where they move bytes onto faster devices. When every used
worker's round trip is known (``link_rtt_ms`` or a worker's ``rtt_ms``),
``balanced`` estimates its own plan and the ``fewest_hops`` plan and takes the
``fewest_hops`` one when its estimate is lower by a clear margin (10 % and 1 ms
per token, ``worth_fewer_hops``); otherwise it keeps ``balanced``. Only ``fewest_hops`` is
considered because it is the plan with the fewest round trips.

Stdlib only.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from .split_devices import check_capacity, describe_devices, label
from .split_units import GIB, MIB, PlanError, layers_from_split

POLICIES = ("balanced", "even", "fewest_hops", "fit")
DEFAULT_POLICY = "balanced"
# balanced gives way to fewest_hops only for a clear gain: at least this much of its own estimate and at least
# FEWER_HOPS_MIN_GAIN_MS per token. Below that the round trips are noise against a token's compute (a LAN's
# 0.1-0.5 ms) and keeping the spread keeps memory headroom; the margin also keeps a re-plan from flipping
# between the two on a measurement that wobbles.
FEWER_HOPS_MIN_GAIN = 0.10
FEWER_HOPS_MIN_GAIN_MS = 1.0

# A plan's cost is compared with a relative tolerance, so floating-point noise
# never decides between two splits that are equal in exact arithmetic.
_TIE = 1e-12


def _prefix(costs: Sequence[int]) -> list[int]:
    out = [0]
    for cost in costs:
        out.append(out[-1] + cost)
    return out


def device_loads(counts: Sequence[int], costs: Sequence[int]) -> list[int]:
    """Bytes each device holds when it takes ``counts`` contiguous units of ``costs`` in order."""
    prefix = _prefix(costs)
    loads = []
    pos = 0
    for count in counts:
        loads.append(prefix[pos + count] - prefix[pos])
        pos += count
    return loads


def balanced_counts(costs: Sequence[int], capacities: Sequence[int]) -> list[int] | None:
    """Contiguous unit counts minimising ``sum(load ** 2 / capacity)``, none over capacity; None if impossible.

    ``best[d][u]`` is the least cost of placing the first ``u`` units on the
    first ``d`` devices; the last device takes a run ``v..u`` that fits. Runs
    are tried from the shortest, and only a strictly lower cost replaces the
    best, so ties leave the units to the earlier devices.
    """
    units = len(costs)
    prefix = _prefix(costs)
    best = [0.0] + [math.inf] * units
    choices: list[list[int]] = []
    for capacity in capacities:
        row = [math.inf] * (units + 1)
        back = [-1] * (units + 1)
        first = 0  # the first unit a run ending at u may start from without overflowing
        for u in range(units + 1):
            while prefix[u] - prefix[first] > capacity:
                first += 1
            for v in range(u, first - 1, -1):
                if best[v] == math.inf:
                    continue
                load = prefix[u] - prefix[v]
                cost = best[v] + load * load / capacity
                if row[u] == math.inf or cost < row[u] * (1.0 - _TIE):
                    row[u] = cost
                    back[u] = v
        best = row
        choices.append(back)
    if best[units] == math.inf:
        return None
    counts = []
    end = units
    for back in reversed(choices):
        start = back[end]
        counts.append(end - start)
        end = start
    return list(reversed(counts))


def even_counts(n_devices: int, n_layer: int) -> list[int]:
    """The units llama.cpp gives each device for ``-ts 1,1,...`` (earlier devices take the remainder)."""
    return layers_from_split([1] * n_devices, n_layer)


def fewest_hops_counts(devices: Sequence[Mapping[str, Any]], costs: Sequence[int]) -> list[int] | None:
    """``balanced`` over the fewest RPC devices that hold the model (local GPUs always, at no hop); None if none do."""
    local = [i for i, dev in enumerate(devices) if dev["local"]]
    remote = sorted((i for i, dev in enumerate(devices) if not dev["local"]),
                    key=lambda i: (-devices[i]["capacity"], i))
    for k in range(len(remote) + 1):
        chosen = sorted(local + remote[:k])
        if not chosen:
            continue
        found = balanced_counts(costs, [devices[i]["capacity"] for i in chosen])
        if found is not None:
            counts = [0] * len(devices)
            for index, count in zip(chosen, found):
                counts[index] = count
            return counts
    return None


def manual_counts(tensor_split: Sequence[Any], devices: Sequence[Mapping[str, Any]], n_layer: int) -> list[int]:
    """The units llama.cpp gives each device for the manual ``-ts`` values; PlanError if they are not a split."""
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


def check_counts_fit(devices: Sequence[Mapping[str, Any]], counts: Sequence[int], costs: Sequence[int],
                     what: str, remedy: str) -> None:
    """PlanError naming the first device whose units, KV and compute margin exceed its usable memory."""
    for dev, count, load in zip(devices, counts, device_loads(counts, costs)):
        total = load + dev["compute_mib"] * MIB
        if count > 0 and total > dev["usable_mib"] * MIB:
            raise PlanError("%s puts %d units (%.0f MiB with KV and compute margin) on %s, which has %d MiB "
                            "usable: %s" % (what, count, total / MIB, label(dev), dev["usable_mib"], remedy))


def estimate_ms(devices: Sequence[Mapping[str, Any]], counts: Sequence[int],
                costs: Sequence[int]) -> dict[str, Any] | None:
    """Estimated time of one decoding step for this split (see the module doc); None if a used RPC link is unmeasured.

    ``{"compute_ms", "hops", "rtt_ms", "total_ms"}``: the bytes each device
    reads over its bandwidth, the RPC devices that hold units, their round trips.
    """
    compute = 0.0
    rtt = 0.0
    hops = 0
    for dev, count, load in zip(devices, counts, device_loads(counts, costs)):
        if count == 0:
            continue
        compute += load / (dev["bandwidth_gbs"] * 1e9) * 1000.0
        if not dev["local"]:
            if dev["rtt_ms"] is None:
                return None
            hops += 1
            rtt += dev["rtt_ms"]
    return {"compute_ms": round(compute, 3), "hops": hops, "rtt_ms": round(rtt, 3),
            "total_ms": round(compute + rtt, 3)}


def shortfall(devices: Sequence[Mapping[str, Any]], sizing: Mapping[str, Any]) -> str:
    """What each device has and what else would make the model fit, for the refusals below."""
    kv = sum(sizing["kv"])
    parts = ["%s %s %d MiB usable (%d MiB compute margin)" % (
        dev["name"], "host %s" % dev["host"], dev["usable_mib"], dev["compute_mib"]) for dev in devices]
    text = "; per device: %s" % ", ".join(parts)
    text += ("; or shrink the KV cache (%.0f MiB now: a quantized one, llama_server_cache_type q8_0, about halves it; "
             "fewer slots, llama_server_parallel, where each slot holds its own cache), lower the compute margin "
             "(llama_server_compute_margin_mib), or give a host more memory (its cgroup or MemoryMax, "
             "rpc_server_memory_max_mib, or a smaller reserve)" % (kv / MIB))
    if all(dev["backend"] == "cpu" and not dev.get("cpu") for dev in devices):
        text += "; on a CPU fleet the orchestrator's RAM can hold layers (llama_server_cpu_layers auto)"
    return text


def check_total(devices: Sequence[Mapping[str, Any]], sizing: Mapping[str, Any], ctx: int) -> None:
    """PlanError when the model at this context needs more than all the devices have."""
    compute = sum(dev["compute_mib"] for dev in devices) * MIB
    need = sum(sizing["costs"]) + compute
    have = sum(dev["usable_mib"] for dev in devices) * MIB
    if need > have:
        weights = sum(sizing["layer_bytes"]) + sizing["output_bytes"]
        raise PlanError("the model at ctx_size %d needs %.1f GiB (weights %.1f, KV %.1f, compute %.1f), the "
                        "fleet has %.1f GiB free on %d devices, %.0f MiB short: add hosts or lower ctx_size "
                        "(llama_server_ctx_size)%s"
                        % (ctx, need / GIB, weights / GIB, sum(sizing["kv"]) / GIB, compute / GIB, have / GIB,
                           len(devices), (need - have) / MIB, shortfall(devices, sizing)))


def _does_not_pack(devices: Sequence[Mapping[str, Any]], sizing: Mapping[str, Any], ctx: int) -> PlanError:
    costs = sizing["costs"]
    need = sum(costs) + sum(dev["compute_mib"] for dev in devices) * MIB
    have = sum(dev["usable_mib"] for dev in devices) * MIB
    return PlanError("the model at ctx_size %d needs %.1f GiB and the fleet has %.1f GiB free, but its layers (up "
                     "to %.0f MiB each, the output layer %.0f MiB on the last device) do not pack into the devices "
                     "in llama.cpp's order (%s): add hosts or lower ctx_size (llama_server_ctx_size)%s"
                     % (ctx, need / GIB, have / GIB, max(costs) / MIB, costs[-1] / MIB, describe_devices(devices),
                        shortfall(devices, sizing)))


def _by_memory(policy: str, devices: Sequence[Mapping[str, Any]], sizing: Mapping[str, Any],
               ctx: int) -> list[int]:
    for dev in devices:
        check_capacity(dev)
    check_total(devices, sizing, ctx)
    capacities = [dev["capacity"] for dev in devices]
    if policy == "fewest_hops":
        found = fewest_hops_counts(devices, sizing["costs"])
    else:
        found = balanced_counts(sizing["costs"], capacities)
    if found is None:
        raise _does_not_pack(devices, sizing, ctx)
    return found


def choose_split(policy: str, devices: Sequence[Mapping[str, Any]], sizing: Mapping[str, Any], ctx: int,
                 tensor_split: Sequence[Any] | None = None) -> dict[str, Any]:
    """Step 3 of split_plan.plan_split: units per device under ``policy`` (or the manual ``tensor_split``), and why.

    Returns ``{"policy": what made the split (balanced, even, fewest_hops, fit
    or manual), "requested": the policy asked for, "counts": units per device
    (None for fit), "estimates": {policy: estimate_ms or None} for the plans
    compared, "reason": one line}``.
    """
    costs = sizing["costs"]
    result: dict[str, Any] = {"policy": policy, "requested": policy, "estimates": {}, "reason": ""}
    if tensor_split is not None:
        counts = manual_counts(tensor_split, devices, sizing["n_layer"])
        check_counts_fit(devices, counts, costs, "tensor_split (llama_server_tensor_split)",
                         "lower its value, or leave tensor_split unset to let the planner split by memory")
        result.update(policy="manual", counts=counts, reason="tensor_split given: %s -> units %s"
                      % (list(tensor_split), counts))
    elif policy == "fit":
        result.update(counts=None, reason="llama.cpp fits the model to the devices' free memory at load time "
                                          "(no -ts, no -ngl, --fit on)")
    elif policy == "even":
        counts = even_counts(len(devices), sizing["n_layer"])
        check_counts_fit(devices, counts, costs, "policy even",
                         "use policy balanced, which splits by memory")
        result.update(counts=counts, reason="even: the same number of units on every device")
    else:
        counts = _by_memory(policy, devices, sizing, ctx)
        result.update(counts=counts, reason=_REASONS[policy])
    if result["counts"] is not None:
        result["estimates"][result["policy"]] = estimate_ms(devices, result["counts"], costs)
    if policy == "balanced" and tensor_split is None:
        _prefer_fewer_hops(result, devices, sizing, ctx)
    return result


_REASONS = {
    "balanced": "balanced: units spread to minimise sum(bytes^2 / capacity), i.e. bytes in proportion to each "
                "device's usable memory less its compute margin (the output matrix counted)",
    "fewest_hops": "fewest_hops: the fewest RPC devices that hold the model, most memory first, balanced among them",
}


def worth_fewer_hops(balanced_ms: float, fewest_ms: float) -> bool:
    """Whether the fewest_hops plan's estimate beats balanced's by the margin (FEWER_HOPS_MIN_GAIN, _MS)."""
    gain = balanced_ms - fewest_ms
    return gain >= FEWER_HOPS_MIN_GAIN_MS and gain >= FEWER_HOPS_MIN_GAIN * balanced_ms


def _prefer_fewer_hops(result: dict[str, Any], devices: Sequence[Mapping[str, Any]], sizing: Mapping[str, Any],
                       ctx: int) -> None:
    """Switch a balanced split to fewest_hops when the measured round trips make that one faster."""
    mine = result["estimates"]["balanced"]
    if mine is None:
        return
    counts = _by_memory("fewest_hops", devices, sizing, ctx)
    theirs = estimate_ms(devices, counts, sizing["costs"])
    result["estimates"]["fewest_hops"] = theirs
    if theirs is not None and worth_fewer_hops(mine["total_ms"], theirs["total_ms"]):
        result.update(policy="fewest_hops", counts=counts,
                      reason="balanced -> fewest_hops: %d hop(s), est. %.2f ms/token, against %d hop(s), est. "
                             "%.2f ms/token for the balanced split (measured round trips)"
                             % (theirs["hops"], theirs["total_ms"], mine["hops"], mine["total_ms"]))
