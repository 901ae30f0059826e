"""split_cpu: layers left on the orchestrator's CPU, -ngl below the unit count, and llama.cpp's own assignment."""

from __future__ import annotations

import random
from typing import Any

import pytest

from llamafleet.core.llama_flags import detect_features, render_llama_server_argv
from llamafleet.core.split_plan import PlanError, assign_layers, plan_split
from tests.unit.plugins.module_utils.test_split_plan import FIXTURES, cpu, gpu, model, worker

MIB = 2**20
FEATURES = detect_features((FIXTURES / "llama-server_0c1e570_help_real.txt").read_text(),
                           (FIXTURES / "ggml-rpc-server_0c1e570_help_real.txt").read_text(),
                           (FIXTURES / "llama-server_0c1e570_version_real.txt").read_text())


def cpu_fleet(free: int = 3000, orchestrator_free: int = 3000) -> tuple[list[dict], dict]:
    workers = [worker("w2", cpu(free, reserve_mib=0)), worker("w3", cpu(free, reserve_mib=0))]
    return workers, {"host": "w1", "devices": [cpu(orchestrator_free, reserve_mib=0)]}


def placed(plan: dict) -> list[int]:
    """What llama.cpp does with the plan's -ngl and -ts: the device of each unit, -1 on the CPU."""
    return assign_layers(plan["tensor_split"], plan["n_layer"], plan["ngl"])


def expected_placement(plan: dict) -> list[int]:
    units = [-1] * plan["cpu_layers"]
    for index, count in enumerate(plan["tensor_split"]):
        units += [index] * count
    return units


def test_integer_counts_round_trip_with_units_left_on_the_cpu() -> None:
    rng = random.Random(11)
    for dummy in range(2000):
        n_layer = rng.randint(1, 160)
        on_cpu = rng.randint(0, n_layer)
        ngl = n_layer + 1 - on_cpu
        devices = rng.randint(1, 15)
        cuts = sorted(rng.randint(0, ngl) for dummy in range(devices - 1))
        counts = [b - a for a, b in zip([0] + cuts, cuts + [ngl])]
        expected = [-1] * on_cpu + [i for i, count in enumerate(counts) for dummy in range(count)]
        assert assign_layers(counts, n_layer, ngl) == expected, (counts, n_layer, ngl)


def test_cpu_fleet_leaves_layers_on_the_orchestrators_cpu() -> None:
    workers, orchestrator = cpu_fleet()
    facts = model(n_layer=32, layer_mib=200, output_mib=400, embd_mib=400)
    plan = plan_split(workers, orchestrator, facts, ctx_size=2048, compute_mib=256, cpu_layers="auto")
    assert plan["cpu_layers"] > 0 and plan["ngl"] == 33 - plan["cpu_layers"]
    assert sum(plan["tensor_split"]) == plan["ngl"]
    assert placed(plan) == expected_placement(plan)
    assert [d["layers"]["start"] for d in plan["devices"]] == [plan["cpu_layers"],
                                                               plan["cpu_layers"] + plan["tensor_split"][0]]
    cpu_plan = plan["cpu"]
    assert cpu_plan["layers"]["range"] == "0-%d" % (plan["cpu_layers"] - 1)
    # its room is what is left after the 400 MiB input embedding, and the plan stays inside it
    assert cpu_plan["usable_mib"] == 3000 - 400 and cpu_plan["held_mib"] == 400.0
    assert cpu_plan["total_mib"] <= cpu_plan["usable_mib"]
    assert any(line.startswith("CPU     local") and "-ngl %d" % plan["ngl"] in line for line in plan["explanation"])
    argv = render_llama_server_argv("/opt/b/llama-server", plan, FEATURES["llama_server"], ["/m.gguf"])
    assert argv[argv.index("-ngl") + 1] == str(plan["ngl"])
    assert argv[argv.index("-ts") + 1] == plan["tensor_split_arg"]


def test_a_model_that_needs_the_orchestrators_ram_fits_with_it() -> None:
    workers, orchestrator = cpu_fleet(free=3000)
    facts = model(n_layer=32, layer_mib=200, output_mib=130, embd_mib=130)  # 6.7 GiB of weights, 1 GiB of KV
    with pytest.raises(PlanError, match="needs"):
        plan_split(workers, orchestrator, facts, ctx_size=2048, compute_mib=256, cpu_layers=0)
    plan = plan_split(workers, orchestrator, facts, ctx_size=2048, compute_mib=256, cpu_layers="auto")
    assert plan["cpu_layers"] >= 8
    assert placed(plan) == expected_placement(plan)


def test_zero_and_no_cpu_figures_plan_as_before() -> None:
    workers, orchestrator = cpu_fleet()
    facts = model(n_layer=16)
    before = plan_split(workers, {"host": "w1", "devices": []}, facts, ctx_size=2048)
    for orchestrator_given, setting in ((orchestrator, 0), ({"host": "w1", "devices": []}, "auto")):
        plan = plan_split(workers, orchestrator_given, facts, ctx_size=2048, cpu_layers=setting)
        assert (plan["cpu_layers"], plan["cpu"], plan["ngl"]) == (0, None, 17)
        assert plan["identity"] == before["identity"] and plan["tensor_split"] == before["tensor_split"]


