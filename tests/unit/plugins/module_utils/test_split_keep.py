"""split_plan.keep_deployed: a deployed split is kept while the request is the same and it still fits."""

from __future__ import annotations

from llamafleet.core.split_plan import plan_split, request_key
from tests.unit.plugins.module_utils.test_split_cpu import cpu_fleet, expected_placement, placed
from tests.unit.plugins.module_utils.test_split_plan import cpu, model, worker

FACTS = model(n_layer=32, layer_mib=200, output_mib=130, embd_mib=130)  # 6.6 GiB: needs the three hosts


def deploy(free: tuple[int, int, int], **extra) -> dict:
    workers = [worker("w2", cpu(free[1], reserve_mib=0)), worker("w3", cpu(free[2], reserve_mib=0))]
    orchestrator = {"host": "w1", "devices": [cpu(free[0], reserve_mib=0)]}
    options = dict(ctx_size=2048, compute_mib=256, cpu_layers="auto")
    options.update(extra)
    return plan_split(workers, orchestrator, FACTS, **options)


def split_of(plan: dict) -> tuple[int, list[int]]:
    return plan["cpu_layers"], plan["tensor_split"]


def test_free_memory_that_moved_a_little_moves_no_layer() -> None:
    first = deploy((3000, 3000, 3000))
    # the next deploy reads a little less on w2 and a little more on w3 (page cache, the service's own growth)
    fresh = deploy((3000, 2890, 3110))
    assert split_of(fresh) != split_of(first), "the fixture must make a fresh plan move a layer"
    kept = deploy((3000, 2890, 3110), keep=first["keep"])
    assert split_of(kept) == split_of(first) and kept["identity"] == first["identity"]
    assert kept["keep"]["request_key"] == first["keep"]["request_key"]
    assert placed(kept) == expected_placement(kept)
    assert any("kept the deployed split" in line and "a fresh plan would give" in line
               for line in kept["explanation"]), kept["explanation"]
    # what it reports of each device is measured now, whatever split it keeps
    assert [d["free_mib"] for d in kept["devices"]] == [2890, 3110]


def test_a_deployed_split_that_no_longer_fits_is_planned_afresh() -> None:
    first = deploy((3000, 3000, 3000))
    shrunk = (3000, 2300, 3700)  # w2 can no longer hold its 11 layers
    fresh = deploy(shrunk)
    replanned = deploy(shrunk, keep=first["keep"])
    assert split_of(replanned) == split_of(fresh) != split_of(first)
    assert any("the deployed split (units %s) no longer fits" % first["keep"]["counts"] in line
               for line in replanned["explanation"]), replanned["explanation"]


def test_another_request_plans_afresh() -> None:
    first = deploy((3000, 3000, 3000))
    for change in ({"ctx_size": 1024}, {"cache_type_k": "q8_0"}, {"cpu_layers": 10},
                   {"policy": "fewest_hops"}):
        fresh = deploy((3000, 2890, 3110), **change)
        kept = deploy((3000, 2890, 3110), keep=first["keep"], **change)
        assert kept["keep"]["request_key"] != first["keep"]["request_key"], change
        assert split_of(kept) == split_of(fresh), change
        assert not any("kept the deployed split" in line for line in kept["explanation"]), change


def test_a_worker_added_or_renamed_is_another_request() -> None:
    first = deploy((3000, 3000, 3000))
    workers = [worker("w2", cpu(2890, reserve_mib=0)), worker("w4", cpu(3110, reserve_mib=0))]
    orchestrator = {"host": "w1", "devices": [cpu(3000, reserve_mib=0)]}
    plan = plan_split(workers, orchestrator, FACTS, ctx_size=2048, compute_mib=256, cpu_layers="auto",
                      keep=first["keep"])
    assert plan["keep"]["request_key"] != first["keep"]["request_key"]
    assert not any("kept the deployed split" in line for line in plan["explanation"])


def test_a_keep_entry_that_is_not_a_split_of_these_devices_is_ignored() -> None:
    first = deploy((3000, 3000, 3000))
    fresh = deploy((3000, 2890, 3110))
    counts = first["keep"]["counts"]
    for broken in ({"counts": counts[:1]}, {"counts": [True] * len(counts)}, {"counts": [c + 1 for c in counts]},
                   {"counts": None}, {"cpu_layers": -1}, {"cpu_layers": "4"}, {"request_key": "0" * 16}):
        kept = deploy((3000, 2890, 3110), keep=dict(first["keep"], **broken))
        assert split_of(kept) == split_of(fresh), broken


def test_a_request_key_leaves_out_what_is_measured() -> None:
    workers, orchestrator = cpu_fleet()
    plans = [plan_split(workers, orchestrator, FACTS, ctx_size=2048, compute_mib=256, cpu_layers="auto"),
             plan_split(*cpu_fleet(free=3100, orchestrator_free=2950), FACTS, ctx_size=2048, compute_mib=256,
                        cpu_layers="auto", link_rtt_ms=4.0)]
    assert plans[0]["keep"]["request_key"] == plans[1]["keep"]["request_key"]
    assert request_key([], None, {"costs": [1, 2], "host_bytes": 0}, "balanced", None, "auto") != request_key(
        [], None, {"costs": [1, 3], "host_bytes": 0}, "balanced", None, "auto")


def test_round_trips_that_make_fewer_hops_pay_are_a_new_plan() -> None:
    # equal workers on a LAN keep the spread; 20 ms to each makes balanced take fewest_hops (bench.yml's auto points)
    workers = [worker("w2", cpu(8000, reserve_mib=0)), worker("w3", cpu(8000, reserve_mib=0))]
    small = model(n_layer=16, layer_mib=100, output_mib=100, embd_mib=100)
    lan = plan_split(workers, {"host": "w1", "devices": []}, small, ctx_size=2048, link_rtt_ms=0.2)
    far = plan_split(workers, {"host": "w1", "devices": []}, small, ctx_size=2048, link_rtt_ms=20.0)
    assert (lan["policy"], far["policy"]) == ("balanced", "fewest_hops"), "the fixture must switch policies"
    assert far["keep"]["request_key"] == lan["keep"]["request_key"]  # round trips are not part of the request
    switched = plan_split(workers, {"host": "w1", "devices": []}, small, ctx_size=2048, link_rtt_ms=20.0,
                          keep=lan["keep"])
    assert (switched["policy"], switched["tensor_split"]) == (far["policy"], far["tensor_split"])
    back = plan_split(workers, {"host": "w1", "devices": []}, small, ctx_size=2048, link_rtt_ms=0.2,
                      keep=far["keep"])
    assert (back["policy"], back["tensor_split"]) == (lan["policy"], lan["tensor_split"])
