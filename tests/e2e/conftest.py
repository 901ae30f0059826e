"""A 3-host lab, deployed once for all end-to-end tests, removed afterwards."""

from __future__ import annotations

import json
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
    """The 3-host CPU lab deployed (compiles llama.cpp unless the controller's artifact cache has it).

    ``lab up --hosts 3`` first: after test_a_mixed_vulkan.py it boots lab1 and lab3 again as Debian 12 CPU hosts
    (bare hosts, deployed from here); on a lab that already has that shape it changes nothing."""
    started = time.monotonic()
    cli("lab", "up", "--hosts", "3", timeout=1200)
    run = playbook("deploy.yml", timeout=5400)
    run.seconds = time.monotonic() - started
    assert run.rc == 0, f"deploy.yml failed:\n{run.output[-8000:]}"
    return run


@pytest.fixture(scope="session")
def fleet(deployed):
    from llamafleet.fleet import Fleet

    return Fleet.from_inventory(INVENTORY)


# The label of the llama.cpp commit vendored in llama-cpp-python 0.3.35 (its changelog: ggml-org/llama.cpp@4df29be4f).
OTHER_LLAMACPP_COMMIT = "4df29be4f"


@pytest.fixture(scope="session")
def other_llamacpp_source(lab) -> dict[str, str]:
    """The llamacpp_build settings of a second llama.cpp source (llama-cpp-python 0.3.35's, RPC protocol 5 where
    the lab's has 7), published on the lab's mirror: the upgrade and the bench's builds side by side use it, so
    a fresh machine compiles it once for both (then the controller's artifact cache has it)."""
    from llamafleet.lab import LabPaths
    from llamafleet.lab.artifacts import LLAMA_CPP_OTHER_SOURCE, ensure_artifact, llama_cpp_archive_subdir
    from llamafleet.lab.mirror import publish

    path = ensure_artifact(LLAMA_CPP_OTHER_SOURCE, LabPaths.default().root)
    return {
        "llamacpp_build_archive_url": publish(path, LLAMA_CPP_OTHER_SOURCE.subdir),
        "llamacpp_build_archive_sha256": LLAMA_CPP_OTHER_SOURCE.sha256,
        "llamacpp_build_archive_subdir": llama_cpp_archive_subdir(LLAMA_CPP_OTHER_SOURCE),
        "llamacpp_build_version": OTHER_LLAMACPP_COMMIT,
    }
