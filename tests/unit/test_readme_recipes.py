"""The README's "Where a change goes" is true: what it names exists, and each recipe names every place.

In the section (from ``Where a change goes`` to ``## Licence``), each backtick-quoted

* path (it has a ``/`` or a file extension) exists: from the repository root, or, a bare file name, somewhere in
  the checkout; ``<name>`` stands for any name (``plugins/modules/<name>.py``); ``/health`` (a URL path) is not a file;
* dotted Python name (``llamacpp_build.BACKEND_CMAKE``, ``lab.inventory.LAB_BACKENDS``) resolves: a module of
  ``llamafleet.core`` (plugins/module_utils), of ``llamafleet`` or its subpackages, or of the collection's plugins,
  then attributes of it;
* anything else (commands, flags, variable names) is prose and is not checked.

Each recipe must name every file of ``plugins/``, ``roles/``, ``llamafleet/`` and ``playbooks/`` where an existing
case of its kind appears (a Python name counts for its module's file): the backend ``rocm``, the llama-server flag
``chat_template``, the bench dimension ``bandwidth_mbit``, the gate's ``stall_seconds``.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("llamafleet.core.", "llamafleet.", "llamafleet.bench.", "llamafleet.lab.",
            "ansible_collections.llamafleet.cluster.plugins.filter.",
            "ansible_collections.llamafleet.cluster.plugins.modules.")
EXTENSIONS = (".py", ".yml", ".yaml", ".md", ".json", ".j2", ".txt", ".c", ".cfg", ".toml")
RECIPES = {  # recipe -> (what marks an existing case of it, case-insensitive)
    "A new backend": r"rocm",
    "A new llama.cpp flag": r"chat_template",
    "A new module": None,
    "A new bench dimension": r"bandwidths?_mbit",
    "A new gate fault": r"stall_seconds",
}
SEARCHED = ("plugins", "roles", "llamafleet", "playbooks")


def section(readme: str) -> str:
    """The README's text from "Where a change goes" to "## Licence"."""
    start = readme.index("\nWhere a change goes")
    return readme[start:readme.index("\n## Licence", start)]


def recipes(text: str) -> dict[str, str]:
    """Each bullet ``- **Name**: ...`` of the section, by name."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^- \*\*(.+?)\*\*(.*?)(?=^- \*\*|\Z)", text, re.S | re.M)}


def kind(token: str) -> str:
    """``path``, ``name`` (a dotted Python name) or ``prose``."""
    if re.search(r"[\s=():]", token) or token.startswith(("/", "-")):
        return "prose"
    if "/" in token or token.endswith(EXTENSIONS):
        return "path"
    if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", token):
        return "name"
    return "prose"


def path_files(token: str, files: set[str]) -> list[str]:
    """The checkout's files a path names (every file under a folder; ``<x>`` matches any name)."""
    pattern = re.sub(r"<[^>]+>", "*", token)
    if "/" not in pattern:
        return sorted(f for f in files if fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], pattern))
    if pattern.endswith("/"):
        return sorted(f for f in files if fnmatch.fnmatchcase(f, pattern + "*"))
    return sorted(f for f in files if fnmatch.fnmatchcase(f, pattern))


def resolve(token: str) -> tuple[ModuleType, object] | None:
    """The module a dotted name starts with and the object it names, or None."""
    parts = token.split(".")
    for package in PACKAGES:
        for cut in range(len(parts) - 1, 0, -1):
            try:
                module = importlib.import_module(package + ".".join(parts[:cut]))
            except ImportError:
                continue
            obj: object = module
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                continue
            return module, obj
    return None


def module_file(module: ModuleType) -> str:
    """The checkout path of a module (llamafleet.core is plugins/module_utils)."""
    path = Path(module.__file__ or "").resolve()
    for root in (REPO, (REPO / "collections/ansible_collections/llamafleet/cluster").resolve()):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    raise AssertionError("%s is not in the checkout" % path)


def named_files(text: str, files: set[str]) -> set[str]:
    """The files a recipe names, by path or by Python name."""
    named: set[str] = set()
    for token in re.findall(r"`([^`]+)`", text):
        if kind(token) == "path":
            named.update(path_files(token, files))
        elif kind(token) == "name" and (found := resolve(token)):
            named.add(module_file(found[0]))
    return named


def problems(text: str, files: set[str]) -> list[str]:
    """Paths that match no file and names that do not resolve."""
    out = []
    for token in re.findall(r"`([^`]+)`", text):
        if kind(token) == "path" and not path_files(token, files):
            out.append("no file %s" % token)
        elif kind(token) == "name" and resolve(token) is None:
            out.append("no Python name %s" % token)
    return out


def checkout_files() -> set[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return {f for f in out.splitlines() if (REPO / f).exists()}


FILES = checkout_files()
SECTION = section((REPO / "README.md").read_text(encoding="utf-8"))


def test_the_rules_on_made_up_references() -> None:
    files = {"plugins/modules/a.py", "roles/x/tasks/main.yml", "README.md"}
    text = ("`plugins/modules/<name>.py`, `roles/x/`, `README.md`, `gpu_probe._PROBES`, `/health`, `make sanity`, "
            "`plugins/modules/gone.py`, `gone.md`, `gpu_probe.NO_SUCH`, `no_such_module.X`")
    assert problems(text, files) == ["no file plugins/modules/gone.py", "no file gone.md",
                                     "no Python name gpu_probe.NO_SUCH", "no Python name no_such_module.X"]
    assert named_files("`gpu_probe._PROBES` and `roles/x/`", files | {"plugins/module_utils/gpu_probe.py"}) == {
        "plugins/module_utils/gpu_probe.py", "roles/x/tasks/main.yml"}


def test_each_recipe_is_there() -> None:
    assert set(RECIPES) <= set(recipes(SECTION)), "missing: %s" % sorted(set(RECIPES) - set(recipes(SECTION)))


def test_every_path_and_name_exists() -> None:
    assert re.findall(r"`([^`]+)`", SECTION), "the section names nothing"
    found = problems(SECTION, FILES)
    assert not found, "README's 'Where a change goes': %s" % "; ".join(found)


@pytest.mark.parametrize("recipe", [r for r, mark in RECIPES.items() if mark])
def test_each_recipe_names_every_place_of_an_existing_case(recipe: str) -> None:
    mark = re.compile(RECIPES[recipe] or "", re.I)
    places = {f for f in FILES if f.startswith(tuple(p + "/" for p in SEARCHED)) and f.endswith(EXTENSIONS)
              and mark.search((REPO / f).read_text(encoding="utf-8", errors="replace"))}
    assert len(places) >= 3, "%s: the mark %r finds almost nothing: %s" % (recipe, mark.pattern, places)
    missing = sorted(places - named_files(recipes(SECTION)[recipe], FILES))
    assert not missing, "README's '%s' does not name: %s" % (recipe, ", ".join(missing))
