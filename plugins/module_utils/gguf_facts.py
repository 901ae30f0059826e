# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The facts about a model that the split planner needs, computed from its GGUF header (read by gguf.py).

:func:`model_facts`: layers, widths, heads, each layer's tensor bytes, the output and embedding
bytes, the KV cache per token and the sliding window; :func:`architecture`: the model's
architecture, checked to carry the keys the planner cannot do without.

Stdlib only: shared by the Ansible modules (as module_utils) and the ``llamafleet`` library
(as ``llamafleet.core.gguf_facts``).
"""

from __future__ import annotations

import re
from typing import Any

from .gguf import ArraySummary, GGUFError, GGUFModel, ModelPaths, read_model

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")

# Sliding-window attention: the pattern llama.cpp assumes for an architecture when
# the file carries no <arch>.attention.sliding_window_pattern (src/models/*.cpp).
_DEFAULT_SWA_PATTERN: dict[str, int] = {
    "gemma2": 2,
    "gemma3": 6,
    "gemma3n": 5,
    "gemma-embedding": 6,
    "cohere2": 4,
    "exaone4": 4,
    "gpt-oss": 2,
}

# The keys <arch>.KEY that model_facts() cannot do without (llama.cpp requires them too).
ARCH_KEYS = ("block_count", "embedding_length")

# model_facts() parses metadata arrays up to this length and summarises longer
# ones (tokenizer vocabularies): per-layer arrays are far shorter. Headers read over
# HTTP ranges (fetch.py) are parsed with the same limit, so facts_of_model() gives the
# same facts from them.
FACTS_ARRAY_LIMIT = 65536


def architecture(metadata: dict[str, Any], path: str) -> str:
    """``general.architecture``, checked to have the keys the split planner needs (:data:`ARCH_KEYS`).

    :raises GGUFError: no architecture, or one without those keys: an architecture the
        planner (and llama.cpp) does not know, or a file without its hyperparameters.
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError("%s: required metadata key general.architecture is missing" % path)
    missing = ["%s.%s" % (arch, key) for key in ARCH_KEYS if "%s.%s" % (arch, key) not in metadata]
    if missing:
        raise GGUFError("%s: required metadata %s %s %s missing for general.architecture %r: an architecture the "
                        "planner does not know, or a file without its hyperparameters"
                        % (path, "key" if len(missing) == 1 else "keys", " and ".join(missing),
                           "is" if len(missing) == 1 else "are", arch))
    return arch


