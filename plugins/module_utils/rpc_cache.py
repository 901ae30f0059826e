# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Fill an rpc-server weight cache from a local copy of the model.

When llama-server uploads a weight tensor of more than HASH_THRESHOLD bytes to
an rpc-server, it first sends the tensor's FNV-1a 64 hash. An rpc-server started
with ``-c`` that has the file ``<cache dir>/<16 hex digits>`` loads the tensor
from it and nothing more crosses the network. The hashed bytes are the tensor's
bytes exactly as stored in the GGUF file, so a worker holding a byte-identical
copy of the model can write those files itself before the first load.

rpc-server trusts those files blindly (it checks neither size nor content), so
this module only ever publishes a file whose content it has just hashed to its
name, writes it atomically (temporary file in the same directory, then
rename), and keeps the directory private to the service user.

Stdlib only (module_utils shared with the ``llamafleet`` library as ``llamafleet.core.rpc_cache``).
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import re
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from .constants import RPC_HASH_THRESHOLD
from .fnv import HashError, find_helper, hash_ranges, hash_ranges_python
from .gguf import GGUFError, ModelPaths, read_model

# ggml-rpc.cpp: a tensor goes through the hash cache when its size is > HASH_THRESHOLD
# (strictly greater) and it lives in a weights buffer.  The build records its source's own value;
# this is the fallback.
HASH_THRESHOLD = RPC_HASH_THRESHOLD

CACHE_DIR_MODE = 0o700
CACHE_FILE_MODE = 0o600
CACHE_NAME = re.compile(r"^[0-9a-f]{16}$")
TEMP_PREFIX = ".llamafleet-tmp-"
INDEX_NAME = ".llamafleet-index.json"
_INDEX_VERSION = 1
_STALE_TEMP_SECONDS = 3600
_COPY_CHUNK = 64 << 20


class CacheError(Exception):
    """The cache could not be inspected or filled; the message names the file or directory."""


@dataclass(frozen=True)
class CacheEntry:
    """One cache file a model needs: ``name`` is the hash of ``size`` bytes at ``offset`` in ``path``."""

    name: str
    size: int
    path: str
    offset: int
    tensors: tuple[str, ...]


