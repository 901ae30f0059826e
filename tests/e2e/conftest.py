"""A 3-host lab, deployed once for all end-to-end tests, removed afterwards."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers import INVENTORY, cli, playbook


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def lab():
    if os.geteuid() != 0:
        pytest.fail("the end-to-end tests need root (they create real lab hosts)")
    started = time.monotonic()
    cli("lab", "up", "--hosts", "3", timeout=1200)
    print(f"lab up: {time.monotonic() - started:.1f} s")
    yield INVENTORY
    if os.environ.get("LLAMAFLEET_KEEP_LAB") != "1":
        cli("lab", "down", timeout=300)


@pytest.fixture(scope="session")
def deployed(lab):
    """The first deploy from bare hosts (compiles llama.cpp unless the controller's artifact cache has it)."""
    started = time.monotonic()
    run = playbook("deploy.yml", timeout=5400)
    run.seconds = time.monotonic() - started
    assert run.rc == 0, f"deploy.yml failed:\n{run.output[-8000:]}"
    return run


@pytest.fixture(scope="session")
def fleet(deployed):
    from llamafleet.fleet import Fleet

    return Fleet.from_inventory(INVENTORY)
