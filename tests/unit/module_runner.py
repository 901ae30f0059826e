"""Run an Ansible module's main() in-process, as the module tests do."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
from ansible.module_utils.testing import patch_module_args

try:  # ansible-core 2.19 and later
    from ansible.module_utils import _internal as module_internal
except ImportError:  # pragma: no cover - older ansible-core has no controller switch
    module_internal = None


@contextmanager
def on_a_host() -> Iterator[None]:
    """A module runs on a host, where ansible-core's module_utils are not the controller's: once a test in this
    process has imported controller code (a filter plugin, ``ansible.errors``), ansible-core 2.19 sends a module's
    warnings to the controller's display instead of its result, so the module tests would see none."""
    if module_internal is None:
        yield
        return
    before = module_internal.is_controller
    module_internal.is_controller = False
    try:
        yield
    finally:
        module_internal.is_controller = before


def run_main(main: Callable[[], None], args: dict[str, Any],
             capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    """Call ``main`` with ``args`` as module arguments; returns (exit code, parsed JSON result)."""
    with on_a_host(), patch_module_args(args), pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code or 0, json.loads(capsys.readouterr().out)


# check mode with diff, apply, apply again, check mode: (extra arguments, whether the run reports a change)
FOUR_RUNS = [({"_ansible_check_mode": True, "_ansible_diff": True}, True), ({}, True), ({}, False),
             ({"_ansible_check_mode": True}, False)]


def run_four(main: Callable[[], None], base: dict[str, Any], capsys: pytest.CaptureFixture[str],
             after_each: Callable[[dict[str, Any], dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """The four-run idempotence check of a module (FOUR_RUNS); the four results.

    ``after_each(extra, result)`` runs after every run, for checks of what the run left behind.
    """
    results = []
    for extra, changed in FOUR_RUNS:
        rc, result = run_main(main, {**base, **extra}, capsys)
        assert rc == 0, result
        assert result["changed"] is changed, (extra, result)
        if after_each is not None:
            after_each(extra, result)
        results.append(result)
    return results


def warning_messages(result: dict[str, Any]) -> list[str]:
    """The texts of a module result's warnings (ansible-core 2.19 wraps each in a dict, older ones do not)."""
    return [w["event"]["msg"] if isinstance(w, dict) else w for w in result.get("warnings", [])]
