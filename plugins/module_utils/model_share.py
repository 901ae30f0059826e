# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which of a model's tensors each worker needs, and the manifest that names and pins them.

The **manifest** is computed once from the verified whole model (on the controller, beside the file): for
every tensor its name, shard, offset, size and sha256, and for those over rpc-server's hash threshold the
cache file name rpc-server will ask for (FNV-1a 64 of the raw bytes, module fnv). It is cached next to the
model as JSON and trusted while the model's sha256 list and the threshold are the same.

A worker's **share** is pure logic over a plan (``rpc``, ``tensor_split``) and the workers' endpoints
(``host``, ``address``, ``port``, ``devices``): llama.cpp gives unit ``il`` (a layer, or the output layer
last) to the device split_units.assign_layers says, devices being every RPC endpoint's devices in ``--rpc``
order, then the orchestrator's GPUs. A host's share is the cached tensors of the units on its devices:
``blk.N.*`` of its layers; ``output.*`` and ``output_norm.*`` with the output layer, and ``token_embd.weight``
there too when the model has no ``output.weight`` (tied embeddings: llama.cpp loads a duplicate of the input
embedding as the output matrix; the input embedding itself stays on the orchestrator's CPU). A plan left to
llama.cpp's fit (no ``tensor_split``) could put any layer anywhere: every host in its ``--rpc`` gets every
layer and output tensor.

Stdlib only: shared by the modules, the action plugins and ``llamafleet.core.model_share``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Any, Callable, Iterable, Mapping, Sequence

from .fnv import hash_ranges
from .gguf import GGUFError, ModelPaths, read_model
from .gguf_facts import architecture
from .split_devices import worker_endpoint
from .split_units import PlanError, assign_layers

MANIFEST_VERSION = 1
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
_CHUNK = 8 << 20


class ShareError(Exception):
    """A manifest or a share could not be computed; the message names the file, plan or host."""


def manifest_path(first_file: str, threshold: int) -> str:
    """Where the manifest of the model whose first file is ``first_file`` is cached: beside it."""
    return os.path.join(os.path.dirname(first_file), ".%s.manifest-%d.json" % (os.path.basename(first_file),
                                                                               threshold))


def _sha256_ranges(path: str, ranges: Sequence[tuple[int, int]]) -> list[str]:
    digests = []
    with open(path, "rb") as handle:
        for offset, length in ranges:
            digest = hashlib.sha256()
            handle.seek(offset)
            left = length
            while left:
                block = handle.read(min(_CHUNK, left))
                if not block:
                    raise ShareError("%s ended inside the tensor at offset %d (%d bytes)" % (path, offset, length))
                digest.update(block)
                left -= len(block)
            digests.append(digest.hexdigest())
    return digests


def build_manifest(model: ModelPaths, sha256: Sequence[str], threshold: int,
                   hasher: Callable[[str, Sequence[tuple[int, int]]], list] | None = None) -> dict[str, Any]:
    """The manifest of a verified model (``sha256``: the pinned digest of each file, in shard order).

    ``hasher(path, ranges)`` gives the FNV-1a 64 names (default: fnv.hash_ranges, the C helper when found).
    """
    hasher = hasher or hash_ranges
    try:
        loaded = read_model(model, max_array_items=0)
        arch = architecture(loaded.metadata, loaded.paths[0])
    except GGUFError as exc:
        raise ShareError(str(exc)) from exc
    n_layer = loaded.metadata.get("%s.block_count" % arch)
    if len(sha256) != len(loaded.paths):
        raise ShareError("%d sha256 digests for %d model files" % (len(sha256), len(loaded.paths)))
    files = [{"name": os.path.basename(p), "size": os.path.getsize(p), "sha256": s.lower()}
             for p, s in zip(loaded.paths, sha256)]
    tensors = []
    for index, path in enumerate(loaded.paths):
        group = [t for t in loaded.tensors if t.path == path]
        digests = _sha256_ranges(path, [(t.offset, t.nbytes) for t in group])
        big = [t for t in group if t.nbytes > threshold]
        names = dict(zip((t.name for t in big), hasher(path, [(t.offset, t.nbytes) for t in big]))) if big else {}
        for tensor, digest in zip(group, digests):
            tensors.append({"name": tensor.name, "file": index, "offset": tensor.offset, "size": tensor.nbytes,
                            "sha256": digest, "cache": names.get(tensor.name)})
    return {"version": MANIFEST_VERSION, "threshold": threshold, "n_layer": n_layer, "arch": arch,
            "files": files, "tensors": tensors}


def manifest_fits(manifest: Any, sha256: Sequence[str], threshold: int) -> bool:
    """Whether a cached ``manifest`` was made from the files pinned by ``sha256`` with ``threshold``."""
    return (isinstance(manifest, dict) and manifest.get("version") == MANIFEST_VERSION
            and manifest.get("threshold") == threshold
            and [f.get("sha256") for f in manifest.get("files", [])] == [s.lower() for s in sha256])


def load_or_build_manifest(model: Sequence[str], sha256: Sequence[str], threshold: int,
                           hasher: Callable[[str, Sequence[tuple[int, int]]], list] | None = None,
                           write: bool = True) -> tuple[dict[str, Any], bool]:
    """The model's manifest from its cache file when it fits, else built (and cached unless not ``write``);
    (manifest, whether it was built now)."""
    path = manifest_path(model[0], threshold)
    try:
        with open(path, encoding="utf-8") as handle:
            cached = json.load(handle)
        if manifest_fits(cached, sha256, threshold):
            return cached, False
    except (OSError, ValueError):
        pass  # no manifest yet, or an unreadable one: built again
    manifest = build_manifest(list(model), sha256, threshold, hasher)
    if write:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".manifest-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(manifest, handle, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return manifest, True


def unit_of(name: str, n_layer: int, tied_output: bool) -> int | None:
    """The split unit a tensor goes with: its layer, ``n_layer`` for the output layer, None for neither
    (the input embedding and what llama.cpp keeps on the CPU)."""
    match = _LAYER_TENSOR.match(name)
    if match:
        layer = int(match.group(1))
        return layer if layer < n_layer else None
    if name.startswith(("output.", "output_norm.")) or (tied_output and name == "token_embd.weight"):
        return n_layer
    return None


def unit_hosts(plan: Mapping[str, Any], workers: Sequence[Mapping[str, Any]], n_layer: int) -> list[set[str]]:
    """The worker hosts holding each of the ``n_layer + 1`` units under ``plan`` (``rpc``, ``tensor_split``);
    an empty set for a unit on the orchestrator's own GPUs."""
    rpc = list(plan.get("rpc") or [])
    by_endpoint: dict[str, Mapping[str, Any]] = {}
    try:
        for position, worker in enumerate(workers):
            by_endpoint[worker_endpoint(worker, position)] = worker
    except PlanError as exc:
        raise ShareError(str(exc)) from exc
    unknown = [e for e in rpc if e not in by_endpoint]
    if unknown:
        raise ShareError("the plan's --rpc has %s, which no worker serves" % ", ".join(unknown))
    split = plan.get("tensor_split")
    if split is None:  # llama.cpp fits at load time: any unit may land on any worker in --rpc
        every = {str(by_endpoint[e]["host"]) for e in rpc}
        return [set(every) for _unit in range(n_layer + 1)]
    owners: list[str | None] = []
    for endpoint in rpc:
        owners += [str(by_endpoint[endpoint]["host"])] * max(1, len(by_endpoint[endpoint].get("devices") or []))
    if len(split) < len(owners):
        raise ShareError("the plan's tensor_split has %d values for %d RPC devices" % (len(split), len(owners)))
    owners += [None] * (len(split) - len(owners))  # the orchestrator's GPUs
    try:
        devices = assign_layers([float(v) for v in split], n_layer)
    except ValueError as exc:
        raise ShareError("tensor_split %r: %s" % (list(split), exc)) from exc
    return [{owners[d]} - {None} if d >= 0 else set() for d in devices]  # type: ignore[misc]


def plan_shares(manifest: Mapping[str, Any], plan: Mapping[str, Any],
                workers: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Each worker host of ``plan`` -> the names of the cached tensors llama-server uploads to its devices
    (those with a cache name only: the smaller ones are sent at every load whatever the cache holds)."""
    n_layer = int(manifest["n_layer"])
    tied = not any(t["name"] == "output.weight" for t in manifest["tensors"])
    hosts = unit_hosts(plan, workers, n_layer)
    shares: dict[str, list[str]] = {str(w["host"]): [] for w in workers}
    for tensor in manifest["tensors"]:
        if not tensor.get("cache"):
            continue
        unit = unit_of(tensor["name"], n_layer, tied)
        if unit is None:
            continue
        for host in sorted(hosts[unit]):
            if tensor["name"] not in shares[host]:
                shares[host].append(tensor["name"])
    return shares


def fleet_shares(manifest: Mapping[str, Any], plan: Mapping[str, Any], workers: Sequence[Mapping[str, Any]],
                 degraded: Iterable[Mapping[str, Any]] = ()) -> dict[str, dict[str, list[str]]]:
    """Each worker host -> ``{"plan": [...], "degraded": [...]}``: the tensors of ``plan`` and those the
    plans in ``degraded`` (rpc_plan's entries; those that do not fit are skipped) add to them."""
    main = plan_shares(manifest, plan, workers)
    out = {host: {"plan": names, "degraded": []} for host, names in main.items()}
    for entry in degraded:
        if not entry.get("fits"):
            continue
        for host, names in plan_shares(manifest, entry, workers).items():
            have = set(out[host]["plan"]) | set(out[host]["degraded"])
            out[host]["degraded"] += [n for n in names if n not in have]
    return out


def share_entries(manifest: Mapping[str, Any], names: Iterable[str]) -> list[dict[str, Any]]:
    """The cache files for tensors ``names``: ``{name, size, sha256, tensors, file, offset}``, one per cache
    name (identical tensors share one file), in file order."""
    wanted = set(names)
    entries: dict[str, dict[str, Any]] = {}
    for tensor in manifest["tensors"]:
        if tensor["name"] not in wanted or not tensor.get("cache"):
            continue
        entry = entries.setdefault(tensor["cache"], {
            "name": tensor["cache"], "size": tensor["size"], "sha256": tensor["sha256"], "tensors": [],
            "file": tensor["file"], "offset": tensor["offset"]})
        entry["tensors"].append(tensor["name"])
    return sorted(entries.values(), key=lambda e: (e["file"], e["offset"]))


def mib(nbytes: float) -> float:
    """Bytes as MiB with one decimal, for messages."""
    return round(nbytes / 1048576.0, 1)
