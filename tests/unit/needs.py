"""Tests that depend on the machine: skipped where what they need is missing, failed under CI.

``@needs(present, what)`` marks a test; ``require(present, what)`` checks inside a test or fixture.
Where ``CI`` is ``true`` a missing need fails the test and names it, so that CI never passes by skipping.
"""

from __future__ import annotations

import os

import pytest

from llamafleet.lab.artifacts import LLAMA_CPP_SOURCE, MODEL
from llamafleet.lab.paths import cache_root

# The lab's pinned model and llama.cpp source in $LLAMAFLEET_CACHE, where `make unit` fetches them first
# (python -m llamafleet.lab.fetch), as `llamafleet lab up` does.
LAB_MODEL = MODEL.path(cache_root())
LAB_SOURCE = LLAMA_CPP_SOURCE.path(cache_root())


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


def needs_lab_model() -> pytest.MarkDecorator:
    """Mark a test that reads the lab model (:data:`LAB_MODEL`)."""
    return needs(LAB_MODEL.is_file(), "the lab model %s (python -m llamafleet.lab.fetch model)" % LAB_MODEL)
