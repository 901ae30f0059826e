"""split_policies: the balanced optimum, even, fewest_hops, the per-token estimate and the latency switch."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from llamafleet.core.split_policies import (
    balanced_counts,
    check_counts_fit,
    choose_split,
    device_loads,
    estimate_ms,
    even_counts,
    fewest_hops_counts,
    worth_fewer_hops,
)
from llamafleet.core.split_units import MIB, PlanError

# --- helpers -------------------------------------------------------------------------------------


def brute_force(costs: list[int], capacities: list[int]) -> tuple[float, list[int]] | None:
    """The least sum(load^2 / capacity) over every contiguous split that fits, by enumeration."""
    units, n = len(costs), len(capacities)
    best = None
    for cuts in itertools.combinations_with_replacement(range(units + 1), n - 1):
        counts = [b - a for a, b in zip((0,) + cuts, cuts + (units,))]
        loads = device_loads(counts, costs)
        if any(load > cap for load, cap in zip(loads, capacities)):
            continue
        cost = sum(load * load / cap for load, cap in zip(loads, capacities))
        if best is None or cost < best[0] - 1e-9 * best[0]:
            best = (cost, counts)
    return best


def dev(name: str, capacity_mib: int, local: bool = False, rtt: float | None = None, bandwidth: float = 50.0,
        margin: int = 0) -> dict[str, Any]:
    """A sized device as split_devices.size_devices leaves it."""
    return {"name": name, "host": name.lower(), "endpoint": None if local else "%s:50052" % name.lower(),
            "description": name, "local": local, "usable_mib": capacity_mib + margin, "compute_mib": margin,
            "capacity": capacity_mib * MIB, "rtt_ms": 0.0 if local else rtt, "bandwidth_gbs": bandwidth,
            "free_mib": capacity_mib + margin, "device": {}}


def sizing(costs_mib: list[float]) -> dict[str, Any]:
    costs = [int(c * MIB) for c in costs_mib]
    return {"n_layer": len(costs) - 1, "units": len(costs), "costs": costs, "layer_bytes": costs[:-1],
            "kv": [0] * (len(costs) - 1), "output_bytes": costs[-1]}


# --- balanced ------------------------------------------------------------------------------------

def test_balanced_is_the_exact_optimum() -> None:
    rng = random.Random(12)
    for dummy in range(400):
        units = rng.randint(1, 9)
        costs = [rng.randint(1, 50) for dummy in range(units)]
        capacities = [rng.randint(5, 200) for dummy in range(rng.randint(1, 4))]
        expected = brute_force(costs, capacities)
        found = balanced_counts(costs, capacities)
        if expected is None:
            assert found is None, (costs, capacities, found)
            continue
        assert found is not None, (costs, capacities)
        loads = device_loads(found, costs)
        assert all(load <= cap for load, cap in zip(loads, capacities))
        cost = sum(load * load / cap for load, cap in zip(loads, capacities))
        assert cost == pytest.approx(expected[0], rel=1e-9), (costs, capacities, found, expected)


@pytest.mark.parametrize("costs, capacities, expected", [
    ([1] * 19, [10, 10, 10], [7, 6, 6]),          # ties go to the earlier devices, as -ts 1,1,1 does
    ([1] * 40, [300, 100], [30, 10]),             # proportional to capacity when units are fine
    ([1] * 40, [100, 300], [10, 30]),
    ([10] * 10, [1000, 60, 1000], [5, 0, 5]),     # a share of 2.9 bytes, under half a unit of 10: one unbalances more
    ([10] * 10, [1000, 200, 1000], [5, 1, 4]),    # a share of 9.1 takes a unit: it relieves more than it costs
    ([5] * 3 + [100], [1000] * 4, [1, 1, 1, 1]),  # as many units as devices: each device gets one
    ([5] * 2 + [100], [1000] * 4, [1, 1, 1, 0]),  # fewer units than devices: the last device has nothing to take
    ([10] * 5, [25, 25], None),                   # 50 into 2 x 25 would need a split unit
])
def test_balanced_counts(costs: list[int], capacities: list[int], expected: list[int] | None) -> None:
    assert balanced_counts(costs, capacities) == expected


# --- even, fewest_hops ---------------------------------------------------------------------------

@pytest.mark.parametrize("n_devices, n_layer, expected", [(4, 18, [5, 5, 5, 4]), (3, 18, [7, 6, 6]), (1, 5, [6])])
def test_even_counts(n_devices: int, n_layer: int, expected: list[int]) -> None:
    assert even_counts(n_devices, n_layer) == expected


@pytest.mark.parametrize("capacities, local, total, expected", [
    ([100, 300, 200], None, 250, [0, 11, 0]),        # the largest alone holds it
    ([100, 300, 200], None, 450, [0, 7, 4]),         # the two largest, in --rpc order
    ([100, 300, 300], None, 250, [0, 11, 0]),        # equal memory: the earlier one
    ([100, 300, 200], 1000, 450, [0, 0, 0, 11]),     # the local GPU alone: no hop at all
    ([100, 300, 200], 200, 450, [0, 7, 0, 4]),       # the local GPU and the largest worker
    ([100, 300, 200], 150, 450, [0, 5, 3, 3]),       # 150 + 300 MiB, but in whole units: one more worker
    ([100, 100], None, 450, None),
])
def test_fewest_hops_counts(capacities: list[int], local: int | None, total: int,
                            expected: list[int] | None) -> None:
    devices = [dev("RPC%d" % i, c) for i, c in enumerate(capacities)]
    if local is not None:
        devices.append(dev("CUDA0", local, local=True))
    costs = [int(total / 11 * MIB)] * 11
    assert fewest_hops_counts(devices, costs) == expected


def test_check_counts_fit_names_the_device() -> None:
    devices = [dev("RPC0", 100, margin=10), dev("RPC1", 100, margin=10)]
    check_counts_fit(devices, [1, 1], [90 * MIB, 100 * MIB], "policy even", "use balanced")
    with pytest.raises(PlanError, match=r"policy even puts 1 units \(111 MiB with KV and compute margin\) on RPC1 "
                                        r"\(host rpc1, rpc1:50052, RPC1\), which has 110 MiB usable: use balanced"):
        check_counts_fit(devices, [1, 1], [90 * MIB, 101 * MIB], "policy even", "use balanced")


# --- the estimate and the latency switch ---------------------------------------------------------

def test_estimate_counts_bytes_over_bandwidth_and_one_round_trip_per_used_rpc_device() -> None:
    devices = [dev("RPC0", 1000, rtt=2.0, bandwidth=10.0), dev("RPC1", 1000, rtt=3.0),
               dev("RPC2", 1000, rtt=None), dev("CUDA0", 1000, local=True, bandwidth=100.0)]
    costs = [10**9, 10**9, 10**9]
    assert estimate_ms(devices, [1, 0, 0, 2], costs) == {"compute_ms": 120.0, "hops": 1, "rtt_ms": 2.0,
                                                         "total_ms": 122.0}
    assert estimate_ms(devices, [1, 2, 0, 0], costs) == {"compute_ms": 140.0, "hops": 2, "rtt_ms": 5.0,
                                                         "total_ms": 145.0}
    assert estimate_ms(devices, [1, 1, 1, 0], costs) is None  # RPC2's round trip is unknown


def four_equal(rtt: float | None) -> list[dict[str, Any]]:
    return [dev("RPC%d" % i, 3584, rtt=rtt) for i in range(4)]


@pytest.mark.parametrize("rtt, policy, counts", [
    (None, "balanced", [5, 5, 5, 4]),   # nothing measured: balanced stays balanced
    (0.0, "balanced", [5, 5, 5, 4]),    # a tie keeps balanced
    (0.2, "balanced", [5, 5, 5, 4]),    # 3 hops x 0.2 ms saved: under the 1 ms margin (a LAN's noise)
    (0.5, "fewest_hops", [19, 0, 0, 0]),  # 1.5 ms of ~6 ms saved
    (5.0, "fewest_hops", [19, 0, 0, 0]),
])
def test_balanced_switches_to_fewest_hops_when_round_trips_cost_more(
        rtt: float | None, policy: str, counts: list[int]) -> None:
    choice = choose_split("balanced", four_equal(rtt), sizing([10] * 19), 2048)
    assert (choice["policy"], choice["requested"], choice["counts"]) == (policy, "balanced", counts)
    if rtt is None:
        assert choice["estimates"] == {"balanced": None}
    else:
        assert choice["estimates"]["balanced"]["hops"] == 4 and choice["estimates"]["fewest_hops"]["hops"] == 1
    if policy == "fewest_hops":
        assert choice["reason"].startswith("balanced -> fewest_hops: 1 hop(s)")


@pytest.mark.parametrize("balanced_ms, fewest_ms, worth", [
    (6.0, 4.5, True),     # 1.5 ms, 25 %
    (6.0, 5.2, False),    # 0.8 ms: under 1 ms
    (40.0, 37.0, False),  # 3 ms but 7.5 %
    (40.0, 36.0, True),   # 4 ms, 10 %
    (5.0, 5.0, False),
])
def test_fewer_hops_must_win_by_a_clear_margin(balanced_ms: float, fewest_ms: float, worth: bool) -> None:
    assert worth_fewer_hops(balanced_ms, fewest_ms) is worth


@pytest.mark.parametrize("rtt, policy", [(1.0, "balanced"), (10.0, "fewest_hops")])
def test_extra_hops_pay_when_they_move_bytes_to_faster_devices(rtt: float, policy: str) -> None:
    # fewest_hops would put all 500 MiB on the big slow device (26.2 ms); balanced moves 188 MiB to two fast GPUs
    # (16.9 ms) at two more round trips: worth it at 1 ms, not at 10 ms.
    devices = [dev("RPC0", 1000, rtt=rtt, bandwidth=20.0), dev("RPC1", 300, rtt=rtt, bandwidth=400.0),
               dev("RPC2", 300, rtt=rtt, bandwidth=400.0)]
    choice = choose_split("balanced", devices, sizing([25] * 20), 2048)
    assert choice["policy"] == policy
    balanced, fewest = choice["estimates"]["balanced"], choice["estimates"]["fewest_hops"]
    assert (balanced["hops"], fewest["hops"]) == (3, 1)
    assert balanced["compute_ms"] < fewest["compute_ms"]


@pytest.mark.parametrize("policy", ["even", "fewest_hops", "fit"])
def test_other_policies_never_switch(policy: str) -> None:
    choice = choose_split(policy, four_equal(50.0), sizing([10] * 19), 2048)
    assert choice["policy"] == policy
    assert set(choice["estimates"]) <= {policy}


def test_manual_split_is_its_own_policy() -> None:
    choice = choose_split("balanced", four_equal(5.0), sizing([10] * 19), 2048, tensor_split=[1, 1, 0, 0])
    assert (choice["policy"], choice["counts"]) == ("manual", [10, 9, 0, 0])
    assert choice["reason"] == "tensor_split given: [1, 1, 0, 0] -> units [10, 9, 0, 0]"


def test_even_refuses_a_device_that_cannot_hold_its_share() -> None:
    devices = [dev("RPC0", 1000), dev("RPC1", 50)]
    with pytest.raises(PlanError, match="policy even puts 10 units .* on RPC1 .* use policy balanced"):
        choose_split("even", devices, sizing([10] * 20), 2048)
    assert choose_split("balanced", devices, sizing([10] * 20), 2048)["counts"] == [19, 1]
