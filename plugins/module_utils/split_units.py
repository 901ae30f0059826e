# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The model as llama.cpp splits it: ``n_layer + 1`` units, their bytes, and the ``-ts`` mapping.

Read from llama.cpp commit 0c1e570:

* Layers (src/llama-model.cpp, ``load_tensors``): the repeating layers and the
  output layer form ``n_layer + 1`` units; the ``-ts`` values become float32
  cumulative fractions and unit ``i`` goes to the first device whose fraction
  is greater than ``i / (n_layer + 1)``. The output layer is therefore last, on
  the last device that receives any unit. The input embedding stays on the CPU
  of the orchestrator. :func:`layers_from_split` is that computation; integer
  unit counts always map back to themselves.
* KV cache (src/llama-context.cpp, llama-kv-cache*.cpp): ``-c`` is padded up
  to a multiple of 256 (``n_ctx``). With a unified cache (``--kv-unified``) it
  is one stream of ``n_ctx`` cells that every slot draws from, so a request
  can use up to ``n_ctx`` while the others are idle. Without it each of the
  ``-np`` slots gets a stream of ``n_ctx_seq = pad(n_ctx / np, 256)`` cells
  and ``n_ctx`` becomes ``n_ctx_seq * np`` (llama.cpp logs "rounding down",
  but the padding can make it larger than ``-c``: ``-c 4096 -np 3`` allocates
  3 x 1536 = 4608 cells). Both layouts hold the same cells when ``n_ctx`` is a
  multiple of ``256 * np``. Sliding-window layers hold
  ``pad(min(n_ctx_seq, n_swa * (np if unified else 1) + n_ubatch), 256)``
  cells per stream (llama-kv-cache-iswa.cpp): with a unified cache they grow
  with the slots, up to the whole context. llama-server caps a slot's context
  at the model's training context (server-context.cpp, ``n_ctx_slot``).
  :func:`kv_cells`, :func:`kv_bytes_per_layer`, :func:`resolve_slots`.

