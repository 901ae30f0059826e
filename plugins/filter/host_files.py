# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filter ``host_package_files``: module_utils file names -> the ``files`` of ``host_files`` that install them as the
host package (its ``__init__.py`` first)."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def host_package_files(names, src_dir, dest_dir):
    """``[{dest, content: ""}, {src, dest}...]``: the package marker, then each name copied from src_dir to dest_dir."""
    if isinstance(names, str) or not all(isinstance(name, str) and name and "/" not in name for name in names):
        raise AnsibleFilterError("host_package_files: give a list of file names (no folders), got %r" % (names,))
    src, dest = str(src_dir).rstrip("/"), str(dest_dir).rstrip("/")
    return [{"dest": dest + "/__init__.py", "content": ""}] + [
        {"src": "%s/%s" % (src, name), "dest": "%s/%s" % (dest, name)} for name in names]


class FilterModule:
    """llamafleet host package filter."""

    def filters(self):
        return {"host_package_files": host_package_files}
