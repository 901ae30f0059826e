# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read where llama-server put the model, from its load log.

What llama-server (commit 0c1e570) prints, and at which ``-lv`` verbosity:

* ``-lv 4`` and up (llama.cpp logs libllama's info messages at verbosity 4,
  "trace", so its default of 3 prints none of these lines)::

    llama_prepare_model_devices: using device RPC0 (10.77.0.11:50052) (unknown id) - 24105 MiB free
    load_tensors: offloaded 19/19 layers to GPU
    load_tensors: RPC0[10.77.0.11:50052] model buffer size =    39.63 MiB
    llama_kv_cache: RPC0[10.77.0.11:50052] KV buffer size =     4.00 MiB
    sched_reserve: RPC0[10.77.0.11:50052] compute buffer size =    33.57 MiB

  and the buffers of llama-server's own host, where the input embedding and
  the layers left on its CPU (``-ngl`` below the unit count) live::

    load_tensors:   CPU_Mapped model buffer size =   184.48 MiB
    load_tensors:   CPU_REPACK model buffer size =     2.81 MiB
    llama_kv_cache:        CPU KV buffer size =     8.00 MiB
    sched_reserve:        CPU compute buffer size =    20.77 MiB

  ``RPC<n>`` in ``using device`` is the device's model-wide name; in the
  buffer lines it is the device's index *on that rpc-server*, with the
  endpoint in brackets.

* ``-lv 5`` (debug) also prints one line per layer (src/llama-model.cpp)::

    load_tensors: layer   7 assigned to device RPC1, is_swa = 1

  layer ``n_layer`` is the output layer.

Lines may carry a timestamp/level prefix (``0.00.121.005 I ``) or a journal
prefix; the parser looks for the messages anywhere in a line. Stdlib only.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

_USING_DEVICE = re.compile(
    r"using device (?P<name>\S+) \((?P<desc>.*?)\) \((?P<id>[^)]*)\) - (?P<free>\d+) MiB free")
_LAYER = re.compile(r"load_tensors: layer +(?P<il>\d+) assigned to device (?P<dev>[^,\s]+)(?:, is_swa = (?P<swa>\d))?")
_OFFLOADED = re.compile(r"load_tensors: offloaded (?P<n>\d+)/(?P<m>\d+) layers to GPU")
_BUFFER = re.compile(
    r"(?P<who>load_tensors|llama_kv_cache|sched_reserve|llama_context):\s+(?P<buf>\S+)\s+"
    r"(?P<kind>model|KV|compute|output) buffer size =\s+(?P<mib>[0-9.]+) MiB")
_BUFFER_KINDS = {"model": "model", "KV": "kv", "compute": "compute", "output": "output"}
_RPC_BUFFER = re.compile(r"^RPC(?P<local>\d+)\[(?P<endpoint>[^\]]+)\]$")
_LOAD_MODE = re.compile(r"load_tensors: loading model tensors.*\(load_mode = (?P<mode>[^)]+)\)")


def _empty_load() -> dict[str, Any]:
    return {"devices": [], "layers": {}, "offloaded": None,
            "buffers": {"model": {}, "kv": {}, "compute": {}, "output": {}}, "load_mode": None}


def parse_load_log(text: str) -> dict[str, Any]:
    """Parse a llama-server load log; with several loads (a journal across restarts), the last one.

    Returns::

        {
          "devices": [{"name": "RPC0", "description": "10.77.0.11:50052", "free_mib": 24105,
                       "endpoint": "10.77.0.11:50052" | None}, ...],   # model device order
          "layers": {0: "RPC0", ..., 18: "RPC2"} | {},   # only with -lv 5
          "offloaded": [19, 19] | None,
          "buffers": {"model": {"RPC0[10.77.0.11:50052]": 39.63, "CPU_Mapped": 170.0},
                      "kv": {...}, "compute": {...}, "output": {...}},
          "load_mode": "mmap" | None,
          "loads": 1,       # how many loads the text holds
        }

    KV buffers are summed per buffer name (a model with sliding-window layers
    has two KV caches). A new load starts at a ``using device`` line that
    follows anything else than ``using device`` lines.
    """
    loads: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    in_device_block = False
    for line in text.splitlines():
        match = _USING_DEVICE.search(line)
        if match:
            if current is None or not in_device_block:
                current = _empty_load()
                loads.append(current)
            in_device_block = True
            name = match.group("name")
            desc = match.group("desc")
            current["devices"].append({
                "name": name,
                "description": desc,
                "free_mib": int(match.group("free")),
                "endpoint": desc if name.startswith("RPC") else None,
            })
            continue
        if current is None:
            continue
        in_device_block = False
        match = _LAYER.search(line)
        if match:
            current["layers"].setdefault(int(match.group("il")), match.group("dev"))
            continue
        match = _OFFLOADED.search(line)
        if match:
            current["offloaded"] = [int(match.group("n")), int(match.group("m"))]
            continue
        match = _LOAD_MODE.search(line)
        if match:
            current["load_mode"] = match.group("mode")
            continue
        match = _BUFFER.search(line)
        if match:
            table = current["buffers"][_BUFFER_KINDS[match.group("kind")]]
            table[match.group("buf")] = round(table.get(match.group("buf"), 0.0) + float(match.group("mib")), 2)
    result = loads[-1] if loads else _empty_load()
    result["loads"] = len(loads)
    return result


