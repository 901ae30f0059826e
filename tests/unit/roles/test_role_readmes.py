"""Every role has a README.md that documents each variable of each entry point with its argument_specs default.

A variable is documented by a table row ``| `name` | default | description |`` whose default cell is
:func:`render_default` of the argument_specs default (``required`` for a required option without one). The README
also names each entry point other than ``main`` and each handler. Run as a script to print a role's rows::

    python tests/unit/roles/test_role_readmes.py rpc_server
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[3] / "roles"
ROLE_NAMES = sorted(p.name for p in ROLES.iterdir() if (p / "tasks" / "main.yml").is_file())
# A table row's cells; a pipe inside a cell is written \| (GitHub keeps it in code spans too).
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_MARKUP = re.compile(r"\b[CIVO]\(([^()]*)\)")
_HEADER = "| Variable | Default | Description |"


def _load(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def entry_points(role: str) -> dict[str, dict[str, Any]]:
    """``{entry point: {option: spec}}`` from the role's meta/argument_specs.yml."""
    specs = _load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"]
    return {name: (spec.get("options") or {}) for name, spec in specs.items()}


def render_default(spec: dict[str, Any]) -> str:
    """The README's default cell for an option: its default as inline code, or ``required``."""
    if "default" not in spec:
        return "required" if spec.get("required") else "`null`"
    value = spec["default"]
    text = json.dumps(value) if not isinstance(value, str) or value == "" else " ".join(value.split())
    return "`%s`" % text.replace("|", "\\|")


def describe(spec: dict[str, Any]) -> str:
    """One line from an option's description: its first paragraph, Ansible markup as inline code."""
    first = spec.get("description") or ""
    if isinstance(first, list):
        first = first[0] if first else ""
    text = _MARKUP.sub(r"`\1`", " ".join(str(first).split()))
    if spec.get("choices"):
        text += " One of %s." % ", ".join("`%s`" % choice for choice in spec["choices"])
    return text.replace("|", "\\|")


def table(options: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of these options, in argument_specs order."""
    rows = [_HEADER, "| --- | --- | --- |"]
    rows += ["| `%s` | %s | %s |" % (name, render_default(spec), describe(spec)) for name, spec in options.items()]
    return "\n".join(rows)


def readme_rows(text: str) -> dict[str, list[str]]:
    """``{variable: [default cell, ...]}`` of the rows of every variables table (header ``| Variable | Default |``)."""
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
        elif line.startswith(_HEADER):
            in_table = True
        elif in_table and line.startswith("| `"):
            cells = [cell.strip() for cell in _CELL_SPLIT.split(line.strip())[1:-1]]
            rows.setdefault(cells[0].strip("`"), []).append(cells[1] if len(cells) > 1 else "")
    return rows


def _readme(role: str) -> str:
    path = ROLES / role / "README.md"
    assert path.is_file(), "roles/%s/README.md is missing" % role
    return path.read_text(encoding="utf-8")


def test_there_are_roles() -> None:
    assert {"_common", "bench", "llama_server", "llamacpp_build", "model", "rpc_server"} <= set(ROLE_NAMES)


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_every_option_has_a_row_with_its_default(role: str) -> None:
    rows = readme_rows(_readme(role))
    problems = []
    for entry, options in entry_points(role).items():
        for name, spec in options.items():
            want = render_default(spec)
            if name not in rows:
                problems.append("%s (entry point %s) has no row" % (name, entry))
            elif any(cell != want for cell in rows[name]):
                problems.append("%s: default %s in the README, %s in argument_specs" % (name, rows[name], want))
    assert not problems, "roles/%s/README.md: %s" % (role, "; ".join(problems))


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_no_row_for_an_unknown_variable(role: str) -> None:
    known = {name for options in entry_points(role).values() for name in options}
    unknown = sorted(set(readme_rows(_readme(role))) - known)
    assert not unknown, "roles/%s/README.md documents variables argument_specs does not have: %s" % (role, unknown)


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_entry_points_and_handlers_are_named(role: str) -> None:
    text = _readme(role)
    handlers_file = ROLES / role / "handlers" / "main.yml"
    handlers = [h["name"] for h in (_load(handlers_file) or [])] if handlers_file.is_file() else []
    missing = ["entry point %s" % e for e in entry_points(role) if e != "main" and "`%s`" % e not in text]
    missing += ["handler %r" % h for h in handlers if h not in text]
    assert not missing, "roles/%s/README.md does not name: %s" % (role, ", ".join(missing))


def _print_tables(role: str) -> None:
    for entry, options in entry_points(role).items():
        print("### %s\n\n%s\n" % (entry, table(options) if options else "(no variables)"))


if __name__ == "__main__":
    for _role in sys.argv[1:] or ROLE_NAMES:
        print("## %s\n" % _role)
        _print_tables(_role)
