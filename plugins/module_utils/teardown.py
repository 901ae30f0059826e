# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What playbooks/teardown.yml takes away, decided from what it found on a host (pure).

- :func:`teardown_units`: the llamafleet units among the entries found in the systemd folder, in the order to stop
  them (the path units and timers that could start a service again first).
- :func:`ping_group_range_restore`: what ``net.ipv4.ping_group_range`` goes back to when the gate's setting goes.
- :func:`namespace_parents`: the folders named after llamafleet that held what was removed, to remove once empty.

Stdlib only (``llamafleet.core.teardown``).
"""

from __future__ import annotations

import posixpath
from typing import Any, Iterable, Mapping, Union

from .constants import SYSTEMD_DIR, UNIT_PREFIX

# Unit types a role may install; drop-in folders (NAME.service.d) and links in *.wants folders are not units.
UNIT_SUFFIXES = (".service", ".socket", ".path", ".timer", ".target")
# Units that start others: stopped first, so that none starts a service the teardown has just stopped.
TRIGGER_SUFFIXES = (".path", ".timer", ".socket")
# The kernel's empty range (no group may ping), Debian 12's default: the only range the deploy ever replaces
# (host_observation.ping_group_range), so the one to give back.
EMPTY_PING_GROUP_RANGE = "1 0"
# The name the folders made for llamafleet itself carry (/opt/llamafleet, /var/cache/llamafleet), as its units do.
PROJECT = UNIT_PREFIX.rstrip("-")

Found = Union[str, Mapping[str, Any]]


def _entry(found: Found) -> tuple[str, bool]:
    """(path, is a folder) of a path or of a file entry as ansible.builtin.find returns it."""
    if isinstance(found, Mapping):
        return str(found.get("path") or ""), bool(found.get("isdir"))
    return str(found), False


def teardown_units(found: Iterable[Found], systemd_dir: str = SYSTEMD_DIR, prefix: str = UNIT_PREFIX) -> list[str]:
    """Names of the unit files named ``prefix``* directly in ``systemd_dir`` among ``found``, triggers first.

    ``found``: paths, or ``ansible.builtin.find``'s ``files`` (folders are left out: drop-in folders and the
    links in ``*.wants`` folders below are not units).  Each name once; triggers (path units, timers, sockets)
    sorted, then the others sorted.
    """
    folder = systemd_dir.rstrip("/") or "/"
    names = set()
    for item in found:
        path, is_dir = _entry(item)
        name = posixpath.basename(path)
        if (not is_dir and posixpath.dirname(posixpath.normpath(path)) == folder and name.startswith(prefix)
                and name.endswith(UNIT_SUFFIXES)):
            names.add(name)
    return sorted(names, key=lambda name: (not name.endswith(TRIGGER_SUFFIXES), name))


def _range(text: str) -> tuple[int, int] | None:
    """(low, high) of a ``net.ipv4.ping_group_range`` value written "LOW HIGH" (any blanks), or None."""
    words = str(text).split()
    if len(words) != 2 or not all(word.isdigit() for word in words):
        return None
    return int(words[0]), int(words[1])


def ping_group_range_restore(setting: str, current: str) -> str:
    """The range to set back when the gate's sysctl file (text ``setting``) goes, or "" to leave the kernel alone.

    The deploy writes ``net.ipv4.ping_group_range = G G`` only where the range was empty, so the empty range
    (:data:`EMPTY_PING_GROUP_RANGE`) is given back, but only while the kernel still has the file's value
    (``current``, /proc's "LOW<TAB>HIGH"): a range someone changed since is theirs.
    """
    values = [line.partition("=")[2] for line in str(setting).splitlines()
              if line.partition("=")[0].strip() == "net.ipv4.ping_group_range" and not line.lstrip().startswith("#")]
    ours = _range(values[-1]) if values else None
    if ours is None or ours != _range(current) or ours == _range(EMPTY_PING_GROUP_RANGE):
        return ""
    return EMPTY_PING_GROUP_RANGE


def namespace_parents(paths: Iterable[str], name: str = PROJECT) -> list[str]:
    """The parent folders of ``paths`` whose own name starts with ``name`` (say /opt/llamafleet of
    /opt/llamafleet/llama.cpp), each once, deepest first: created for llamafleet, so removed once empty.

    A parent named otherwise (/opt of /opt/llama.cpp, a folder the user chose) is never one.
    """
    parents = set()
    for path in paths:
        parent = posixpath.dirname(posixpath.normpath(str(path)))
        if parent != "/" and posixpath.basename(parent).startswith(name):
            parents.add(parent)
    return sorted(parents, key=lambda parent: (-parent.count("/"), parent))