@dataclass
class SeedResult:
    """What seed_cache did (or, in check mode, would do)."""

    changed: bool = False
    seeded_files: list[str] = field(default_factory=list)
    seeded_bytes: int = 0
    skipped_files: list[str] = field(default_factory=list)
    replaced_files: list[str] = field(default_factory=list)
    pruned_files: list[str] = field(default_factory=list)
    pruned_bytes: int = 0
    tensors_over_threshold: int = 0
    hashes: dict[str, str] = field(default_factory=dict)
    hasher: str = "python"
    warnings: list[str] = field(default_factory=list)
    diff: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for module results and JSON."""
        return asdict(self)


Hasher = Callable[[str, Sequence[tuple[int, int]]], list]


def make_hasher(helper: str | None, jobs: int = 1) -> Hasher:
    """A function hashing ranges of a file with ``helper``, or in pure Python when it is None."""
    if helper is None:
        return hash_ranges_python
    return lambda path, ranges: hash_ranges(path, ranges, helper=helper, jobs=jobs)


@dataclass
class ModelHashes:
    """The cache files a model needs."""

    entries: list[CacheEntry]
    hashes: dict[str, str]
    names_by_path: dict[str, list[str]]
    tensors_over_threshold: int


def model_hashes(model: ModelPaths, threshold: int = HASH_THRESHOLD, hasher: Hasher | None = None) -> ModelHashes:
    """Hash every tensor of ``model`` (all shards) larger than ``threshold`` bytes.

    Entries are unique by name: identical tensors share one cache file.
    ``hasher`` defaults to the helper found by fnv.find_helper, else Python.
    """
    hasher = hasher or make_hasher(find_helper())
    loaded = read_model(model, max_array_items=0)
    hashes: dict[str, str] = {}
    entries: dict[str, CacheEntry] = {}
    names_by_path: dict[str, list[str]] = {}
    count = 0
    for path in loaded.paths:
        group = [t for t in loaded.tensors if t.path == path and t.nbytes > threshold]
        count += len(group)
        names = hasher(path, [(t.offset, t.nbytes) for t in group]) if group else []
        names_by_path[path] = list(names)
        for tensor, name in zip(group, names):
            hashes[tensor.name] = name
            if name in entries:
                old = entries[name]
                entries[name] = CacheEntry(name, old.size, old.path, old.offset, old.tensors + (tensor.name,))
            else:
                entries[name] = CacheEntry(name, tensor.nbytes, path, tensor.offset, (tensor.name,))
    return ModelHashes(list(entries.values()), hashes, names_by_path, count)


def _resolve_id(kind: str, value: str | int | None) -> int:
    if value is None or value == "":
        return -1
    text = str(value)
    if text.isdigit():
        return int(text)
    try:
        if kind == "user":
            return pwd.getpwnam(text).pw_uid
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise CacheError("%s %r does not exist on this host" % (kind, text)) from None


class _Index:
    """Hashes of model files seen before, keyed by path and invalidated by any stat change.

    Used only to learn which cache files ``keep_models`` need without re-hashing them
    on every run. It never decides what a cache file contains: content is always
    hashed before a file is kept or published.
    """

    def __init__(self, cache_dir: str) -> None:
        self.path = os.path.join(cache_dir, INDEX_NAME)
        self.records: dict[str, Any] = {}
        self.dirty = False
        try:
            with open(self.path, "r", encoding="utf-8") as handle:
                data = json.load(handle)
            if data.get("version") == _INDEX_VERSION and isinstance(data.get("files"), dict):
                self.records = data["files"]
        except (OSError, ValueError, AttributeError):
            self.records = {}  # no index yet, or unreadable: rebuilt from scratch

    @staticmethod
    def _key(path: str, threshold: int) -> tuple[str, list[int]]:
        st = os.stat(path)
        return os.path.realpath(path), [st.st_size, st.st_mtime_ns, st.st_ino, threshold]

    def get(self, path: str, threshold: int) -> list[str] | None:
        real, signature = self._key(path, threshold)
        record = self.records.get(real)
        if isinstance(record, dict) and record.get("stat") == signature and isinstance(record.get("names"), list):
            return [str(n) for n in record["names"]]
        return None

    def put(self, path: str, threshold: int, names: Iterable[str]) -> None:
        real, signature = self._key(path, threshold)
        record = {"stat": signature, "names": sorted(set(names))}
        if self.records.get(real) != record:
            self.records[real] = record
            self.dirty = True

    def forget_missing(self) -> None:
        for real in list(self.records):
            if not os.path.exists(real):
                del self.records[real]
                self.dirty = True

    def save(self, uid: int, gid: int) -> None:
        if not self.dirty:
            return
        directory = os.path.dirname(self.path)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump({"version": _INDEX_VERSION, "files": self.records}, handle, indent=1, sort_keys=True)
            os.chmod(tmp, CACHE_FILE_MODE)
            if uid >= 0 or gid >= 0:
                os.chown(tmp, uid, gid)
            os.replace(tmp, self.path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self.dirty = False


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy_range(src_path: str, offset: int, length: int, dst_fd: int) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src_path`` to ``dst_fd``, in the kernel when possible."""
    with open(src_path, "rb") as src:
        src_fd = src.fileno()
        done = 0
        use_copy_file_range = hasattr(os, "copy_file_range")
        use_sendfile = hasattr(os, "sendfile")
        while done < length:
            count = min(_COPY_CHUNK, length - done)
            sent = 0
            if use_copy_file_range:
                try:
                    sent = os.copy_file_range(src_fd, dst_fd, count, offset + done)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                        raise
                    use_copy_file_range = False
                    continue
            elif use_sendfile:
                try:
                    sent = os.sendfile(dst_fd, src_fd, offset + done, count)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    use_sendfile = False
                    continue
            else:
                chunk = os.pread(src_fd, count, offset + done)
                sent = os.write(dst_fd, chunk) if chunk else 0
            if sent == 0:
                raise CacheError("%s: file ended at byte %d while copying %d bytes from offset %d"
                                 % (src_path, offset + done, length, offset))
            done += sent


