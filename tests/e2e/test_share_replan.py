"""A re-plan moves only the difference of each worker's share, and prunes the rest once the new plan serves; a
worker whose disk cannot take its share refuses it before anything changes.

Run by ``make separate-e2e-test`` (tests/e2e/conftest.SEPARATE: two deploys that restart llama-server, about 4
minutes that make test cannot hold within CI's time, and the refused one), on the deployed lab; it deploys the
default plan again after.
"""

from __future__ import annotations

from llamafleet.bench.cache import CACHE_DIR
from llamafleet.cluster import read_plan
from tests.e2e.test_deploy import assert_fails_before_any_change
from tests.e2e.test_weights_local import _cache_listing, _expected, _stamps
from tests.helpers import playbook


def test_a_disk_too_small_for_the_share_is_refused_before_any_change(deployed, fleet):
    """A worker's cache lacks one file of its share, and its disk has less room than the file and the free space to
    leave (llama_server_share_free_margin_mib, set above the worker's free space: a disk too small): the share's
    disk check refuses on that worker before anything is sent, naming the host, the space and what to change. No
    unit restarts or changes, the recorded plan stays, and the old plan serves on.

    Not in make test's quiet batch: a cache file missing on a worker would make the batch's second deploy and
    check mode send it (a change), and the share's disk check runs only when something is missing. (A bigger share
    comes from a new model or another split, whose unit and plan record the llama_server role writes before the
    share step: that case is not refused before any change.)"""
    expected = _expected(fleet)
    host = next(h for h, names in sorted(expected.items()) if names)
    worker = next(w for w in fleet.workers if w.name == host)
    name = sorted(expected[host])[0]
    aside = f"{CACHE_DIR}.aside-{name}"  # out of the cache, on its file system
    plan = read_plan(fleet)
    fleet.run_one(f"mv {CACHE_DIR}/{name} {aside}", worker, what="move a cache file aside")
    try:
        free_mib = int(fleet.run_one(f"df --output=avail -B1M {CACHE_DIR} | tail -1", worker, what="free space"))
        assert_fails_before_any_change(fleet, ["-e", f"llama_server_share_free_margin_mib={free_mib + 1024}"],
                                       (f"{host}: the share needs ", f"(+{free_mib + 1024} MiB margin)",
                                        "(llama_server_share_degraded: false"))
    finally:
        fleet.run_one(f"mv {aside} {CACHE_DIR}/{name}", worker, what="put the cache file back")
    assert read_plan(fleet) == plan
    assert _cache_listing(fleet) == expected


def test_replan_moves_only_the_difference_and_prunes_after(deployed, fleet):
    """fewest_hops puts every layer and the output on one worker: only the tensors it lacked are sent to it, the
    other's go only after the new plan serves; the default plan back sends them back."""
    before = _expected(fleet)
    stamps = _stamps(fleet)
    try:
        run = playbook("deploy.yml", "-e", "llama_server_split_policy=fewest_hops")
        assert run.rc == 0, run.output[-4000:]
        after = _expected(fleet)
        assert after != before, (before, after)
        # pruned once the new plan served: exactly the new shares
        assert _cache_listing(fleet) == after
        now = _stamps(fleet)
        for host, names in after.items():
            for name in names & before[host]:  # kept, not sent again
                assert now[host][name] == stamps[host][name], (host, name)
    finally:
        back = playbook("deploy.yml")
        assert back.rc == 0, back.output[-4000:]
    assert _cache_listing(fleet) == before
