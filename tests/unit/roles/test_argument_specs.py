"""Every role's meta/argument_specs.yml documents exactly its defaults, with the same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[3] / "roles"
ROLE_DIRS = sorted(p for p in ROLES.iterdir() if (p / "tasks" / "main.yml").is_file())


def _load(path: Path) -> dict:
    """A YAML mapping; a role without the file (the private _common has no defaults) gives {}."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle) or {}


def test_there_are_roles() -> None:
    assert {p.name for p in ROLE_DIRS} >= {"_common", "llamacpp_build", "model", "rpc_server", "llama_server"}


@pytest.mark.parametrize("role", ROLE_DIRS, ids=lambda p: p.name)
def test_specs_match_defaults(role: Path) -> None:
    defaults = _load(role / "defaults" / "main.yml")
    options = _load(role / "meta" / "argument_specs.yml")["argument_specs"]["main"].get("options") or {}
    assert set(options) == set(defaults), (
        f"{role.name}: only in defaults: {sorted(set(defaults) - set(options))}, "
        f"only in argument_specs: {sorted(set(options) - set(defaults))}"
    )
    for name, spec in options.items():
        if spec.get("required"):
            continue
        assert "default" in spec, f"{role.name}: {name} has no default in argument_specs"
        assert spec["default"] == defaults[name], f"{role.name}: {name} differs: {spec['default']!r} != {defaults[name]!r}"


@pytest.mark.parametrize("role", ROLE_DIRS, ids=lambda p: p.name)
def test_variables_are_prefixed(role: Path) -> None:
    defaults = _load(role / "defaults" / "main.yml")
    bad = [k for k in defaults if not k.startswith(role.name + "_")]
    assert not bad, f"{role.name}: defaults without the role prefix: {bad}"
