"""Every filter the collection exports has a sidecar doc (plugins/filter/<name>.yml) that ansible-doc renders.

The filter names come from the FilterModules themselves (every plugins/filter/*.py), so a new filter without a
doc, or a doc left behind by a removed filter, fails here. One ansible-doc call renders them all.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from ansible.module_utils import _internal

REPO = Path(__file__).resolve().parents[4]
FILTER_DIR = REPO / "plugins" / "filter"
PACKAGE = "ansible_collections.llamafleet.cluster.plugins.filter"
FQCN = "llamafleet.cluster."


def exported_filters() -> dict[str, Callable[..., Any]]:
    """``{name: function}`` of every FilterModule in plugins/filter (a name twice is an error)."""
    # Importing the plugins imports ansible.errors, which marks the process as the controller (see
    # test_llamafleet_filter.py): restore the flag so module tests collected later keep their warnings.
    was_controller = _internal.is_controller
    try:
        modules = [importlib.import_module("%s.%s" % (PACKAGE, path.stem))
                   for path in sorted(FILTER_DIR.glob("*.py")) if path.stem != "__init__"]
    finally:
        _internal.is_controller = was_controller
    found: dict[str, Callable[..., Any]] = {}
    for module in modules:
        for name, function in module.FilterModule().filters().items():
            assert name not in found, "filter %s is exported twice (%s)" % (name, module.__name__)
            found[name] = function
    return found


FILTERS = exported_filters()
NAMES = sorted(FILTERS)


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    """ansible-doc --json for every exported filter at once, with this checkout's ansible.cfg."""
    env = {k: v for k, v in os.environ.items() if k not in ("ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS")}
    env["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
    ansible_doc = Path(sys.executable).parent / "ansible-doc"
    proc = subprocess.run([str(ansible_doc), "-t", "filter", "--json"] + [FQCN + n for n in NAMES],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    # A name ansible-doc does not find is only a warning on stderr with exit 0: stderr must be empty too.
    assert proc.returncode == 0 and not proc.stderr.strip(), (proc.returncode, proc.stderr)
    return json.loads(proc.stdout)


def test_both_filter_files_export_filters() -> None:
    modules = {function.__module__.rsplit(".", 1)[-1] for function in FILTERS.values()}
    assert modules == {p.stem for p in FILTER_DIR.glob("*.py") if p.stem != "__init__"}


@pytest.mark.parametrize("name", NAMES)
def test_doc_file_exists(name: str) -> None:
    assert (FILTER_DIR / ("%s.yml" % name)).is_file(), "plugins/filter/%s.yml is missing" % name


def test_no_doc_without_a_filter() -> None:
    stale = sorted(p.stem for p in FILTER_DIR.glob("*.yml") if p.stem not in FILTERS)
    assert not stale, "docs for filters no FilterModule exports: %s" % stale


def test_every_filter_rendered(rendered: dict[str, Any]) -> None:
    assert sorted(rendered) == [FQCN + n for n in NAMES]


@pytest.mark.parametrize("name", NAMES)
def test_doc_content(rendered: dict[str, Any], name: str) -> None:
    doc = rendered[FQCN + name]["doc"]
    assert doc["name"] == name
    assert Path(doc["filename"]).resolve() == FILTER_DIR / ("%s.yml" % name), "another copy of the collection was read"
    assert str(doc.get("short_description") or "").strip(), "%s: empty short_description" % name
    assert doc.get("description"), "%s: no description" % name
    options = doc.get("options") or {}
    assert options.get("_input", {}).get("description"), "%s: _input is not documented" % name
    positional = [word.strip() for word in str(doc.get("positional") or "_input").split(",")]
    assert positional[0] == "_input" and set(positional) <= set(options), (name, positional)
    assert str(rendered[FQCN + name].get("examples") or "").strip(), "%s: no EXAMPLES" % name
    assert (rendered[FQCN + name].get("return") or {}).get("_value", {}).get("description"), "%s: no RETURN" % name


@pytest.mark.parametrize("name", NAMES)
def test_options_match_the_function(rendered: dict[str, Any], name: str) -> None:
    """The documented options are the function's parameters (the first is _input), with its defaults."""
    params = list(inspect.signature(FILTERS[name]).parameters.values())
    options = rendered[FQCN + name]["doc"].get("options") or {}
    assert set(options) == {"_input"} | {p.name for p in params[1:]}, name
    for param in params[1:]:
        spec = options[param.name]
        if param.default is inspect.Parameter.empty:
            assert spec.get("required") is True, "%s: %s has no default, document it required" % (name, param.name)
        else:
            assert not spec.get("required"), "%s: %s has a default, it is not required" % (name, param.name)
            if param.default is not None:
                assert spec.get("default") == param.default, (name, param.name, spec.get("default"), param.default)
