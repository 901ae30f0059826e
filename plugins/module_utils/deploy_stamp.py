# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The deploy stamp: what a whole deploy left on a host, so that the next deploy with the same inputs can tell, with
one module run a host, that there is nothing to converge.

A stamp holds:

- ``inputs``: the digest of everything the controller feeds the roles (the collection's files, every fleet host's
  variables, the group membership, Ansible's version, the controller files those variables name), computed by the
  lookup ``llamafleet.cluster.deploy_inputs`` with :func:`inputs_digest`;
- ``facts``: the host facts the roles plan from (:func:`host_facts`): system, CPUs, addresses, devices and their
  total memory, and the live ``net.ipv4.ping_group_range`` that the llama_server role sets;
- ``files``: one fingerprint per file, link and folder under the places the roles write (:func:`watched_roots`):
  the content's sha256 for files up to ``HASH_LIMIT``, size, mtime and inode above it (binaries, the model);
- ``units``: each llamafleet unit's ``UnitFileState``, and its ``ActiveState`` where it is enabled;
- ``health``: the clients' endpoint's ``/health`` on the orchestrator, which must answer 200.

:func:`differences` compares a stamp with what the host has now, in words that name the path or unit. Pure logic
and ``os`` reads; the module ``deploy_stamp`` runs the commands.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any, Callable, Iterable, Mapping

from .checksum import sha256_hex
from .constants import CONFIG_DIR, EDGE_CONFIG_DIR, LIBEXEC_DIR, SYSTEMD_DIR, UNIT_PREFIX

STAMP_SCHEMA = 1
# Files up to this size are fingerprinted by content, larger ones (llama.cpp's binaries, the model) by size, mtime and
# inode: a deploy that rewrites one replaces it (a new inode) or changes its size or mtime.
HASH_LIMIT = 1 << 20
# The places the roles write, each with the names it holds that are llamafleet's (None: all of it). The deployment
# record's folders (build root, homes, rpc-server cache) are added by :func:`watched_roots`.
_LLAMAFLEET_NAMES = ("llamafleet", "haproxy")
FIXED_ROOTS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    (CONFIG_DIR, None),
    ("/etc/haproxy", None),
    ("/etc/default/haproxy", None),
    (SYSTEMD_DIR, _LLAMAFLEET_NAMES),
    ("/run/systemd/system", _LLAMAFLEET_NAMES),
    (os.path.dirname(LIBEXEC_DIR), ("llamafleet",)),
    ("/etc/sysctl.d", ("llamafleet",)),
    ("/etc/ufw", None),
    ("/etc/firewalld", None),
)
# The deployment record's keys that name folders a role owns (module_utils/deployment_record.py's sections).
RECORD_FOLDER_KEYS = ("build_root", "home", "cache_dir")
UNIT_SUFFIXES = (".service", ".timer", ".path", ".socket")
# The unit the edge role adds a drop-in to (while EDGE_CONFIG_DIR exists, the edge is llamafleet's).
EDGE_UNIT = "haproxy.service"
UNIT_PROPERTIES = ("Id", "ActiveState", "UnitFileState")
INPUTS_CHANGED = ("the deploy's inputs changed (inventory variables, extra vars, groups, the collection's files, "
                  "Ansible's version or a controller file they name)")
# How many differences a report lists before it says how many more there are.
REPORT_LIMIT = 5


def canonical(value: Any) -> Any:
    """``value`` as plain JSON types, mappings with sorted string keys, so that equal data digests equally."""
    if isinstance(value, Mapping):
        return {str(key): canonical(value[key]) for key in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(item) for item in value), key=lambda item: json.dumps(item, sort_keys=True))
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)


