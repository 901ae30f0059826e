"""Runs that must change nothing on the converged CPU lab, run together.

Many end-to-end tests run a playbook that must change nothing: bad input that preflight refuses, a second deploy,
check mode, a deploy from another install route or on another ansible-core. Alone, each takes 20-60 s, most of it
spent waiting on SSH and on the hosts. Modules register them here when they are imported (``@quiet("name")``);
the session fixture ``quiet_runs`` (conftest.py) runs all of them, ``WORKERS`` at a time, the first time a test asks
for it (right after the first deploy, in test_deploy.py), and checks once, around the whole batch, that no unit
restarted, no unit file changed and the cluster still serves. So a run that changed anything fails the batch, and
every test that uses it. Each test then asserts its own run's outcome: ``quiet_runs["name"]``.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# deploy.yml runs at once on the 2-core controller (measured: 4 at once take about half the time of one after another)
WORKERS = 4

_CASES: dict[str, Callable[[Path], Any]] = {}
_CLEANUPS: list[Callable[[], None]] = []
# re-entrant: what ``once`` makes may register its cleanup with ``after_batch`` while ``once`` holds it
_LOCK = threading.RLock()


def quiet(name: str) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    """Register ``function(work_dir)`` as the run ``name`` of the batch; its return value is the run's outcome."""

    def register(function: Callable[[Path], Any]) -> Callable[[Path], Any]:
        if name in _CASES:
            raise ValueError(f"quiet run {name!r} registered twice")
        _CASES[name] = function
        return function

    return register


def after_batch(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` once the whole batch has ended (for what several runs share, made by the first that needs it)."""
    with _LOCK:
        _CLEANUPS.append(cleanup)


def once(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make`` called by the first run that asks, its value shared with the others (thread-safe)."""
    made: list[Any] = []

    def get() -> Any:
        with _LOCK:
            if not made:
                made.append(make())
            return made[0]

    return get


class Outcomes(dict):
    """``{name: outcome}``; a run that raised raises again where a test reads it."""

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if isinstance(value, BaseException):
            raise AssertionError(f"quiet run {name!r} raised {type(value).__name__}: {value}") from value
        return value


def run_all(unchanged: Callable[[], Any]) -> Outcomes:
    """Every registered run, ``WORKERS`` at a time, inside ``unchanged`` (a context manager that asserts no change)."""
    outcomes = Outcomes()
    with tempfile.TemporaryDirectory(prefix="llamafleet-quiet-") as tmp:
        try:
            with unchanged(), ThreadPoolExecutor(WORKERS) as pool:
                futures = {}
                for name, function in _CASES.items():
                    work = Path(tmp) / name
                    work.mkdir()
                    futures[name] = pool.submit(function, work)
                for name, future in futures.items():
                    try:
                        outcomes[name] = future.result()
                    except Exception as exc:  # noqa: BLE001 - kept for the test that reads this run
                        outcomes[name] = exc
        finally:
            for cleanup in _CLEANUPS:
                cleanup()
    return outcomes

