"""host_units' main() against a stand-in systemctl on PATH (this machine runs no systemd): one read of every unit,
``enable_only`` units enabled and never started, the others enabled and started where they are not, each unit's
ActiveState as read before the run acted, and check mode changing nothing."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import host_units
from tests.unit.module_runner import run_main

# A systemctl that keeps its units in state.json and logs each call to calls.log.
FAKE = """#!{python}
import json, sys
here = {here!r}
with open(here + "/calls.log", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
with open(here + "/state.json") as handle:
    units = json.load(handle)
args = [a for a in sys.argv[1:] if a != "--"]
if args[0] == "show":
    print("\\n\\n".join("Id=%s\\nLoadState=loaded\\nUnitFileState=%s\\nActiveState=%s" % (
        name, units[name][0], units[name][1]) for name in args[2:]))
elif args[0] == "enable":
    for name in args[1:]:
        units[name][0] = "enabled"
elif args[0] == "start":
    units[args[1]][1] = "active"
with open(here + "/state.json", "w") as handle:
    json.dump(units, handle)
"""


@pytest.fixture()
def systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "systemctl"
    script.write_text(FAKE.format(python=sys.executable, here=str(tmp_path)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "state.json").write_text(json.dumps({
        "gate.service": ["enabled", "active"], "llama.service": ["disabled", "inactive"],
        "timer.timer": ["disabled", "failed"]}))
    monkeypatch.setenv("PATH", "%s%s%s" % (tmp_path, os.pathsep, os.environ["PATH"]))
    return tmp_path


def calls(where: Path) -> list[str]:
    return (where / "calls.log").read_text().splitlines()


def test_enable_only_units_are_enabled_not_started(systemctl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(host_units.main, {"units": ["timer.timer", "gate.service"], "enable_only": ["llama.service"]},
                       capsys)
    assert rc == 0 and out["changed"] is True
    assert out["active_states"] == {"timer.timer": "failed", "gate.service": "active", "llama.service": "inactive"}
    assert out["enabled"] == ["timer.timer", "llama.service"] and out["started"] == ["timer.timer"]
    assert [c.split()[0] for c in calls(systemctl)] == ["show", "enable", "start"]
    assert calls(systemctl)[2] == "start -- timer.timer"
    state = json.loads((systemctl / "state.json").read_text())
    assert state["llama.service"] == ["enabled", "inactive"]

    # converged: one read, nothing else; the states it read come back
    (systemctl / "calls.log").unlink()
    rc, again = run_main(host_units.main, {"units": ["gate.service"], "enable_only": ["llama.service"]}, capsys)
    assert rc == 0 and again["changed"] is False and again["enabled"] == [] and again["started"] == []
    assert again["active_states"] == {"gate.service": "active", "llama.service": "inactive"}
    assert [c.split()[0] for c in calls(systemctl)] == ["show"]


def test_check_mode_reports_and_changes_nothing(systemctl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_main(host_units.main, {"units": [], "enable_only": ["llama.service"], "_ansible_check_mode": True},
                       capsys)
    assert rc == 0 and out["changed"] is True and out["enabled"] == ["llama.service"] and out["started"] == []
    assert [c.split()[0] for c in calls(systemctl)] == ["show"]