def digest(value: Any) -> str:
    """The sha256 of ``value``'s canonical JSON."""
    text = json.dumps(canonical(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(path: str, hash_limit: int = HASH_LIMIT) -> str | None:
    """One path's fingerprint (its kind, mode, owner and content or size/mtime/inode); None when it is gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    head = "%o:%d:%d" % (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    if stat.S_ISLNK(st.st_mode):
        return "link:%s" % os.readlink(path)
    if stat.S_ISDIR(st.st_mode):
        return "dir:" + head
    if stat.S_ISREG(st.st_mode):
        if st.st_size <= hash_limit:
            try:
                return "file:%s:%s" % (head, sha256_hex(path))
            except OSError as exc:
                return "file:%s:unreadable %s" % (head, exc.strerror)
        return "file:%s:%d:%d:%d" % (head, st.st_size, st.st_mtime_ns, st.st_ino)
    return "other:%s:%o" % (head, stat.S_IFMT(st.st_mode))


def _wanted(name: str, names: tuple[str, ...] | None) -> bool:
    return names is None or any(part in name for part in names)


def tree_fingerprints(roots: Iterable[tuple[str, tuple[str, ...] | None]], skip: Iterable[str] = (),
                      hash_limit: int = HASH_LIMIT) -> dict[str, str]:
    """``{path: fingerprint}`` of every file, link and folder under each root (the root itself included) whose name
    contains one of its ``names`` (None: every one; the folders between are walked, not listed). ``skip``: paths left
    out (the stamp itself)."""
    skipped = set(skip)
    found: dict[str, str] = {}

    def add(path: str) -> None:
        if path not in skipped:
            value = fingerprint(path, hash_limit)
            if value is not None:
                found[path] = value

    for root, names in roots:
        if not os.path.lexists(root):
            continue
        if names is None:
            add(root)
        if os.path.islink(root) or not os.path.isdir(root):
            continue
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            inside = names is None or any(_wanted(part, names) for part in os.path.relpath(folder, root).split(os.sep))
            for name in sorted(dirs) + sorted(files):
                if inside or _wanted(name, names):
                    add(os.path.join(folder, name))
    return found


def watched_roots(record: Mapping[str, Any], extra: Iterable[str] = ()) -> list[tuple[str, tuple[str, ...] | None]]:
    """:data:`FIXED_ROOTS`, the folders the deployment record names (``build_root``, ``home``, ``cache_dir`` of each
    section), and ``extra`` (the model folder, ``llamafleet_stamp_paths``), each once, in order."""
    roots = list(FIXED_ROOTS)
    for section in (record.get("sections") or {}).values():
        for key in RECORD_FOLDER_KEYS:
            if isinstance(section, Mapping) and isinstance(section.get(key), str) and section[key].startswith("/"):
                roots.append((section[key], None))
    roots.extend((path, None) for path in extra if path)
    seen: set[str] = set()
    unique = []
    for path, names in roots:
        path = os.path.normpath(path)
        if path not in seen:
            seen.add(path)
            unique.append((path, names))
    return unique


def unit_names(systemd_dir: str = SYSTEMD_DIR, edge_dir: str = EDGE_CONFIG_DIR) -> list[str]:
    """llamafleet's unit files in ``systemd_dir`` (names that start with UNIT_PREFIX), and HAProxy's unit while the
    edge is llamafleet's."""
    try:
        names = os.listdir(systemd_dir)
    except OSError:
        names = []
    units = sorted(name for name in names if name.startswith(UNIT_PREFIX) and name.endswith(UNIT_SUFFIXES))
    if os.path.isdir(edge_dir):
        units.append(EDGE_UNIT)
    return units


def unit_states(shown: Iterable[Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """``systemctl show`` blocks -> ``{unit: {"UnitFileState": ..., "ActiveState": ...}}``; the ActiveState only of
    enabled units (a static oneshot that a timer starts comes and goes between deploys)."""
    states = {}
    for props in shown:
        unit_file = props.get("UnitFileState", "")
        entry = {"UnitFileState": unit_file}
        if unit_file.startswith("enabled"):
            entry["ActiveState"] = props.get("ActiveState", "")
        states[props.get("Id", "")] = entry
    return states


def parse_ip_addresses(text: str) -> list[list[Any]]:
    """``ip -j addr show``'s JSON -> sorted ``[interface, address, prefix]`` of the global addresses."""
    found = []
    for link in json.loads(text or "[]"):
        for info in link.get("addr_info", []):
            if info.get("scope") == "global":
                found.append([link.get("ifname", ""), info.get("local", ""), info.get("prefixlen", 0)])
    return sorted(found)


def parse_default_routes(text: str) -> list[list[str]]:
    """``ip -j route show default``'s JSON -> sorted ``[device, gateway]``."""
    return sorted([route.get("dev", ""), route.get("gateway", "")] for route in json.loads(text or "[]"))


def parse_os_release(text: str) -> dict[str, str]:
    """``/etc/os-release`` -> its ID, VERSION_ID and VERSION_CODENAME."""
    values = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("ID", "VERSION_ID", "VERSION_CODENAME"):
            values[key] = value.strip().strip('"')
    return values


def device_totals(devices: Iterable[Mapping[str, Any]]) -> list[list[Any]]:
    """Each probed device's backend, name and total memory (what the planner counts on; free memory changes by
    itself between deploys and is measured again only by a deploy that converges)."""
    return sorted([dev.get("backend", ""), dev.get("name", ""), dev.get("total_mib", 0)] for dev in devices)


def host_facts(os_release: str, machine: str, cpus: int, addresses: str, routes: Iterable[str],
               devices: Iterable[Mapping[str, Any]], ping_group_range: str = "") -> dict[str, Any]:
    """The facts the roles plan from, from the readings the module takes, and the live setting the llama_server role
    reads and sets (``net.ipv4.ping_group_range``: the gate's group may ping)."""
    return {
        "ping_group_range": " ".join(ping_group_range.split()),
        "os": parse_os_release(os_release),
        "machine": machine,
        "cpus": cpus,
        "addresses": parse_ip_addresses(addresses),
        "routes": sorted(route for text in routes for route in parse_default_routes(text)),
        "devices": device_totals(devices),
    }


def build_stamp(inputs: str, facts: Mapping[str, Any], files: Mapping[str, str],
                units: Mapping[str, Mapping[str, str]], roots: Iterable[tuple[str, tuple[str, ...] | None]],
                health: Iterable[str]) -> dict[str, Any]:
    """The stamp a whole deploy leaves (JSON)."""
    return {"schema": STAMP_SCHEMA, "inputs": inputs, "facts": canonical(facts), "files": dict(files),
            "units": canonical(units), "roots": [[path, list(names) if names else None] for path, names in roots],
            "health": list(health)}


def stamp_roots(stamp: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...] | None]]:
    """The roots a stamp was taken over."""
    return [(path, tuple(names) if names else None) for path, names in stamp.get("roots", [])]


def _more(items: list[str]) -> list[str]:
    if len(items) <= REPORT_LIMIT:
        return items
    return items[:REPORT_LIMIT] + ["and %d more" % (len(items) - REPORT_LIMIT)]


def _fact_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    return ["%s changed (%s, was %s)" % (key, json.dumps(now.get(key)), json.dumps(before.get(key)))
            for key in sorted(set(before) | set(now)) if before.get(key) != now.get(key)]


def differences(stamp: Mapping[str, Any] | None, inputs: str, facts: Mapping[str, Any], files: Mapping[str, str],
                units: Mapping[str, Mapping[str, str]], health: Mapping[str, str]) -> list[str]:
    """Why the host is not as the stamp says the last whole deploy left it (empty: it is). ``health``: ``{url:
    problem}`` of the health checks that failed."""
    if not stamp:
        return ["no stamp of a whole deploy"]
    if stamp.get("schema") != STAMP_SCHEMA:
        return ["the stamp's schema is %r, this llamafleet writes %d" % (stamp.get("schema"), STAMP_SCHEMA)]
    found = []
    if stamp.get("inputs") != inputs:
        found.append(INPUTS_CHANGED)
    found += _fact_changes(stamp.get("facts") or {}, canonical(facts))
    recorded = stamp.get("files") or {}
    changed = [path for path in sorted(set(recorded) | set(files)) if recorded.get(path) != files.get(path)]
    found += _more(["%s %s since the last deploy" % (
        path, "appeared" if path not in recorded else "is gone" if path not in files else "changed") for path in changed])
    recorded_units = stamp.get("units") or {}
    for unit in sorted(set(recorded_units) | set(units)):
        was, now = recorded_units.get(unit), units.get(unit)
        if was != now:
            found.append("%s: %s, was %s" % (unit, _unit_words(now), _unit_words(was)))
    found += ["%s: %s" % (url, problem) for url, problem in sorted(health.items())]
    return found


def sync_report(hosts: Iterable[str], results: Iterable[Mapping[str, Any]]) -> str:
    """What the deploy does after the check, in words: nothing, or converge every host and why (changed inputs said
    once, then each host's own differences)."""
    found = {host: list(result.get("differences") or ([] if result.get("in_sync") else ["not checked"]))
             for host, result in zip(hosts, results)}
    if not any(found.values()):
        return ("Every host is as the last deploy left it: nothing to converge, the preflight and the roles are left "
                "out (llamafleet_skip_when_in_sync=false converges every task anyway).")
    parts = []
    if any(INPUTS_CHANGED in items for items in found.values()):
        parts.append(INPUTS_CHANGED[0].upper() + INPUTS_CHANGED[1:])
    first = next(iter(found.values()))
    # what every host says (no stamp yet, on a fleet's first deploy) is said once
    common = [item for item in first if item != INPUTS_CHANGED and len(found) > 1
              and all(item in items for items in found.values())]
    if common:
        parts.append(("every host: " if parts else "Every host: ") + ", ".join(common))
    for host, items in found.items():
        own = [item for item in items if item != INPUTS_CHANGED and item not in common]
        if own:
            parts.append("%s: %s" % (host, ", ".join(own)))
    return "Converging every host. " + "; ".join(parts) + "."


def _unit_words(state: Mapping[str, str] | None) -> str:
    if not state:
        return "not there"
    return ", ".join("%s %s" % (key, state[key]) for key in sorted(state))


def controller_file_fingerprint(path: str, hash_limit: int = 64 << 20) -> str | None:
    """A controller file that an input variable names (a certificate, a key, a model given as a local file): its
    content's sha256, or size and mtime above ``hash_limit``; None when ``path`` is no regular file."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    if st.st_size > hash_limit:
        return "%d:%d" % (st.st_size, st.st_mtime_ns)
    try:
        return sha256_hex(path)
    except OSError:
        return None


# Variables that do not choose what a deploy makes: how this run was started (check mode, tags, verbosity, forks,
# the paths it was started from), the per-run placeholder ``omit``, the groups (taken per host as group_names), and
# the switch of the stamp itself.
VOLATILE_VARIABLES = frozenset((
    "omit", "groups", "playbook_dir", "inventory_dir", "inventory_file", "inventory_hostname_short",
    "ansible_playbook_python", "ansible_config_file", "ansible_check_mode", "ansible_diff_mode", "ansible_forks",
    "ansible_inventory_sources", "ansible_skip_tags", "ansible_run_tags", "ansible_verbosity", "ansible_limit",
    "ansible_facts", "ansible_local", "ansible_play_batch", "ansible_play_hosts", "ansible_play_hosts_all",
    "ansible_play_name", "ansible_play_role_names", "ansible_role_names", "play_hosts", "role_names",
    "ansible_search_path", "ansible_loop_var", "ansible_index_var", "ansible_parent_role_names",
    "ansible_parent_role_paths", "ansible_collection_name", "ansible_dependent_role_names",
    "llamafleet_skip_when_in_sync",
))


def input_variable(name: str, facts: Mapping[str, Any]) -> bool:
    """Whether a host variable is one of the deploy's inputs: not volatile, not a fact (nor a fact injected as
    ``ansible_<fact>``: a fact cache brings them back), not a role's private fact (``_name``)."""
    if name in VOLATILE_VARIABLES or name.startswith("_"):
        return False
    return not (name.startswith("ansible_") and name[len("ansible_"):] in facts)


def inputs_digest(collection: Mapping[str, str], hosts: Mapping[str, Mapping[str, Any]], ansible_version: Any,
                  files: Callable[[str], str | None] = controller_file_fingerprint) -> str:
    """The digest of a deploy's inputs: ``collection`` (``{relative path: sha256}`` of the collection's files),
    ``hosts`` (``{host: {variable: value}}`` of every fleet host, inputs only, group_names included), Ansible's
    version, and the fingerprint of every controller file that a variable's value names by its absolute path."""
    named: dict[str, str | None] = {}

    def visit(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, str) and value.startswith("/") and "\n" not in value and len(value) < 4096:
            if value not in named:
                named[value] = files(value)

    canonical_hosts = canonical(hosts)
    visit(canonical_hosts)
    return digest({"collection": dict(collection), "hosts": canonical_hosts, "ansible": canonical(ansible_version),
                   "files": {path: value for path, value in named.items() if value is not None}})


COLLECTION_PARTS = ("galaxy.yml", "meta", "playbooks", "plugins", "roles")


def collection_files(root: str) -> dict[str, str]:
    """``{relative path: sha256}`` of the collection's playbooks, roles, plugins and metadata (no bytecode)."""
    found = {}
    for part in COLLECTION_PARTS:
        top = os.path.join(root, part)
        if os.path.isfile(top):
            found[part] = sha256_hex(top)
            continue
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(name for name in dirs if name != "__pycache__")
            for name in sorted(files):
                if not name.endswith((".pyc", ".pyo")):
                    path = os.path.join(folder, name)
                    found[os.path.relpath(path, root)] = sha256_hex(path)
    return found
