# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A worker's share of the model in its rpc-server cache, and a whole model file received in pieces.

The controller sends each tensor of a worker's share (module_utils/model_share.py) as a file; this side:

- :func:`inspect_share`: which of the share's cache files are here and verified (their sha256 is the
  manifest's), which are missing, and the free space; the cache directory and its ``incoming`` folder made
  private to the rpc-server user;
- :func:`install_files`: each received file checked against the manifest's sha256 (and, given the
  ``llamafleet-fnv1a64`` helper, its FNV-1a 64 name), then published under its 16-hex name by
  rpc_cache's atomic publish (owner the service user, mode 0600);
- :func:`prune_share`: cache files no kept share needs, and what an interrupted transfer left, removed.

A file verified once is remembered in ``.llamafleet-verified.json`` by its size, mtime, ctime and inode, so a
later deploy does not hash it again; any change to the file makes it verified anew.

:func:`receive_state` and :func:`publish_received` are module model_receive's ends of a whole model file
streamed into ``NAME.part`` (receive_stream.py writes and checks it): where a run resumes, and the file put in
place once the whole of it has its pinned sha256.

Stdlib only (``llamafleet.core.cache_share`` in the library).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any, Iterable, Mapping, Sequence

from .checksum import sha256_hex, write_marker, verify_in_place
from .fnv import hash_ranges
from .receive_stream import read_record, record_path
from .rpc_cache import CACHE_FILE_MODE, CACHE_NAME, CacheEntry, CacheError, SeedResult, _Seeder

INCOMING = ".llamafleet-incoming"

# The options of rpc_cache_share and model_receive that the controller's action plugin takes (and passes on):
# one list for the module's argument_spec and the action plugin's validation.
SHARE_OPTIONS: dict[str, dict[str, Any]] = dict(
    state=dict(type="str", default="present", choices=["present", "checked", "absent_others"]),
    host=dict(type="str"),
    model=dict(type="list", elements="path"),
    sha256=dict(type="list", elements="str"),
    threshold=dict(type="int", default=10485760),
    hasher=dict(type="path"),
    plan=dict(type="dict"),
    workers=dict(type="list", elements="dict"),
    degraded=dict(type="list", elements="dict", default=[]),
    degraded_ahead=dict(type="bool", default=True),
    cache_dir=dict(type="path", required=True),
    owner=dict(type="str"),
    group=dict(type="str"),
    worker_hasher=dict(type="path"),
    free_margin_mib=dict(type="int", default=1024),
    label=dict(type="str", default="llama_server_share_degraded"),
)
SHARE_REQUIRED = ("host", "model", "sha256", "plan", "workers")
RECEIVE_OPTIONS: dict[str, dict[str, Any]] = dict(
    src=dict(type="path"),
    dest=dict(type="path", required=True),
    sha256=dict(type="str", required=True, no_log=False),
    piece_mib=dict(type="int", default=256),
    owner=dict(type="str"),
    group=dict(type="str"),
    mode=dict(type="raw", default="0644"),
    free_margin_mib=dict(type="int", default=1024),
    label=dict(type="str", default="model_dir"),
)
VERIFIED_NAME = ".llamafleet-verified.json"


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class Verified:
    """The cache files verified before: name -> sha256 and the stat signature it had then."""

    def __init__(self, cache_dir: str) -> None:
        self.path = os.path.join(cache_dir, VERIFIED_NAME)
        self.records: dict[str, Any] = {}
        self.dirty = False
        try:
            with open(self.path, encoding="utf-8") as handle:
                data = json.load(handle)
            if isinstance(data, dict):
                self.records = data
        except (OSError, ValueError):
            self.records = {}

    def check(self, path: str, name: str, size: int, sha256: str) -> bool:
        """Whether the cache file ``path`` holds ``size`` bytes with ``sha256`` (remembered, else hashed)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        record = self.records.get(name)
        if isinstance(record, dict) and record.get("sha256") == sha256 and record.get("stat") == _signature(st):
            return True
        if sha256_hex(path) != sha256:
            return False
        self.remember(path, name, sha256)
        return True

    def remember(self, path: str, name: str, sha256: str) -> None:
        self.records[name] = {"sha256": sha256, "stat": _signature(os.lstat(path))}
        self.dirty = True

    def keep_only(self, names: Iterable[str]) -> None:
        keep = set(names)
        for name in list(self.records):
            if name not in keep:
                del self.records[name]
                self.dirty = True

    def save(self, uid: int, gid: int) -> None:
        if not self.dirty:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(self.records, handle, sort_keys=True)
        os.chmod(tmp, CACHE_FILE_MODE)
        if uid >= 0 or gid >= 0:
            os.chown(tmp, uid, gid)
        os.replace(tmp, self.path)
        self.dirty = False


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the file system that holds ``path`` (or would)."""
    probe = os.path.abspath(path)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def _seeder(cache_dir: str, uid: int, gid: int, check_mode: bool) -> tuple[_Seeder, SeedResult]:
    result = SeedResult(hasher="sha256")
    return _Seeder(cache_dir, uid, gid, lambda path, ranges: [], check_mode, result), result


