"""Run an Ansible module's main() in-process, as the module tests do."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest
from ansible.module_utils.testing import patch_module_args


def run_main(main: Callable[[], None], args: dict[str, Any],
             capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    """Call ``main`` with ``args`` as module arguments; returns (exit code, parsed JSON result)."""
    with patch_module_args(args), pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code or 0, json.loads(capsys.readouterr().out)
