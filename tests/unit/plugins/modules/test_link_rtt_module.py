"""link_rtt module: its checks, and real echoes to this machine's loopback."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import link_rtt
from tests.unit.module_runner import run_main, warning_messages
from tests.unit.needs import needs


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(link_rtt.main, args, capsys)


@pytest.mark.parametrize("args, message", [
    ({"endpoints": [{"address": "127.0.0.1"}], "count": 0}, "count is 0, expected at least 1 echo per host"),
    ({"endpoints": [{"address": "127.0.0.1"}], "timeout": 0}, "timeout is 0.0, expected seconds > 0"),
    ({"endpoints": [{"address": "127.0.0.1"}, {"host": "lab3"}]}, "endpoints [1] have no address"),
])
def test_bad_input(args: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(args, capsys)
    assert rc == 1 and result["msg"] == message


@needs(os.geteuid() == 0, "root (a raw ICMP socket)")
def test_measures_and_warns_about_a_silent_host(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module({"endpoints": [{"host": "lab2", "address": "127.0.0.1", "port": 50052},
                                           {"host": "gone", "address": "198.51.100.7", "port": 50052}],
                             "count": 2, "timeout": 0.2, "_ansible_check_mode": True}, capsys)
    assert rc == 0 and result["changed"] is False
    first, second = result["endpoints"]
    assert first["host"] == "lab2" and first["port"] == 50052 and first["rtt_ms"] > 0
    assert second["rtt_ms"] is None
    assert any("198.51.100.7 answered none of 2 ICMP echoes" in w for w in warning_messages(result))
