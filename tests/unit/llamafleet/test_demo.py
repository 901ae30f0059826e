"""The demo's placement table: plan next to what llama.cpp logged."""

import pytest

from llamafleet.demo import _units_text, placement_lines


@pytest.mark.parametrize(
    ("units", "n_layer", "text"),
    [
        ([], 18, "-"),
        (list(range(18)), 18, "0-17 (18)"),
        ([18], 18, "output (1)"),
        (list(range(10, 19)), 18, "10-17+output (9)"),
    ],
)
def test_units_text(units, n_layer, text):
    assert _units_text(units, n_layer) == text


def test_placement_lines_compare_plan_and_log():
    plan = {
        "n_layer": 2,
        "devices": [
            {"name": "RPC0", "endpoint": "10.0.0.2:50052", "host": "b", "layers": {"start": 0, "end": 2, "count": 2}},
            {"name": "RPC1", "endpoint": "10.0.0.3:50052", "host": "c", "layers": {"start": 2, "end": 3, "count": 1}},
        ],
    }
    log = "\n".join([
        "llama_prepare_model_devices: using device RPC0 (10.0.0.2:50052) (unknown id) - 24105 MiB free",
        "llama_prepare_model_devices: using device RPC1 (10.0.0.3:50052) (unknown id) - 24105 MiB free",
        "load_tensors: layer   0 assigned to device RPC0, is_swa = 0",
        "load_tensors: layer   1 assigned to device RPC0, is_swa = 0",
        "load_tensors: layer   2 assigned to device RPC1, is_swa = 0",
    ])
    lines = placement_lines(plan, log)
    assert "0-1 (2)" in lines[1] and lines[1].count("0-1 (2)") == 2
    assert lines[2].count("output (1)") == 2
