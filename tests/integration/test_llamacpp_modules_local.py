"""The modules that run llama.cpp's binaries, on a real build: llamacpp_info reads its flags, gpu_facts asks
its rpc-server for the devices.

Binaries as for test_llamacpp_local.py: $LLAMAFLEET_LLAMACPP_BIN (``make llamacpp-local-test`` sets it to the
deploy's artifact), else the dev build; without them the tests are skipped, and under CI=true they fail.
"""

from __future__ import annotations

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import gpu_facts, llamacpp_info
from tests.integration import test_llamacpp_local as local
from tests.unit.module_runner import run_main
from tests.unit.needs import require


@pytest.fixture(autouse=True)
def _build() -> None:
    require(local.RPC_SERVER is not None and local.LLAMA_SERVER is not None,
            "a llama.cpp build (ggml-rpc-server and llama-server): set LLAMAFLEET_LLAMACPP_BIN to its bin folder")


def test_llamacpp_info_reads_a_real_build(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_main(llamacpp_info.main, {"bin_dir": str(local.BIN_DIR), "require": ["llama_server", "rpc_server"]},
                          capsys)
    assert rc == 0, result
    assert result["rpc_server"] == local.RPC_SERVER.name
    assert result["features"]["llama_server"]["rpc"] and result["features"]["llama_server"]["load_mode"]
    assert result["features"]["rpc_server"]["cache"]


def test_real_rpc_server_lists_its_devices(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_main(gpu_facts.main, {"backends": ["cpu"], "rpc_server": str(local.RPC_SERVER),
                                           "overrides": [{"match": "cpu", "max_mib": 600}]}, capsys)
    assert rc == 0, result
    assert result["tools"]["rpc-server"] == "ok"
    (dev,) = result["rpc_devices"]
    assert (dev["ggml_name"], dev["max_mib"]) == ("CPU", 600)
    assert dev["free_mib"] == result["devices"][0]["free_mib"]  # MemAvailable, not llama.cpp's MemTotal
