"""tests/run_stages.sh, make test's and make check's runner, with a stand-in for make that logs each stage's start and
end: --first stages end before anything else starts, --beside stages run while the others do, a failure's status
is the runner's, and the table names every stage that ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "tests" / "run_stages.sh"

# the stand-in: `FAKE --no-print-directory STAGE` logs "start STAGE", sleeps, logs "end STAGE"; a stage named fail-*
# exits 3
FAKE_MAKE = """#!/usr/bin/env bash
stage=$2
echo "start $stage" >> "{log}"
sleep 0.3
echo "end $stage" >> "{log}"
case "$stage" in fail-*) exit 3 ;; esac
"""


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tmp_path / "stages.log"
    fake = tmp_path / "fake-make"
    fake.write_text(FAKE_MAKE.format(log=log))
    fake.chmod(0o755)
    done = subprocess.run([str(RUNNER), str(fake), *args], capture_output=True, text=True, timeout=60, check=False)
    return done, log.read_text().splitlines() if log.exists() else []


def test_first_stages_end_before_the_others_start_and_beside_runs_meanwhile(tmp_path: Path) -> None:
    done, events = run(tmp_path, "--first", "t1 t2", "--beside", "b1 b2", "m1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert events[:4] == ["start t1", "end t1", "start t2", "end t2"], events
    # b1 and m1 start together once the first stages are done; b2 after b1
    assert set(events[4:6]) == {"start b1", "start m1"}, events
    assert events.index("start b2") > events.index("end b1")
    for stage in ("t1", "t2", "b1", "b2", "m1"):
        assert any(line.split()[0] == stage for line in done.stdout.splitlines()[-7:]), done.stdout
    assert "in all" in done.stdout.splitlines()[-1]


def test_a_failed_first_stage_stops_everything(tmp_path: Path) -> None:
    done, events = run(tmp_path, "--first", "fail-t1 t2", "--beside", "b1", "m1")
    assert done.returncode == 3
    assert events == ["start fail-t1", "end fail-t1"], events
    assert "fail-t1" in done.stdout and "FAILED" in done.stdout


def test_a_failed_beside_stage_fails_the_run_after_the_others_end(tmp_path: Path) -> None:
    done, events = run(tmp_path, "--beside", "fail-b1 b2", "m1", "m2")
    assert done.returncode == 3
    assert "start b2" not in events and "end m2" in events, events
    assert "==> fail-b1 (beside the others) ended: its output" in done.stdout


def test_options_in_make_tests_order_still_parse(tmp_path: Path) -> None:
    done, events = run(tmp_path, "--beside", "b1", "--nice", "b1", "m1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(events) == ["end b1", "end m1", "start b1", "start m1"]
