# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The deployment record: what the roles made on a host, written by the roles, read by the CLI and bench.

One JSON file per host (``DEPLOYMENT_RECORD_PATH``), versioned by ``schema``::

    {"schema": 1, "collection_version": "0.3.0",
     "sections": {"rpc_server": {...}, "llama_server": {...}, "llamacpp_build": {...}, "model": {...}}}

Each role owns one section and writes it with the ``deployment_record`` module at the end of its run,
with the values it really used (units, ports, paths, users, build, plan, endpoint); a user who renames
a path in a play or with ``-e`` still gets a record that says where things are.  The record carries no
timestamp, so a deploy that changes nothing rewrites nothing.

A record written by a newer llamafleet (a ``schema`` above :data:`SCHEMA`) is refused, by the module and
by the readers alike, before anything is changed.  Stdlib only (``llamafleet.core.deployment_record``).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .constants import DEPLOYMENT_RECORD_SCHEMA as SCHEMA

SECTIONS = ("llamacpp_build", "model", "rpc_server", "llama_server")


class RecordError(ValueError):
    """A record that cannot be read or used; the message says which file and why."""


def parse(text: str, path: str = "the deployment record") -> dict[str, Any]:
    """The record in ``text`` (an empty text: an empty record), checked for shape and schema."""
    if not text.strip():
        return {"schema": SCHEMA, "sections": {}}
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise RecordError("%s is not JSON (%s): remove it and deploy again" % (path, exc)) from None
    if not isinstance(record, dict) or not isinstance(record.get("sections", {}), dict):
        raise RecordError("%s is not a llamafleet deployment record (no sections): remove it and deploy again" % path)
    schema = record.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise RecordError("%s has no valid schema number (%r)" % (path, schema))
    if schema > SCHEMA:
        raise RecordError("%s was written by a newer llamafleet (record schema %d, this one reads up to %d, "
                          "collection %s): upgrade the llamafleet.cluster collection and the llamafleet package "
                          "before using them on this host" % (path, schema, SCHEMA, record.get("collection_version")))
    record.setdefault("sections", {})
    return record


def with_section(record: Mapping[str, Any], section: str, data: Mapping[str, Any] | None,
                 version: str) -> dict[str, Any]:
    """``record`` with ``section`` set to ``data`` (None removes it), at this schema and collection version."""
    if section not in SECTIONS:
        raise RecordError("section %r is not one of %s" % (section, ", ".join(SECTIONS)))
    sections = dict(record.get("sections") or {})
    if data is None:
        sections.pop(section, None)
    else:
        sections[section] = json.loads(json.dumps(data, sort_keys=True))
    return {"schema": SCHEMA, "collection_version": version, "sections": sections}


def render(record: Mapping[str, Any]) -> str:
    """The record as its file holds it: stable key order, one trailing newline."""
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def section(record: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """One section of a record (empty when the record or the section is missing)."""
    return dict(((record or {}).get("sections") or {}).get(name) or {})
