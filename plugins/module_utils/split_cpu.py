# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Layers left on the orchestrator's CPU: its RAM put to use on a CPU fleet.

Read from llama.cpp commit 0c1e570 (src/llama-model.cpp, ``load_tensors``): with ``-ngl`` below the unit count
``n_layer + 1``, the first ``n_layer + 1 - ngl`` units stay on the CPU of llama-server's host, their KV cache too
(``offload_kqv`` puts a layer's cache on its device), and the ``-ts`` fractions spread the other ``ngl`` units over
the devices (:func:`split_units.assign_layers`). The output layer is the last unit, so it stays on a device
whenever ``ngl`` is 1 or more. The CPU is never a ``-ts`` entry.

The planner treats the orchestrator's CPU as a device before ``RPC0``: usable memory the CPU device's own
(gpu_facts: the tighter of /proc/meminfo and the cgroup limits above llama-server's unit, less its reserve), less
what stays there anyway (the input embedding and the other tensors no layer holds, ``host_bytes``), less its
compute margin for the compute buffer the CPU needs once it computes layers. ``cpu_layers``:

* ``auto``: on a CPU fleet (no local GPU, every worker's device a CPU) the CPU takes part in the split policy like
  any device (``balanced``: layers in proportion to what it can hold; ``fewest_hops``: it fills first, as it costs no
  network hop); with GPUs in the plan it gets none (a CPU layer is slower than a GPU's); and none under ``even``,
  ``fit`` or a manual ``tensor_split``, which split over llama.cpp's devices alone.
* ``N``: exactly the first N layers, refused when the CPU cannot hold them; the rest split by the policy.
* ``0``: none (``-ngl`` is the unit count, as before).

Stdlib only.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .split_devices import label, size_devices
from .split_units import MIB, PlanError

CPU_LAYERS_AUTO = "auto"
CPU_LAYERS_VARIABLE = "cpu_layers (llama_server_cpu_layers)"


def check_cpu_layers(value: Any, n_layer: int) -> str | int:
    """``auto`` or a layer count from 0 to ``n_layer`` (the output layer never stays on the CPU); PlanError else."""
    if isinstance(value, str) and value.strip().lower() == CPU_LAYERS_AUTO:
        return CPU_LAYERS_AUTO
    number = value
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= n_layer:
        raise PlanError("%s is %r, expected auto, 0 or a number of layers up to n_layer = %d (the output layer stays "
                        "on a device)" % (CPU_LAYERS_VARIABLE, value, n_layer))
    return number


def cpu_fleet(devices: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every device of the plan is a CPU (no local GPU, every worker's device a CPU)."""
    return bool(devices) and all(not dev["local"] and dev["backend"] == "cpu" for dev in devices)


def orchestrator_cpu(orchestrator: Mapping[str, Any] | None, workers: Sequence[Mapping[str, Any]],
                     compute_mib: int, host_bytes: int) -> dict[str, Any] | None:
    """The orchestrator's CPU as a planning device (``name`` CPU, ``local``, ``cpu`` True), sized as
    split_devices.size_devices sizes the others, its ``usable_mib`` less ``host_bytes``; None without a CPU entry."""
    if not orchestrator:
        return None
    cpus = [d for d in orchestrator.get("devices") or [] if d.get("backend") == "cpu"]
    if not cpus:
        return None
    host = str(orchestrator.get("host") or "orchestrator")
    dev: dict[str, Any] = {"position": None, "name": "CPU", "buffer_name": "CPU", "host": host, "endpoint": None,
                           "worker": None, "local": True, "backend": "cpu", "cpu": True,
                           "description": cpus[0].get("name") or "CPU", "device": cpus[0]}
    size_devices([dev], workers, compute_mib)
    dev["held_mib"] = round(host_bytes / MIB, 1)
    dev["usable_mib"] = max(int(dev["usable_mib"] - host_bytes / MIB), 0)
    dev["capacity"] = (dev["usable_mib"] - dev["compute_mib"]) * MIB
    return dev


def without_first(sizing: Mapping[str, Any], count: int) -> dict[str, Any]:
    """The sizing of the units after the first ``count`` (those on the CPU): what the devices split."""
    if not count:
        return dict(sizing)
    return dict(sizing, n_layer=sizing["n_layer"] - count, units=sizing["units"] - count,
                layer_bytes=sizing["layer_bytes"][count:], kv=sizing["kv"][count:], costs=sizing["costs"][count:])


def check_fixed(cpu: Mapping[str, Any] | None, count: int, sizing: Mapping[str, Any], host: str | None) -> None:
    """PlanError when the orchestrator's CPU cannot hold the ``count`` layers asked for."""
    if not count:
        return
    if cpu is None:
        raise PlanError("%s is %d but the orchestrator %s gave no CPU memory figures (gpu_facts with backend cpu): "
                        "set it to 0 or auto" % (CPU_LAYERS_VARIABLE, count, host or ""))
    need = sum(sizing["costs"][:count]) + cpu["compute_mib"] * MIB
    if need > cpu["usable_mib"] * MIB:
        raise PlanError("%s is %d: layers 0-%d need %.0f MiB with KV and compute margin on %s, which has %d MiB "
                        "usable after the %.0f MiB that stay there (input embedding and other tensors): lower it, or "
                        "auto" % (CPU_LAYERS_VARIABLE, count, count - 1, need / MIB, label(cpu), cpu["usable_mib"],
                                  cpu["held_mib"]))


def takes_part(setting: str | int, cpu: Mapping[str, Any] | None, devices: Sequence[Mapping[str, Any]],
               policy: str, manual: bool, sizing: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the CPU joins the split policy (``auto``), and why (a line for the explanation)."""
    if setting != CPU_LAYERS_AUTO:
        return False, "%s %s" % (CPU_LAYERS_VARIABLE, setting)
    if cpu is None:
        return False, "orchestrator CPU: no layers (no CPU memory figures given)"
    if manual or policy not in ("balanced", "fewest_hops"):
        return False, "orchestrator CPU: no layers (%s splits over llama.cpp's devices alone)" % (
            "tensor_split" if manual else "policy " + policy)
    if not cpu_fleet(devices):
        return False, "orchestrator CPU: no layers (the plan has GPUs; set %s to a number to use it)" % (
            CPU_LAYERS_VARIABLE)
    if cpu["capacity"] <= 0:
        return False, ("orchestrator CPU: no layers (%d MiB usable after the %.0f MiB that stay there, not more than "
                       "its compute margin of %d MiB)" % (cpu["usable_mib"], cpu["held_mib"], cpu["compute_mib"]))
    # the output layer stays on a device: never let the CPU hold every unit
    cpu["capacity"] = min(cpu["capacity"], sum(sizing["costs"][:-1]))
    return True, "orchestrator CPU: a device before RPC0 (%s auto on a CPU fleet)" % CPU_LAYERS_VARIABLE


def cpu_entry(cpu: Mapping[str, Any] | None, count: int, sizing: Mapping[str, Any]) -> dict[str, Any] | None:
    """The plan's ``cpu``: what stays on the orchestrator's CPU (None when it holds no layer)."""
    if cpu is None or not count:
        return None
    weights = sum(sizing["layer_bytes"][:count])
    kv = sum(sizing["kv"][:count])
    margin = cpu["compute_mib"] * MIB
    total = weights + kv + margin
    return {"name": "CPU", "host": cpu["host"], "description": cpu["description"], "free_mib": cpu["free_mib"],
            "usable_mib": cpu["usable_mib"], "held_mib": cpu["held_mib"],
            "layers": {"start": 0, "end": count, "count": count, "output": False,
                       "range": "0-%d" % (count - 1) if count > 1 else "0"},
            "weights_mib": round(weights / MIB, 1), "kv_mib": round(kv / MIB, 1),
            "compute_mib": round(margin / MIB, 1), "total_mib": round(total / MIB, 1),
            "fill_pct": round(100.0 * total / (cpu["usable_mib"] * MIB), 1) if cpu["usable_mib"] > 0 else None,
            "source": cpu["device"].get("free_source") or cpu["device"].get("source")}