def _private_dir(path: str, uid: int, gid: int) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    if uid >= 0 or gid >= 0:
        os.chown(path, uid, gid)


def inspect_share(cache_dir: str, entries: Sequence[Mapping[str, Any]], uid: int = -1, gid: int = -1,
                  check_mode: bool = False) -> dict[str, Any]:
    """What the cache holds of ``entries`` (model_share.share_entries): ``present``, ``missing`` (names),
    ``missing_bytes``, ``free_bytes``, ``incoming`` (the folder files are sent to), ``changed`` and ``settled``
    (every entry there and verified before, nothing to fix: an inspect without check mode would change nothing)."""
    seeder, result = _seeder(cache_dir, uid, gid, check_mode)
    seeder.ensure_dir()
    verified = Verified(cache_dir)
    present, missing = [], []
    for entry in entries:
        target = os.path.join(cache_dir, entry["name"])
        if seeder.dir_exists and verified.check(target, entry["name"], entry["size"], entry["sha256"]):
            present.append(entry["name"])
            seeder.fix_owner(CacheEntry(entry["name"], entry["size"], "", 0, ()))
        else:
            missing.append(entry["name"])
    incoming = os.path.join(cache_dir, INCOMING)
    # nothing to send, fix or remember: an inspect without check mode would change nothing either
    settled = not missing and not result.changed and not verified.dirty and os.path.isdir(incoming)
    if not check_mode:
        _private_dir(incoming, uid, gid)
        verified.save(uid, gid)
    by_name = {e["name"]: e for e in entries}
    return {"changed": result.changed, "present": present, "missing": missing,
            "missing_bytes": sum(by_name[n]["size"] for n in missing), "free_bytes": free_bytes(cache_dir),
            "incoming": incoming, "settled": settled}


def _check_received(path: str, entry: Mapping[str, Any], hasher: str | None) -> None:
    size = os.path.getsize(path)
    tensors = ", ".join(entry.get("tensors") or [entry["name"]])
    if size != entry["size"]:
        raise CacheError("%s (tensors %s): received %d bytes, the manifest has %d"
                         % (entry["name"], tensors, size, entry["size"]))
    got = sha256_hex(path)
    if got != entry["sha256"]:
        raise CacheError("%s (tensors %s): received bytes have sha256 %s, the manifest has %s"
                         % (entry["name"], tensors, got, entry["sha256"]))
    if hasher:
        name = hash_ranges(path, [(0, size)], helper=hasher)[0]
        if name != entry["name"]:
            raise CacheError("%s (tensors %s): the received bytes hash to cache name %s"
                             % (entry["name"], tensors, name))