class _Seeder:
    """One seed_cache run: inspects the cache, then writes and prunes unless in check mode."""

    def __init__(self, cache_dir: str, uid: int, gid: int, hasher: Hasher, check_mode: bool,
                 result: SeedResult) -> None:
        self.cache_dir = cache_dir
        self.uid = uid
        self.gid = gid
        self.hasher = hasher
        self.check_mode = check_mode
        self.result = result
        self.dir_exists = os.path.isdir(cache_dir)

    def ensure_dir(self) -> None:
        path = self.cache_dir
        if os.path.lexists(path) and not os.path.isdir(path):
            raise CacheError("cache_dir %s exists and is not a directory" % path)
        if not self.dir_exists:
            self.result.changed = True
            if not self.check_mode:
                os.makedirs(path, mode=CACHE_DIR_MODE, exist_ok=True)
                os.chmod(path, CACHE_DIR_MODE)
                self._chown(path)
            return
        st = os.stat(path)
        if stat.S_IMODE(st.st_mode) != CACHE_DIR_MODE:
            self.result.changed = True
            if not self.check_mode:
                os.chmod(path, CACHE_DIR_MODE)
        if self._owner_differs(st):
            self.result.changed = True
            if not self.check_mode:
                self._chown(path)

    def _owner_differs(self, st: os.stat_result) -> bool:
        return (self.uid >= 0 and st.st_uid != self.uid) or (self.gid >= 0 and st.st_gid != self.gid)

    def _chown(self, path: str) -> None:
        if self.uid >= 0 or self.gid >= 0:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)

    def existing(self) -> dict[str, int]:
        """Cache files present now (16-hex names) and their sizes."""
        if not self.dir_exists:
            return {}
        found = {}
        try:
            with os.scandir(self.cache_dir) as entries:
                for entry in entries:
                    if CACHE_NAME.match(entry.name):
                        found[entry.name] = entry.stat(follow_symlinks=False).st_size
        except OSError as exc:
            raise CacheError("cannot list cache_dir %s: %s" % (self.cache_dir, exc.strerror or exc)) from exc
        return found

    def is_valid(self, entry: CacheEntry) -> bool:
        """True when the cache file exists, is a regular file, and has the entry's size and hash."""
        target = os.path.join(self.cache_dir, entry.name)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
            return False
        return self.hasher(target, [(0, entry.size)])[0] == entry.name

    def fix_owner(self, entry: CacheEntry) -> None:
        target = os.path.join(self.cache_dir, entry.name)
        if self._owner_differs(os.lstat(target)):
            self.result.changed = True
            if not self.check_mode:
                self._chown(target)

    def publish(self, entry: CacheEntry) -> None:
        """Copy the entry's bytes to a temporary file, check its hash, and rename it into place."""
        target = os.path.join(self.cache_dir, entry.name)
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=TEMP_PREFIX)
        try:
            try:
                _copy_range(entry.path, entry.offset, entry.size, fd)
                os.fchmod(fd, CACHE_FILE_MODE)
                if self.uid >= 0 or self.gid >= 0:
                    os.fchown(fd, self.uid, self.gid)
                os.fsync(fd)
            finally:
                os.close(fd)
            got = self.hasher(tmp, [(0, entry.size)])[0]
            if got != entry.name:
                raise CacheError("%s changed while seeding: tensor %s at offset %d hashed to %s, copy hashes to %s"
                                 % (entry.path, entry.tensors[0], entry.offset, entry.name, got))
            if os.path.isdir(target) and not os.path.islink(target):
                raise CacheError("%s is a directory, not a cache file" % target)
            os.replace(tmp, target)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def prune(self, needed: set[str], existing: dict[str, int]) -> None:
        for name in sorted(existing):
            if name not in needed:
                self.result.pruned_files.append(name)
                self.result.pruned_bytes += existing[name]
                self.result.changed = True
                if not self.check_mode:
                    _unlink_quietly(os.path.join(self.cache_dir, name))
        if not self.dir_exists:
            return
        now = time.time()
        with os.scandir(self.cache_dir) as entries:
            stale = [e for e in entries if e.name.startswith(TEMP_PREFIX)
                     and now - e.stat(follow_symlinks=False).st_mtime > _STALE_TEMP_SECONDS]
        for entry in stale:
            self.result.pruned_files.append(entry.name)
            self.result.pruned_bytes += entry.stat(follow_symlinks=False).st_size
            self.result.changed = True
            if not self.check_mode:
                _unlink_quietly(entry.path)


def _listing(names: dict[str, int]) -> str:
    return "".join("%s %d\n" % (name, names[name]) for name in sorted(names))