Stdlib only.
"""

from __future__ import annotations

import bisect
import math
import struct
from typing import Any, Mapping, Sequence

MIB = 1024 * 1024
GIB = 1024 * MIB

DEFAULT_N_UBATCH = 512
KV_PAD = 256  # llama_context pads n_ctx (and n_ctx_seq) to a multiple of 256

# Automatic slot count (n_parallel 0): with a unified KV cache, one slot per MIN_SHARED_SLOT_CTX
# tokens of context, at most MAX_AUTO_SLOTS; without one, one per MIN_SLOT_CTX (each slot owns
# its share). A unified cache is -c tokens whatever the slot count (only sliding-window layers
# grow, by n_swa per slot, up to the context, and the planner sizes them), and the compute buffer
# is reserved for one ubatch (n_ubatch tokens), not per slot; so memory does not limit the
# slots. What did: when the busy slots together outgrow a unified cache, llama-server fails every
# request in flight ("Context size has been exceeded"), so this rule once gave each slot 512
# tokens, and the big model (6.41 GiB over three 4 GiB hosts, -c 2048) got 4 slots, which kept
# 0.73 of one unlimited server's batching gain where 16 slots kept 0.94. The serving gate now
# admits a generation only when its tokens fit the cache beside those in flight (gate_budget.py,
# kv_budget below), so a slot needs only what a short request takes. Up to 16 slots batching pays
# even on CPU workers joined over RPC: on the 3-host lab (gemma, -c 4096, 16 clients of 64-token
# streams, one run) 8 slots gave 1.63x the single client's tok/s and 16 slots 2.10x, against 2.44x
# for one local llama-server with 16 slots on the same cores (benchmarks.serving_load --ceiling).
# Measured with llama-server 0c1e570, gemma-3-270m, -c 4096 on the CPU: 1 slot: KV 12 + 15 MiB
# (dense + SWA layers), compute 22.8 MiB, output 1 MiB; 8 unified slots: KV 12 + 60 MiB,
# compute 25.8 MiB, output 8 MiB (n_vocab x 4 bytes per slot, in the orchestrator's RAM).
MIN_SLOT_CTX = 512
MIN_SHARED_SLOT_CTX = 128
MAX_AUTO_SLOTS = 16
# The bound of a generation that gives none (llama-server -n), automatic: with a unified cache of several slots a
# quarter of the cache (llama-server's own automatic slot count is 4), so that four such generations share it;
# otherwise none (a slot's own share bounds it).
AUTO_BOUND_SHARE = 4
# Without a unified cache each slot owns ctx / np tokens; llama.cpp pads a smaller share up
# to 256 cells per slot (so the cache outgrows -c), and such a slot holds almost no prompt.
MIN_SPLIT_SLOT_CTX = KV_PAD
# llama_context refuses more sequences than this (LLAMA_MAX_SEQ, src/llama-cparams.h).
MAX_SLOTS = 256

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
# KV cache
# ---------------------------------------------------------------------------

def _pad(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def ctx_per_seq(ctx_size: int, n_parallel: int, kv_unified: bool = False) -> int:
    """Cells of one KV stream, llama.cpp's ``n_ctx_seq`` (src/llama-context.cpp).

    Unified: the whole padded context, which every slot shares. Otherwise each
    slot's share of it, padded up to 256.
    """
    n_ctx = _pad(ctx_size, KV_PAD)
    if kv_unified or n_parallel <= 1:
        return n_ctx
    return _pad(n_ctx // n_parallel, KV_PAD)


def _streams(n_parallel: int, kv_unified: bool) -> int:
    """KV streams (llama_kv_cache's ``n_stream``): one shared, or one per slot."""
    return 1 if kv_unified else max(n_parallel, 1)


def kv_cells(ctx_size: int, n_parallel: int, kv_unified: bool = False) -> int:
    """KV cells llama-server allocates for ``-c ctx_size -np n_parallel``: one stream, or one per slot."""
    return ctx_per_seq(ctx_size, n_parallel, kv_unified) * _streams(n_parallel, kv_unified)


def auto_slots(ctx: int, kv_unified: bool = False) -> int:
    """The slot count for ``n_parallel`` 0: ``ctx`` over ``MIN_SHARED_SLOT_CTX`` (a unified cache) or
    ``MIN_SLOT_CTX`` (a cache split per slot), between 1 and ``MAX_AUTO_SLOTS``."""
    return max(1, min(ctx // (MIN_SHARED_SLOT_CTX if kv_unified else MIN_SLOT_CTX), MAX_AUTO_SLOTS))


def shared_cache(kv_cells: int, n_parallel: int, kv_unified: bool) -> int:
    """The KV cells the serving gate guards (its ``kv_budget``): a unified cache of several slots, else 0."""
    return kv_cells if kv_unified and n_parallel > 1 else 0


def generation_bound(setting: int, kv_cells: int, n_parallel: int, kv_unified: bool) -> int:
    """llama-server's ``-n`` for ``setting`` (llama_server_max_tokens): as given when above 0; -1: none (0);
    0: automatic, a quarter of a shared cache (:data:`AUTO_BOUND_SHARE`), none without one."""
    if setting > 0:
        return setting
    cells = shared_cache(kv_cells, n_parallel, kv_unified)
    if setting < 0 or not cells:
        return 0
    return max(1, cells // AUTO_BOUND_SHARE)


def resolve_slots(ctx: int, n_parallel: int, kv_unified: bool = False, n_ctx_train: int = 0) -> dict[str, Any]:
    """llama-server's slots for context ``ctx``: ``n_parallel`` as given, or :func:`auto_slots` for 0.

    Returns ``n_parallel`` (resolved), ``n_parallel_auto``, ``kv_unified`` and
    ``slot_ctx``, the tokens one request can use: the stream it draws from
    (:func:`ctx_per_seq`), capped at the model's training context as
    llama-server caps it. Without a unified cache, a slot whose share of the
    padded context is under ``MIN_SPLIT_SLOT_CTX`` tokens is refused.
    """
    if not isinstance(kv_unified, bool):
        raise PlanError("kv_unified is %r, expected true or false (llama-server --kv-unified)" % (kv_unified,))
    auto = n_parallel == 0
    slots = auto_slots(ctx, kv_unified) if auto else n_parallel
    share = _pad(ctx, KV_PAD) // slots
    if not kv_unified and slots > 1 and share < MIN_SPLIT_SLOT_CTX:
        raise PlanError(
            "n_parallel (llama_server_parallel) %d without a unified KV cache gives each slot %d of the %d tokens of "
            "ctx_size (llama_server_ctx_size), fewer than %d: lower llama_server_parallel, raise "
            "llama_server_ctx_size to at least %d, or set llama_server_kv_unified (kv_unified) true"
            % (slots, share, ctx, MIN_SPLIT_SLOT_CTX, slots * MIN_SPLIT_SLOT_CTX))
    slot_ctx = ctx_per_seq(ctx, slots, kv_unified)
    if n_ctx_train > 0:
        slot_ctx = min(slot_ctx, n_ctx_train)
    return {"n_parallel": slots, "n_parallel_auto": auto, "kv_unified": kv_unified, "slot_ctx": slot_ctx}


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


def kv_type(name: str, option: str) -> tuple[int, int]:
    """(elements, bytes) per block of a KV cache type; PlanError naming ``option`` for an unknown one."""
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
    per stream (``n_swa * n_parallel + n_ubatch`` for the one stream of a
    unified cache), as llama_kv_cache_iswa sizes them; other layers hold every cell.
    """
    n_layer = int(facts["n_layer"])
    k_widths = _per_layer_width(facts, "n_embd_k_gqa", n_layer)
    v_widths = _per_layer_width(facts, "n_embd_v_gqa", n_layer)
    k_blk, k_bytes = kv_type(cache_type_k, "cache_type_k")
    v_blk, v_bytes = kv_type(cache_type_v or cache_type_k, "cache_type_v")
    cells = kv_cells(ctx_size, n_parallel, kv_unified)
    swa_layers = _swa_layers(facts, n_layer) if swa else None
    swa_cells = cells
    if swa_layers is not None:
        n_swa = int(facts["sliding_window"]["n_swa"])
        size_base = ctx_per_seq(ctx_size, n_parallel, kv_unified)  # a multiple of 256
        per_stream = _pad(min(size_base, n_swa * (max(n_parallel, 1) if kv_unified else 1) + n_ubatch), KV_PAD)
        swa_cells = per_stream * _streams(n_parallel, kv_unified)
    result = []
    for il in range(n_layer):
        layer_cells = swa_cells if swa_layers is not None and swa_layers[il] else cells
        k = k_widths[il] * layer_cells // k_blk * k_bytes
        v = v_widths[il] * layer_cells // v_blk * v_bytes
        result.append(k + v)
    return result


# ---------------------------------------------------------------------------
# The units of a model at a context
# ---------------------------------------------------------------------------

def check_facts(facts: Mapping[str, Any]) -> int:
    """``n_layer`` of model facts that have what the planner needs; PlanError otherwise."""
    for key in ("n_layer", "layer_bytes", "output_bytes"):
        if key not in facts:
            raise PlanError("model facts lack %r (use gguf_facts.model_facts on the model file)" % key)
    n_layer = facts["n_layer"]
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer <= 0:
        raise PlanError("model facts n_layer is %r, expected a positive integer" % (n_layer,))
    if len(facts["layer_bytes"]) != n_layer:
        raise PlanError("model facts layer_bytes has %d values, expected n_layer = %d"
                        % (len(facts["layer_bytes"]), n_layer))
    return n_layer


def size_units(facts: Mapping[str, Any], ctx_size: int, n_parallel: int = 1, cache_type_k: str = "f16",
               cache_type_v: str | None = None, kv_unified: bool = False,
               n_ubatch: int = DEFAULT_N_UBATCH) -> dict[str, Any]:
    """Bytes of each unit at this context: what the planner places.

    Returns ``n_layer``, ``units`` (``n_layer + 1``), ``layer_bytes`` (weights
    per layer), ``kv`` (KV bytes per layer), ``output_bytes``, ``costs`` (per
    unit: weights + KV; the last unit is the output matrix), ``kv_cells`` and
    ``host_bytes`` (input embedding and other tensors, which stay on the
    orchestrator's CPU).
    """
    n_layer = check_facts(facts)
    kv = kv_bytes_per_layer(facts, ctx_size, n_parallel, cache_type_k, cache_type_v, kv_unified, n_ubatch)
    layer_bytes = [int(b) for b in facts["layer_bytes"]]
    output_bytes = int(facts["output_bytes"])
    return {
        "n_layer": n_layer,
        "units": n_layer + 1,
        "layer_bytes": layer_bytes,
        "kv": kv,
        "output_bytes": output_bytes,
        "costs": [layer_bytes[i] + kv[i] for i in range(n_layer)] + [output_bytes],
        "kv_cells": kv_cells(ctx_size, n_parallel, kv_unified),
        "host_bytes": int(facts.get("token_embd_bytes") or 0) + int(facts.get("other_bytes") or 0),
    }


def range_text(start: int, count: int, n_layer: int) -> str:
    """``0-13``, ``14-17+output``, ``output`` or ``-``: the units from ``start``, the output unit named."""
    if count == 0:
        return "-"
    end = start + count - 1
    if end == n_layer:  # the last unit is the output layer
        if count == 1:
            return "output"
        return "%d-%d+output" % (start, end - 1) if end - 1 > start else "%d+output" % start
    return "%d-%d" % (start, end) if end > start else "%d" % start
