"""bench split: the variants made from the deployed plan, its table, and the service it pauses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamafleet.bench import runner, split
from llamafleet.bench.runner import Measurement
from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.fleet import Fleet
from llamafleet.layout import record_command

PLAN = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "plan_lab3_gemma270m_generated.json")
                  .read_text(encoding="utf-8"))


def planned_argv(plan: dict) -> list[str]:
    """The llama-server argv the llama_server role renders from a plan (its split flags)."""
    return ["/opt/llamafleet/llama.cpp/current/bin/llama-server", "-m", "/var/lib/llamafleet/models/m.gguf",
            "--rpc", ",".join(plan["rpc"]), "-ngl", str(plan["ngl"]), "-sm", plan["split_mode"],
            "-ts", plan["tensor_split_arg"], "--fit", "off", "-c", str(plan["ctx_size"])]


def test_variants_of_the_recorded_plan():
    argv = planned_argv(PLAN)
    got = split.variants(argv, split.device_count(PLAN, "lab1:/srv/plan.json"))
    assert list(got) == ["plan", "even", "fit"]
    assert got["plan"] == argv
    assert got["even"][got["even"].index("-ts") + 1] == "1,1"
    assert "-ts" not in got["fit"] and "-ngl" not in got["fit"] and "--fit" not in got["fit"]
    assert got["fit"][-2:] == ["-c", "2048"]  # everything else stays


@pytest.mark.parametrize("plan", [{}, {"devices": []}, {"devices": "RPC0"}])
def test_a_plan_without_devices_is_a_user_error(plan):
    with pytest.raises(UserError, match="^lab1:/srv/plan.json names no devices"):
        split.device_count(plan, "lab1:/srv/plan.json")


def test_table_compares_with_the_plan():
    rows = [Measurement("plan", 10.0, 40.0, 100.0), Measurement("even", 12.0, 20.0, 90.0)]
    lines = split.table(rows).splitlines()
    assert lines[2] == "| plan | 10.00 | 40.0 | 100.0 | 1.00 | 1.00 |"
    assert lines[3] == "| even | 12.00 | 20.0 | 90.0 | 0.50 | 1.20 |"


@pytest.fixture
def bench(monkeypatch, connector, recorded, renamed_record):
    """split.run on a fleet whose record renames the units and the plan, with recorders for the variants and
    the restore: ``events`` in the order they happened, ``layouts`` each step was given, ``fail["at"]`` names
    a variant that fails, ``plan["plan"]`` is the plan read."""
    events: list[str] = []
    layouts: list = []
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["lab1"]}, "_meta": {"hostvars": {}}}
    fleet = Fleet.from_inventory_json(data, connector(recorded(renamed_record, lambda host, command: (1, "", "x"))))
    plan = {"plan": PLAN}

    def step(result):
        return lambda f, layout: layouts.append(layout) or result()

    monkeypatch.setattr(split, "deployed_argv", step(lambda: planned_argv(PLAN)))
    monkeypatch.setattr(split, "read_plan", step(lambda: plan["plan"]))
    monkeypatch.setattr(runner, "restore_service", lambda f, layout: events.append(f"restore {layout.llama_unit}"))
    fail: dict[str, str] = {}

    def variant(f, name, argv, runs, layout):
        layouts.append(layout)
        events.append(f"run {name}")
        if name == fail.get("at"):
            raise UserError(f"variant {name}: /health did not answer 200")
        return Measurement(name, 1.0, 10.0, 50.0)

    monkeypatch.setattr(split, "run_variant", variant)
    return fleet, events, fail, layouts, plan


def test_split_warns_before_stopping_and_restores_the_recorded_unit(bench, capsys):
    fleet, events, _, layouts, _ = bench
    rows = split.run(fleet, runs=1)
    assert [r.name for r in rows] == ["plan", "even", "fit"]
    assert events == ["run plan", "run even", "run fit", "restore lf-llama-b.service"]
    err = capsys.readouterr().err
    assert err.startswith("warning: this benchmark stops lf-llama-b.service on lab1")
    # the record read once, its layout handed to every step
    assert fleet.connect.calls == [("lab1", record_command())]
    assert len(layouts) == 5 and all(layout is layouts[0] for layout in layouts)
    assert (layouts[0].llama_unit, layouts[0].gate_unit) == ("lf-llama-b.service", "lf-gate-b.service")


def test_split_restores_the_service_when_a_variant_fails(bench, capsys):
    fleet, events, fail, _, _ = bench
    fail["at"] = "even"
    with pytest.raises(UserError, match="variant even"):
        split.run(fleet, runs=1)
    assert events == ["run plan", "run even", "restore lf-llama-b.service"]
    assert capsys.readouterr().err.startswith("warning:")


def test_split_of_a_plan_without_devices_names_the_recorded_plan(bench):
    fleet, events, _, _, plan = bench
    plan["plan"] = {}
    with pytest.raises(UserError, match="^lab1:/srv/lf-b/plan.json names no devices"):
        split.run(fleet, runs=1)
    assert events == []  # nothing stopped
