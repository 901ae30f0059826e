# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the modules whose action plugin sends the controller's model to a host share (model_receive,
rpc_cache_share; their common controller side: plugins/plugin_utils/share_transfer.py)."""

from __future__ import annotations


class ModuleDocFragment:
    """The free-space option and the note on the host side."""

    DOCUMENTATION = r"""
options:
  free_margin_mib:
    description:
      - Free space to leave on the file system the files go to; the space is checked before anything is sent.
    type: int
    default: 1024
notes:
  - The action plugin of the same name runs on the controller (it needs the model in the controller's cache,
    fetched by role C(model)); the module itself is its host side, takes O(action) and is not meant to be called
    directly.
"""
