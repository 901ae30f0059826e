# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The attributes every llamafleet.cluster module shares (internal to this collection).

A module extends ``ansible.builtin.action_common_attributes`` (which describes
the attributes), ``llamafleet.cluster.attributes`` (platform, idempotence) and
one of ``llamafleet.cluster.attributes.read_only`` (changes nothing, no diff)
or ``llamafleet.cluster.attributes.files`` (writes files, with a diff).
"""

from __future__ import annotations


class ModuleDocFragment:
    """Documentation fragments for the modules' ``attributes``."""

    DOCUMENTATION = r"""
attributes:
  platform:
    platforms: posix
  idempotent:
    description: A second run with the same parameters changes nothing.
    support: full
"""

    READ_ONLY = r"""
attributes:
  check_mode:
    support: full
    details: Read-only; the module runs the same way in check mode.
  diff_mode:
    support: none
"""

    FILES = r"""
attributes:
  check_mode:
    support: full
    details: Works out and reports what it would change, without changing anything.
  diff_mode:
    support: full
    details: Shows what it changes (files or their content) before and after.
"""