def install_files(cache_dir: str, files: Sequence[Mapping[str, Any]], uid: int = -1, gid: int = -1,
                  hasher: str | None = None, check_mode: bool = False) -> dict[str, Any]:
    """Publish each received file (``{path, name, size, sha256, tensors}``) under its cache name once its bytes
    are the manifest's; ``installed`` names and ``installed_bytes``. A file that fails is removed and reported
    (CacheError names its tensors); those before it stay installed."""
    seeder, _result = _seeder(cache_dir, uid, gid, check_mode)
    verified = Verified(cache_dir)
    installed = []
    try:
        for item in files:
            if not CACHE_NAME.match(item["name"]):
                raise CacheError("%r is not a cache file name (16 lowercase hex digits)" % item["name"])
            if check_mode:
                installed.append(item["name"])
                continue
            source = item["path"]
            try:
                _check_received(source, item, hasher)
                entry = CacheEntry(item["name"], item["size"], source, 0, tuple(item.get("tensors") or ()))
                if os.path.dirname(os.path.abspath(source)) == os.path.join(cache_dir, INCOMING):
                    os.chmod(source, CACHE_FILE_MODE)
                    if uid >= 0 or gid >= 0:
                        os.chown(source, uid, gid)
                    os.replace(source, os.path.join(cache_dir, item["name"]))
                else:  # sent to the connection's temporary folder: copied in by the atomic publish
                    seeder.hasher = lambda path, ranges, want=item["name"]: [want]
                    seeder.publish(entry)
            finally:
                if os.path.lexists(source):
                    os.unlink(source)
            verified.remember(os.path.join(cache_dir, item["name"]), item["name"], item["sha256"])
            installed.append(item["name"])
    finally:
        if not check_mode:
            verified.save(uid, gid)
    by_name = {f["name"]: f for f in files}
    return {"changed": bool(installed), "installed": installed,
            "installed_bytes": sum(by_name[n]["size"] for n in installed)}


def prune_share(cache_dir: str, keep: Iterable[str], uid: int = -1, gid: int = -1,
                check_mode: bool = False) -> dict[str, Any]:
    """Remove the cache files not in ``keep``, temporary files of interrupted runs and the incoming folder's
    leftovers; ``pruned_files`` and ``pruned_bytes``."""
    keep = set(keep)
    seeder, result = _seeder(cache_dir, uid, gid, check_mode)
    if not seeder.dir_exists:
        return {"changed": False, "pruned_files": [], "pruned_bytes": 0}
    seeder.prune(keep, seeder.existing())
    incoming = os.path.join(cache_dir, INCOMING)
    if os.path.isdir(incoming):
        for entry in os.scandir(incoming):
            result.pruned_files.append("%s/%s" % (INCOMING, entry.name))
            result.pruned_bytes += entry.stat(follow_symlinks=False).st_size
            result.changed = True
            if not check_mode:
                os.unlink(entry.path)
    if not check_mode:
        verified = Verified(cache_dir)
        verified.keep_only(keep)
        verified.save(uid, gid)
    return {"changed": result.changed, "pruned_files": result.pruned_files, "pruned_bytes": result.pruned_bytes}


# A whole model file, streamed -------------------------------------------------------------------------------

def receive_state(target: str, size: int, sha256: str, piece_size: int, check_mode: bool = False) -> dict[str, Any]:
    """Whether ``target`` is in place with ``sha256`` (``verified``) and, if not, the offset its ``.part``
    claims to hold (``offset``, checked by the receiver before it resumes), the bytes it takes on disk
    (``missing_bytes``), ``free_bytes`` and the host's Python (``python``, which runs the receiver)."""
    if not check_mode:
        os.makedirs(os.path.dirname(target) or ".", mode=0o755, exist_ok=True)
    free = free_bytes(target)
    if verify_in_place(target, sha256, record=not check_mode):
        return {"verified": True, "offset": size, "missing_bytes": 0, "free_bytes": free}
    record = read_record(target + ".part", size, sha256, piece_size)
    offset = min(len(record["digests"]) * piece_size, size) if record else 0
    return {"verified": False, "offset": offset, "missing_bytes": size if record is None else 0,
            "free_bytes": free, "python": sys.executable}


def publish_received(target: str, size: int, sha256: str, piece_size: int) -> dict[str, Any]:
    """Put ``target.part`` in place once the receiver found its whole sha256 the pinned one and it has not
    changed since (``published``); CacheError otherwise."""
    part = target + ".part"
    record = read_record(part, size, sha256, piece_size)
    try:
        st = os.stat(part)
    except FileNotFoundError:
        st = None
    if record is None or record.get("whole") != sha256 or st is None or \
            record.get("stat") != [st.st_size, st.st_mtime_ns, st.st_ino]:
        raise CacheError("%s: the received file is not whole with sha256 %s (or changed since it was checked); it "
                         "is sent again on the next run" % (target, sha256))
    os.replace(part, target)
    os.unlink(record_path(part))
    write_marker(target, sha256)
    return {"published": True}