def _get_int(metadata: dict[str, Any], key: str, path: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if value is None:
        raise GGUFError("%s: required metadata key %s is missing" % (path, key))
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError("%s: metadata key %s is %r, expected an integer" % (path, key, value))
    return value


def _per_layer(metadata: dict[str, Any], key: str, n_layer: int, default: int, path: str) -> list[int]:
    """A hyperparameter that is either one integer or an array with one value per layer."""
    value = metadata.get(key, default)
    if isinstance(value, list):
        if len(value) != n_layer or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise GGUFError("%s: %s is an array of %d values, expected %d integers (one per layer)"
                            % (path, key, len(value), n_layer))
        return list(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError("%s: metadata key %s is %r, expected an integer or a per-layer array" % (path, key, value))
    return [value] * n_layer


def _sliding_window(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    n_swa = metadata.get("%s.attention.sliding_window" % arch)
    if not isinstance(n_swa, int) or isinstance(n_swa, bool) or n_swa <= 0:
        return None
    pattern = metadata.get("%s.attention.sliding_window_pattern" % arch, _DEFAULT_SWA_PATTERN.get(arch))
    if isinstance(pattern, ArraySummary):
        pattern = None
    return {"n_swa": n_swa, "pattern": pattern}


def model_facts(paths: ModelPaths) -> dict[str, Any]:
    """The facts about a model that the split planner needs, from its GGUF header.

    Returns a dict with exactly these keys:

    - ``arch``: general.architecture, e.g. ``llama``.
    - ``n_layer``, ``n_embd``, ``n_ctx_train``: block_count, embedding_length, context_length (0 if absent).
    - ``n_head``, ``n_head_kv``: attention heads and KV heads; when the file has per-layer
      arrays, the largest value (0 for a model without attention).
    - ``n_embd_k_gqa``, ``n_embd_v_gqa``: lists of ``n_layer`` ints, each layer's K and V
      width per token (key_length or value_length, default n_embd / n_head, times that
      layer's KV heads).
    - ``layer_bytes``: list of ``n_layer`` ints, bytes of the tensors named ``blk.{i}.*``.
    - ``output_bytes``: the output layer, ``output.*`` plus ``output_norm.*``; when the
      model has no ``output.weight`` (tied embeddings) llama.cpp uses ``token_embd.weight``
      as the output matrix, so its size is counted here too.
    - ``token_embd_bytes``: ``token_embd.weight``, which llama.cpp keeps on the CPU.
    - ``other_bytes``: every tensor in none of the groups above (rope factors, ...,
      and ``blk.N`` with N >= n_layer).
    - ``total_tensor_bytes``, ``file_bytes``, ``tensor_count``: over all shards.
    - ``kv_bytes_per_token_f16``: sum over layers of (K width + V width) * 2 bytes.
    - ``sliding_window``: None, or ``{"n_swa": window, "pattern": int | list | None}``
      (informational: the planner sizes KV with the full context).

    KV widths follow the standard attention layout; models with compressed KV
    (MLA, e.g. deepseek2) or recurrent layers use less than this estimate.
    """
    return facts_of_model(read_model(paths, max_array_items=FACTS_ARRAY_LIMIT))


def facts_of_model(model: GGUFModel) -> dict[str, Any]:
    """:func:`model_facts` of a model whose headers are already parsed (``gguf.assemble_model`` of headers read over
    HTTP ranges, say), parsed with ``max_array_items`` :data:`FACTS_ARRAY_LIMIT`."""
    metadata = model.metadata
    first = model.paths[0]
    arch = architecture(metadata, first)

    n_layer = _get_int(metadata, "%s.block_count" % arch, first)
    n_embd = _get_int(metadata, "%s.embedding_length" % arch, first)
    n_ctx_train = _get_int(metadata, "%s.context_length" % arch, first, default=0)
    heads = _per_layer(metadata, "%s.attention.head_count" % arch, n_layer, 0, first)
    n_head_first = heads[0] if heads else 0
    kv_key = "%s.attention.head_count_kv" % arch
    heads_kv = _per_layer(metadata, kv_key, n_layer, 0, first) if kv_key in metadata else list(heads)
    default_head_dim = n_embd // n_head_first if n_head_first else 0
    key_length = _get_int(metadata, "%s.attention.key_length" % arch, first, default=default_head_dim)
    value_length = _get_int(metadata, "%s.attention.value_length" % arch, first, default=default_head_dim)
    n_embd_k_gqa = [key_length * kv for kv in heads_kv]
    n_embd_v_gqa = [value_length * kv for kv in heads_kv]

    layer_bytes = [0] * n_layer
    output_bytes = 0
    token_embd_bytes = 0
    total = 0
    for tensor in model.tensors:
        total += tensor.nbytes
        match = _LAYER_TENSOR.match(tensor.name)
        if match and int(match.group(1)) < n_layer:
            layer_bytes[int(match.group(1))] += tensor.nbytes
        elif tensor.name.startswith(("output.", "output_norm.")):
            output_bytes += tensor.nbytes
        elif tensor.name == "token_embd.weight":
            token_embd_bytes = tensor.nbytes
    other_bytes = total - sum(layer_bytes) - output_bytes - token_embd_bytes
    if model.tensor("output.weight") is None:
        output_bytes += token_embd_bytes

    return {
        "arch": arch,
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": max(heads) if heads else 0,
        "n_head_kv": max(heads_kv) if heads_kv else 0,
        "n_embd_k_gqa": n_embd_k_gqa,
        "n_embd_v_gqa": n_embd_v_gqa,
        "n_ctx_train": n_ctx_train,
        "layer_bytes": layer_bytes,
        "output_bytes": output_bytes,
        "token_embd_bytes": token_embd_bytes,
        "other_bytes": other_bytes,
        "total_tensor_bytes": total,
        "file_bytes": model.file_bytes,
        "tensor_count": len(model.tensors),
        "kv_bytes_per_token_f16": sum(k + v for k, v in zip(n_embd_k_gqa, n_embd_v_gqa)) * 2,
        "sliding_window": _sliding_window(metadata, arch),
    }
