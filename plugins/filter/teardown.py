# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters of playbooks/teardown.yml (thin wrappers over module_utils/teardown.py).

- ``teardown_units``: ``ansible.builtin.find``'s files in the systemd folder -> the llamafleet units (or those of one
  prefix, such as a worker's), in stop order.
- ``teardown_ping_group_range``: the gate's sysctl file and the kernel's range -> the range to set back, or ``""``.
- ``teardown_parents``: removed paths -> their parent folders named after llamafleet, deepest first.
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import UNIT_PREFIX
from ansible_collections.llamafleet.cluster.plugins.module_utils.teardown import (
    namespace_parents,
    ping_group_range_restore,
    teardown_units,
)


def llamafleet_teardown_units(found, prefix=UNIT_PREFIX):
    """The unit names starting with ``prefix`` among ``found`` (paths or find's file entries), triggers first."""
    if isinstance(found, (str, bytes)) or not hasattr(found, "__iter__"):
        raise AnsibleFilterError("teardown_units: expected a list of paths or of find's files, got %r" % (found,))
    if not isinstance(prefix, str) or not prefix.startswith(UNIT_PREFIX):
        raise AnsibleFilterError("teardown_units: the prefix must start with %r, got %r" % (UNIT_PREFIX, prefix))
    return teardown_units(found, prefix=prefix)


def llamafleet_teardown_ping_group_range(setting, current):
    """``net.ipv4.ping_group_range`` to set back when the gate's sysctl file (text ``setting``) goes, or ``""``."""
    return ping_group_range_restore(str(setting or ""), str(current or ""))


def llamafleet_teardown_parents(paths):
    """The parent folders of ``paths`` named after llamafleet, each once, deepest first."""
    if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
        raise AnsibleFilterError("teardown_parents: expected a list of paths, got %r" % (paths,))
    return namespace_parents(paths)


class FilterModule:
    """llamafleet teardown filters."""

    def filters(self):
        return {"teardown_units": llamafleet_teardown_units,
                "teardown_ping_group_range": llamafleet_teardown_ping_group_range,
                "teardown_parents": llamafleet_teardown_parents}