def seed_cache(model: ModelPaths, cache_dir: str, threshold: int = HASH_THRESHOLD, helper: str | None = None,
               owner: str | int | None = None, group: str | int | None = None, prune: bool = True,
               keep_models: Sequence[ModelPaths] = (), check_mode: bool = False, jobs: int = 1) -> SeedResult:
    """Make ``cache_dir`` hold a verified cache file for every tensor of ``model`` over ``threshold``.

    :param model: the GGUF path, or the list of a split model's shards.
    :param cache_dir: the rpc-server cache directory itself (``$LLAMA_CACHE/rpc`` ...).
    :param threshold: tensors strictly larger than this many bytes are cached (llama.cpp: 10 MiB).
    :param helper: path of the ``llamafleet-fnv1a64`` binary; when it is None or missing,
        hashing falls back to Python (slow) and a warning is added to the result.
    :param owner: user (name or uid) to own the directory and the files written.
    :param group: group (name or gid) likewise.
    :param prune: delete cache files that neither ``model`` nor any of ``keep_models`` needs,
        and temporary files a crashed run left behind more than an hour ago.
    :param keep_models: other models whose cache files pruning must keep.
    :param check_mode: inspect and hash, but change nothing.
    :param jobs: ranges the helper hashes in parallel (0: one per CPU).
    :raises CacheError, GGUFError, HashError: the message names the file at fault.
    """
    result = SeedResult()
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    if threshold < 0:
        raise CacheError("threshold must be >= 0, got %d" % threshold)
    jobs = jobs if jobs > 0 else (os.cpu_count() or 1)
    try:
        resolved = find_helper(helper) if helper else find_helper()
    except HashError as exc:
        result.warnings.append("%s; hashing in Python instead, 50 to 100 times slower" % exc)
        resolved = None
    if resolved is None and not result.warnings:
        result.warnings.append("no %s helper found; hashing in Python instead, 50 to 100 times slower"
                               % "llamafleet-fnv1a64")
    result.hasher = resolved or "python"
    hasher = make_hasher(resolved, jobs)
    uid = _resolve_id("user", owner)
    gid = _resolve_id("group", group)

    hashed = model_hashes(model, threshold, hasher)
    result.hashes = hashed.hashes
    result.tensors_over_threshold = hashed.tensors_over_threshold
    seeder = _Seeder(cache_dir, uid, gid, hasher, check_mode, result)
    seeder.ensure_dir()
    before = seeder.existing()

    for entry in sorted(hashed.entries, key=lambda e: e.name):
        if entry.name in before and seeder.is_valid(entry):
            result.skipped_files.append(entry.name)
            seeder.fix_owner(entry)
            continue
        if os.path.lexists(os.path.join(cache_dir, entry.name)):
            result.replaced_files.append(entry.name)
        result.seeded_files.append(entry.name)
        result.seeded_bytes += entry.size
        result.changed = True
        if not check_mode:
            seeder.publish(entry)

    index = _Index(cache_dir)
    needed = {entry.name for entry in hashed.entries}
    if prune:
        for kept in keep_models:
            needed.update(_kept_names(kept, threshold, hasher, index))
        seeder.prune(needed, before)
    for path, names in hashed.names_by_path.items():
        index.put(path, threshold, names)
    index.forget_missing()
    if not check_mode:
        index.save(uid, gid)

    pruned = set(result.pruned_files)
    after = {name: size for name, size in before.items() if name not in pruned}
    after.update({entry.name: entry.size for entry in hashed.entries})
    result.diff = {"before": _listing(before), "after": _listing(after),
                   "before_header": cache_dir, "after_header": cache_dir}
    return result


def _kept_names(model: ModelPaths, threshold: int, hasher: Hasher, index: _Index) -> set[str]:
    """Cache names a kept model needs: from the index when its files are unchanged, else hashed."""
    try:
        kept = read_model(model, max_array_items=0)
    except GGUFError as exc:
        raise CacheError("keep_models: %s" % exc) from exc
    names: set[str] = set()
    for path in kept.paths:
        known = index.get(path, threshold)
        if known is None:
            group = [t for t in kept.tensors if t.path == path and t.nbytes > threshold]
            known = hasher(path, [(t.offset, t.nbytes) for t in group]) if group else []
            index.put(path, threshold, known)
        names.update(known)
    return names
