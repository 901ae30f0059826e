"""Tests that depend on the machine: skipped where what they need is missing, failed under CI.

``@needs(present, what)`` marks a test; ``require(present, what)`` checks inside a test or fixture.
Where ``CI`` is ``true`` a missing need fails the test and names it, so that CI never passes by skipping.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """Whether this run is CI's (the environment variable CI is "true")."""
    return os.environ.get("CI", "").strip().lower() == "true"


def require(present: object, what: str) -> None:
    """Skip the running test (or module) unless ``present`` (under CI: fail it, naming ``what``)."""
    if present:
        return
    if in_ci():
        pytest.fail("CI=true and this test needs %s, which is missing" % what, pytrace=False)
    pytest.skip("needs %s" % what, allow_module_level=True)


def needs(present: object, what: str) -> pytest.MarkDecorator:
    """Mark a test that needs ``what`` (``present``: whether this machine has it); conftest checks it at setup."""
    return pytest.mark.needs(bool(present), what)
