"""systemd_show: the one command line of ``systemctl show`` and the one reader of its output."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from llamafleet.core.systemd_show import parse_show, parse_show_units, show_argv, show_units, units_to_enable_and_start

FIXTURES = Path(__file__).resolve().parents[2] / "llamafleet" / "fixtures"


def test_one_unit_or_several_with_their_properties() -> None:
    assert show_argv("a.service", ["MainPID", "ActiveState"]) == [
        "systemctl", "show", "--property=MainPID,ActiveState", "--", "a.service"]
    assert shlex.join(show_argv(["a.service", "b c.service"], ("Id", "ActiveState"))) == (
        "systemctl show --property=Id,ActiveState -- a.service 'b c.service'")
    assert show_argv("a.service", ["InvocationID"], value=True) == [
        "systemctl", "show", "--property=InvocationID", "--value", "--", "a.service"]


@pytest.mark.parametrize(("text", "values"), [
    ("MainPID=4321\nActiveState=active\n", {"MainPID": "4321", "ActiveState": "active"}),
    ("InvocationID=\nExecStart={ path=/x ; argv[]=/x a=b }\n",
     {"InvocationID": "", "ExecStart": "{ path=/x ; argv[]=/x a=b }"}),  # the first '=' splits
    ("", {}),
    ("\nActiveState=failed\n\n", {"ActiveState": "failed"}),
])
def test_one_units_properties(text: str, values: dict[str, str]) -> None:
    assert parse_show(text) == values


def test_blocks_per_unit_on_recorded_output() -> None:
    units = parse_show_units((FIXTURES / "systemctl-252_show_units_reconstructed.txt").read_text(encoding="utf-8"))
    assert [u["Id"] for u in units] == [
        "llamafleet-llama-server.service", "llamafleet-rpc-server.service", "llamafleet-rpc-server-cuda0.service",
        "llamafleet-rpc-server-cuda1.service", "llamafleet-rpc-server-vulkan0.service"]
    assert units[3] == {"NRestarts": "3", "Id": "llamafleet-rpc-server-cuda1.service", "LoadState": "loaded",
                        "ActiveState": "activating", "SubState": "auto-restart",
                        "ActiveEnterTimestamp": "Mon 2026-11-23 17:41:30 UTC"}
    assert units[4]["ActiveEnterTimestamp"] == "" and units[4]["LoadState"] == "not-found"


def test_blocks_per_unit_reject_other_text() -> None:
    with pytest.raises(ValueError, match="not a property line"):
        parse_show_units("Failed to connect to bus: Host is down\n")
    assert parse_show_units("") == []


STATES = FIXTURES / "systemctl-252_show_states_lab2_real.txt"


def test_what_to_enable_and_start_on_a_converged_worker() -> None:
    """Recorded on lab2 after a deploy: the worker's units need nothing, a oneshot running now (static, activating)
    neither; the unit that is not there and the masked one are refused by name; a disabled, stopped unit is both."""
    shown = parse_show_units(STATES.read_text(encoding="utf-8"))
    units = [block["Id"] for block in shown]
    assert units[:5] == ["llamafleet-rpc-firewall.service", "llamafleet-rpc-server.service",
                         "llamafleet-rpc-guard.service", "llamafleet-rpc-metrics.service", "llamafleet-rpc-metrics.timer"]
    to_enable, to_start, problems = units_to_enable_and_start(units, shown)
    assert to_enable == ["nftables.service"] and to_start == ["nftables.service"]
    assert problems == [
        "llamafleet-no-such.service cannot be started: LoadState=not-found UnitFileState=-",
        "llamafleet-probe-masked.service cannot be started: LoadState=masked UnitFileState=masked"]
    stopped = [dict(block, ActiveState="failed") if block["Id"] == "llamafleet-rpc-server.service" else block
               for block in shown[:5]]
    assert units_to_enable_and_start(units[:5], stopped) == ([], ["llamafleet-rpc-server.service"], [])


def test_what_to_enable_and_start_needs_a_block_per_unit() -> None:
    shown = parse_show_units(STATES.read_text(encoding="utf-8"))
    with pytest.raises(ValueError, match="asked about 2 units, systemctl described 9"):
        units_to_enable_and_start(["a.service", "b.service"], shown)


def test_show_units_reads_each_block_and_names_the_units_when_systemctl_fails() -> None:
    asked = []

    def run(argv: list[str]) -> tuple[int, str, str]:
        asked.append(argv)
        return 0, "Id=a.service\nActiveState=active\n\nId=b.service\nActiveState=failed\n", ""

    assert show_units(run, ["a.service", "b.service"], ["Id", "ActiveState"]) == [
        {"Id": "a.service", "ActiveState": "active"}, {"Id": "b.service", "ActiveState": "failed"}]
    assert asked == [show_argv(["a.service", "b.service"], ["Id", "ActiveState"])]
    with pytest.raises(ValueError, match="^systemctl show a.service failed: Failed to connect to bus$"):
        show_units(lambda argv: (1, "", "Failed to connect to bus\n"), ["a.service"], ["Id"])
    with pytest.raises(ValueError, match="^systemctl show a.service: not a property line"):
        show_units(lambda argv: (0, "oops\n", ""), ["a.service"], ["Id"])