def test_a_fixed_count_stays_on_the_cpu_and_the_rest_is_split() -> None:
    workers, orchestrator = cpu_fleet()
    facts = model(n_layer=16)
    plan = plan_split(workers, orchestrator, facts, ctx_size=2048, compute_mib=256, cpu_layers="5")
    assert (plan["cpu_layers"], plan["ngl"], sum(plan["tensor_split"])) == (5, 12, 12)
    assert placed(plan) == expected_placement(plan)
    with pytest.raises(PlanError, match=r"cpu_layers \(llama_server_cpu_layers\) is 14: layers 0-13 need \d+ MiB "
                                        r"with KV and compute margin on CPU \(host w1, local, AMD EPYC\), which has "
                                        r"2600 MiB usable after the 400 MiB that stay there"):
        plan_split(workers, orchestrator, facts, ctx_size=2048, compute_mib=256, cpu_layers=14)


def test_gpus_in_the_plan_keep_auto_off_the_cpu() -> None:
    facts = model(n_layer=16)
    workers = [worker("w2", gpu("cuda", 0, 24000))]
    plan = plan_split(workers, {"host": "w1", "devices": [cpu(64000)]}, facts, ctx_size=2048, cpu_layers="auto")
    assert plan["cpu_layers"] == 0 and plan["ngl"] == 17
    assert "orchestrator CPU: no layers (the plan has GPUs" in "\n".join(plan["explanation"])
    # asked for, it is used
    plan = plan_split(workers, {"host": "w1", "devices": [cpu(64000)]}, facts, ctx_size=2048, cpu_layers=3)
    assert (plan["cpu_layers"], plan["ngl"]) == (3, 14)


def test_fewest_hops_uses_the_cpu_first_and_never_for_the_output() -> None:
    workers, orchestrator = cpu_fleet(orchestrator_free=64000)
    facts = model(n_layer=16)
    plan = plan_split(workers, orchestrator, facts, ctx_size=2048, policy="fewest_hops", cpu_layers="auto")
    # the CPU could hold it all, but the output layer goes to a device: one worker, balanced with the CPU (which
    # counts as no more than every layer), the other worker out of --rpc
    assert len(plan["rpc"]) == 1 and len(plan["excluded"]) == 1
    assert plan["cpu_layers"] > plan["ngl"] >= 1 and plan["devices"][0]["layers"]["output"]
    assert placed(plan) == expected_placement(plan)


@pytest.mark.parametrize("options, message", [
    ({"cpu_layers": "many"}, r"cpu_layers \(llama_server_cpu_layers\) is 'many', expected auto, 0 or a number"),
    ({"cpu_layers": -1}, "expected auto, 0 or a number of layers up to n_layer = 16"),
    ({"cpu_layers": 17}, "the output layer stays on a device"),
    ({"cpu_layers": 2, "policy": "fit"}, "policy fit lets llama.cpp choose -ngl"),
])
def test_cpu_layers_errors(options: dict[str, Any], message: str) -> None:
    workers, orchestrator = cpu_fleet()
    with pytest.raises(PlanError, match=message):
        plan_split(workers, orchestrator, model(n_layer=16), ctx_size=2048, **options)


def test_auto_stays_off_for_even_fit_and_a_manual_split() -> None:
    workers, orchestrator = cpu_fleet()
    for options in ({"policy": "even"}, {"policy": "fit"}, {"tensor_split": [1, 1]}):
        plan = plan_split(workers, orchestrator, model(n_layer=16), ctx_size=2048, cpu_layers="auto", **options)
        assert plan["cpu_layers"] == 0, options


def test_a_model_that_fits_nowhere_is_refused_with_each_device_and_what_to_change() -> None:
    workers, orchestrator = cpu_fleet(free=1000, orchestrator_free=1000)
    facts = model(n_layer=32, layer_mib=200, output_mib=130, embd_mib=130)
    with pytest.raises(PlanError) as err:
        plan_split(workers, orchestrator, facts, ctx_size=2048, compute_mib=256, cpu_layers=0)
    message = str(err.value)
    assert "per device: RPC0 host w2 1000 MiB usable (256 MiB compute margin), RPC1 host w3 1000 MiB usable" in message
    assert "llama_server_cache_type q8_0" in message and "llama_server_cpu_layers auto" in message
    with pytest.raises(PlanError) as err:
        plan_split(workers, orchestrator, facts, ctx_size=2048, compute_mib=256, cpu_layers="auto")
    message = str(err.value)
    assert "CPU host w1 870 MiB usable (256 MiB compute margin)" in message  # after the 130 MiB input embedding
    assert "llama_server_cpu_layers auto" not in message