def device_for_buffer(buffer_name: str, devices: Sequence[Mapping[str, Any]]) -> str | None:
    """Model device name for a buffer name: ``RPC1[10.0.0.3:50052]`` -> the 2nd device of that endpoint.

    Local buffers are named like their device (``CUDA0``); CPU buffers
    (``CPU``, ``CPU_Mapped``) map to None.
    """
    match = _RPC_BUFFER.match(buffer_name)
    if match:
        on_endpoint = [d["name"] for d in devices if d.get("endpoint") == match.group("endpoint")]
        index = int(match.group("local"))
        return on_endpoint[index] if index < len(on_endpoint) else None
    for dev in devices:
        if dev["name"] == buffer_name:
            return dev["name"]
    return None


def layer_counts(parsed: Mapping[str, Any]) -> list[int]:
    """Units (layers + output) per model device, in device order, from the ``-lv 5`` layer lines.

    Units the log assigns to the CPU are not counted. Raises ValueError if
    the log has no per-layer lines (it was written below ``-lv 5``).
    """
    if not parsed["layers"]:
        raise ValueError("the log has no 'layer N assigned to device' lines: run llama-server with -lv 5")
    names = [d["name"] for d in parsed["devices"]]
    counts = [0] * len(names)
    for dummy, dev in sorted(parsed["layers"].items()):
        if dev in names:
            counts[names.index(dev)] += 1
    return counts


def layer_ranges(parsed: Mapping[str, Any]) -> dict[str, list[int]]:
    """Device name -> the sorted unit indices it holds (``-lv 5`` logs)."""
    result: dict[str, list[int]] = {}
    for il, dev in sorted(parsed["layers"].items()):
        result.setdefault(dev, []).append(il)
    return result


def buffers_by_device(parsed: Mapping[str, Any], kind: str = "model") -> dict[str, float]:
    """Buffer sizes (MiB) of one kind keyed by model device name (``RPC2``, ``CUDA0``); CPU buffers under ``CPU``.

    The end-to-end tests compare the ``model`` buffers with the plan's ``weights_mib``.
    """
    result: dict[str, float] = {}
    for buffer_name, mib in parsed["buffers"][kind].items():
        name = device_for_buffer(buffer_name, parsed["devices"]) or "CPU"
        result[name] = round(result.get(name, 0.0) + mib, 2)
    return result


def compare_with_plan(plan: Mapping[str, Any], parsed: Mapping[str, Any]) -> list[str]:
    """Differences between a split plan and what llama.cpp did; empty when they agree.

    Compares the device order and names, and, when the log has them, the
    units per device (``-lv 5``) or else the ``offloaded N/M`` total. A plan
    of split policy ``fit`` (no ``tensor_split``) is compared by its devices
    only: llama.cpp chose the units. The end-to-end tests run it on the lab's
    deployed plan and load log.
    """
    problems = []
    logged = [(d["name"], d["endpoint"]) for d in parsed["devices"]]
    planned = [(d["name"], d.get("endpoint")) for d in plan["devices"]]
    if logged != planned:
        problems.append("device order: plan %s, llama.cpp %s" % (planned, logged))
        return problems
    if plan.get("tensor_split") is None:
        return problems
    if parsed["layers"]:
        counts = layer_counts(parsed)
        want = [d["layers"]["count"] for d in plan["devices"]]
        if counts != want:
            problems.append("units per device: plan %s, llama.cpp %s" % (want, counts))
    if parsed["offloaded"] is not None and parsed["offloaded"][0] != plan["ngl"]:
        problems.append("offloaded layers: plan %d, llama.cpp %d/%d"
                        % (plan["ngl"], parsed["offloaded"][0], parsed["offloaded"][1]))
    return problems


# How far llama.cpp's buffers may be from the plan's figures before buffers_against_plan names a device. The model
# buffers: the tolerance the end-to-end tests have always used (a tensor's padding, the planner's 0.1 MiB rounding).
# The KV buffers: the planner computes them as llama.cpp does (cells x row size per layer), so only rounding is left.
MODEL_TOLERANCE = (3.0, 64.0)  # percent of the planned figure, or MiB, whichever is larger
KV_TOLERANCE = (2.0, 1.0)
COMPUTE_MARGIN_VARIABLE = "llama_server_compute_margin_mib"


def _off(planned: float, logged: float, tolerance: tuple[float, float]) -> bool:
    pct, mib = tolerance
    return abs(logged - planned) > max(planned * pct / 100.0, mib)


