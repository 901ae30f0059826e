"""Hooks for every test folder: the ``needs`` mark (tests/unit/needs.py) is checked before each test, so a test
that needs what the machine lacks is skipped, and fails naming it under CI=true."""

from __future__ import annotations

import pytest

from tests.unit.needs import require


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(present, what): a test that needs what this machine may lack "
                                       "(needs.py: skipped without it, failed under CI=true)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        require(*mark.args)
