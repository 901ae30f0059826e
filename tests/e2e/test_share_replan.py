"""A re-plan moves only the difference of each worker's share, and prunes the rest once the new plan serves.

Run by ``make separate-e2e-test`` (tests/e2e/conftest.SEPARATE: two deploys that restart llama-server, about 4
minutes that make test cannot hold within CI's time), on the deployed lab; it deploys the default plan again after.
"""

from __future__ import annotations

from tests.e2e.test_weights_local import _cache_listing, _expected, _stamps
from tests.helpers import playbook


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