def _cpu_model_buffers(parsed: Mapping[str, Any]) -> tuple[float, float]:
    """(model MiB, repacked MiB) of llama-server's host. With mmap the ``CPU_Mapped`` buffer spans every tensor
    of the host's in the file, those repacked too, and ``CPU_REPACK`` holds a second, repacked copy of some: the
    model figure leaves it out. Without mmap the ``CPU`` buffer holds only the tensors not repacked: the two add up."""
    model = repack = 0.0
    for buffer_name, mib in parsed["buffers"]["model"].items():
        if device_for_buffer(buffer_name, parsed["devices"]) is not None:
            continue
        if buffer_name.endswith("_REPACK"):
            repack += mib
        else:
            model += mib
    if parsed.get("load_mode") != "mmap":
        model += repack
    return round(model, 2), round(repack, 2)


def buffers_against_plan(plan: Mapping[str, Any],
                         parsed: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """llama.cpp's model, KV and compute buffers per device against the plan's figures: ``(rows, problems)``.

    One row per planned device, then ``CPU``: llama-server's host, whose planned weights are the tensors that
    stay there (``host_mib``) and the layers the plan leaves on its CPU (the plan's ``cpu`` entry), with their KV
    cache and compute margin::

        {"device": "RPC0", "host": "lab2",
         "planned_weights_mib": 50.7, "planned_kv_mib": 34.0, "planned_compute_mib": 64.0,   # the plan's
         "model_mib": 50.68, "kv_mib": 34.0, "compute_mib": 17.52}                          # llama.cpp's

    (``repack_mib`` too on the CPU row: the repacked copies llama.cpp's CPU backend makes of some weights, which
    the plan does not count.) ``problems`` names each device whose model buffer is off its planned weights (by
    :data:`MODEL_TOLERANCE`), whose KV buffer is off the planned KV (:data:`KV_TOLERANCE`) or whose compute buffer
    exceeds its planned margin, and a log without the buffer lines (llama-server below ``-lv 4``); empty when they
    agree. Devices whose units llama.cpp chose (split policy ``fit``) have no planned figures: reported only. The
    host's compute buffer is compared only when the plan gives its CPU layers (and so a margin).
    """
    problems = []
    for kind, words in (("model", "model"), ("kv", "KV"), ("compute", "compute")):
        if not parsed["buffers"][kind]:
            problems.append("llama.cpp's log has no %s buffer lines: run llama-server with -lv 4 or more" % words)
    if problems:
        return [], problems
    logged = {kind: buffers_by_device(parsed, kind) for kind in ("model", "kv", "compute")}
    logged["model"]["CPU"], repack = _cpu_model_buffers(parsed)
    rows = []
    for dev in plan["devices"]:
        rows.append({"device": dev["name"], "host": dev.get("host"), "planned_weights_mib": dev.get("weights_mib"),
                     "planned_kv_mib": dev.get("kv_mib"), "planned_compute_mib": dev.get("compute_mib")})
    cpu = plan.get("cpu") or {}
    rows.append({"device": "CPU", "host": plan.get("orchestrator"),
                 "planned_weights_mib": round(float(plan.get("host_mib") or 0.0) + cpu.get("weights_mib", 0.0), 1),
                 "planned_kv_mib": cpu.get("kv_mib", 0.0), "planned_compute_mib": cpu.get("compute_mib"),
                 "repack_mib": repack})
    for row in rows:
        name = row["device"]
        row.update(model_mib=logged["model"].get(name, 0.0), kv_mib=logged["kv"].get(name, 0.0),
                   compute_mib=logged["compute"].get(name, 0.0))
        where = "%s (%s)" % (name, row["host"]) if row["host"] else name
        planned_weights = row["planned_weights_mib"]
        if planned_weights is not None and _off(planned_weights, row["model_mib"], MODEL_TOLERANCE):
            problems.append("%s: model buffers %.1f MiB, the plan's weights %.1f MiB"
                            % (where, row["model_mib"], planned_weights))
        if row["planned_kv_mib"] is not None and _off(row["planned_kv_mib"], row["kv_mib"], KV_TOLERANCE):
            problems.append("%s: KV buffers %.1f MiB, the plan's KV %.1f MiB"
                            % (where, row["kv_mib"], row["planned_kv_mib"]))
        if row["planned_compute_mib"] is not None and row["compute_mib"] > row["planned_compute_mib"]:
            problems.append("%s: compute buffer %.1f MiB, over the plan's margin of %.1f MiB (%s)"
                            % (where, row["compute_mib"], row["planned_compute_mib"], COMPUTE_MARGIN_VARIABLE))
    named = {row["device"] for row in rows}
    for kind in ("model", "kv", "compute"):
        for name, mib in sorted(logged[kind].items()):
            if name not in named and mib > 0:
                problems.append("%s: a %s buffer of %.1f MiB on a device the plan does not name"
                                % (name, kind, mib))
    return rows, problems
