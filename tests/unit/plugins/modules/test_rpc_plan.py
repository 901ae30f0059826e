"""rpc_plan module: plan from a GGUF file or facts, argv and unit rendering, idempotent unit writes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from llamafleet.core.llama_flags import detect_features
from ansible_collections.llamafleet.cluster.plugins.modules import model_fetch, rpc_plan
from tests.unit.module_runner import run_main, warning_messages
from tests.unit.needs import LAB_MODEL, needs_lab_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
GEMMA = json.loads((FIXTURES / "gemma-3-270m-q4_k_m_model_facts.json").read_text())
FEATURES = detect_features((FIXTURES / "llama-server_0c1e570_help_real.txt").read_text(),
                           (FIXTURES / "ggml-rpc-server_0c1e570_help_real.txt").read_text(),
                           (FIXTURES / "llama-server_0c1e570_version_real.txt").read_text())
BINARY = "/opt/llamafleet/llama.cpp/b1/bin/llama-server"
MODEL = "/var/lib/llamafleet/models/gemma-3-270m-q4_k_m.gguf"


def cpu(cap: int) -> dict[str, Any]:
    return {"backend": "cpu", "index": 0, "name": "AMD EPYC", "ggml_name": "CPU", "total_mib": 24105,
            "free_mib": 23000, "max_mib": cap}


WORKERS = [
    # shaped like the rpc_server role's rpc_server_endpoints fact (extra "unit" key, port from Jinja as a string)
    {"host": "lab2", "address": "10.77.0.12", "port": "50052", "unit": "llamafleet-rpc-server.service",
     "devices": [cpu(600)]},
    {"host": "lab3", "address": "10.77.0.13", "port": 50052, "unit": "llamafleet-rpc-server.service",
     "devices": [cpu(400)]},
]


def run_module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    return run_main(rpc_plan.main, args, capsys)


def args(**extra: Any) -> dict[str, Any]:
    base = {"workers": WORKERS, "orchestrator": {"host": "lab1", "devices": []}, "model_facts": GEMMA,
            "ctx_size": 4096, "n_parallel": 2, "compute_margin_mib": 64}
    base.update(extra)
    return base


def render_args(unit_path: Path, **extra: Any) -> dict[str, Any]:
    rendering = {
        "model": [MODEL], "binary": BINARY, "features": FEATURES, "unit_path": str(unit_path),
        "unit_header": "#\n# Ansible managed: do not edit\n#",
        "server": {"host": "10.77.0.11", "port": 8080, "metrics": True, "chat_template": "gemma",
                   "api_key_file": "", "log_verbosity": 4},
        "unit": {"user": "llamafleet", "home": "/var/lib/llamafleet", "build_id": "b1-cpu",
                 "wait_helper": "/usr/local/libexec/llamafleet-rpc-wait"},
    }
    rendering.update(extra)
    return args(**rendering)


def test_plan_only(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(args(), capsys)
    assert rc == 0 and result["changed"] is False
    plan = result["plan"]
    assert plan["rpc"] == ["10.77.0.12:50052", "10.77.0.13:50052"]
    assert plan["device_names"] == ["RPC0", "RPC1"]
    assert sum(plan["tensor_split"]) == 19 and plan["ngl"] == 19
    assert result["explain"] == plan["explanation"]
    assert result["argv"] == [] and result["unit"] == ""


@needs_lab_model()
def test_plan_from_the_real_model_file(capsys: pytest.CaptureFixture[str]) -> None:
    a = args(model=[str(LAB_MODEL)])
    del a["model_facts"]
    rc, result = run_module(a, capsys)
    assert rc == 0
    assert result["plan"]["totals"]["weights_mib"] == pytest.approx((sum(GEMMA["layer_bytes"]) + GEMMA[
        "output_bytes"]) / 2**20, abs=0.05)


def test_plan_from_a_written_gguf(make_gguf: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.context_length": 2048}
    tensors = [("token_embd.weight", [64, 256], 0), ("output_norm.weight", [64], 0), ("output.weight", [64, 256], 0)]
    for il in range(2):
        tensors += [("blk.%d.attn_q.weight" % il, [64, 64], 0), ("blk.%d.ffn_up.weight" % il, [64, 128], 0)]
    path = make_gguf("tiny.gguf", meta, tensors)
    a = args(model=[str(path)], ctx_size=0, workers=[{"host": "lab2", "devices": [cpu(600)]}])
    del a["model_facts"]
    rc, result = run_module(a, capsys)
    assert rc == 0, result
    plan = result["plan"]
    assert (plan["ctx_size"], plan["n_layer"], plan["tensor_split"]) == (2048, 2, [3])
    assert plan["rpc"] == ["lab2:50052"]
    assert plan["devices"][0]["weights_mib"] == round((2 * (64 * 64 + 64 * 128) + 64 + 64 * 256) * 4 / 2**20, 1)


def test_four_runs_check_apply_apply_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = tmp_path / "llamafleet-llama-server.service"
    rc, first = run_module(dict(render_args(unit), _ansible_check_mode=True, _ansible_diff=True), capsys)
    assert rc == 0 and first["changed"] is True and not unit.exists()
    assert first["diff"]["before"] == "" and first["diff"]["after"] == first["unit"]

    rc, second = run_module(render_args(unit), capsys)
    assert rc == 0 and second["changed"] is True
    assert unit.read_text() == second["unit"] == first["unit"]
    assert (unit.stat().st_mode & 0o7777) == 0o644

    rc, third = run_module(render_args(unit), capsys)
    assert rc == 0 and third["changed"] is False

    rc, fourth = run_module(dict(render_args(unit), _ansible_check_mode=True, _ansible_diff=True), capsys)
    assert rc == 0 and fourth["changed"] is False and "diff" not in fourth
    assert [p.name for p in tmp_path.iterdir()] == [unit.name]  # no temporary files left


def test_the_models_alias_and_its_chat_template_file_are_rendered(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = {"host": "127.0.0.1", "port": 18080, "alias": "gemma-3-270m-q4_k_m", "jinja": True,
              "chat_template_file": "/etc/llamafleet/chat-template.jinja"}
    rc, result = run_module(render_args(tmp_path / "u.service", server=server), capsys)
    assert rc == 0, result
    argv = result["argv"]
    assert argv[argv.index("--port") + 2:] == ["--alias", "gemma-3-270m-q4_k_m", "--jinja", "--chat-template-file",
                                               "/etc/llamafleet/chat-template.jinja"]
    rc, result = run_module(render_args(tmp_path / "v.service", server=dict(server, jinja=False)), capsys)
    assert rc == 1 and "llama_server_jinja is false" in result["msg"]


def test_rendered_argv_and_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(render_args(tmp_path / "u.service"), capsys)
    assert rc == 0
    plan = result["plan"]
    assert result["argv"] == [
        BINARY, "-m", MODEL, "--rpc", "10.77.0.12:50052,10.77.0.13:50052", "-ngl", "19", "-sm", "layer",
        "-ts", plan["tensor_split_arg"], "--fit", "off", "-c", "4096", "-np", "2", "--kv-unified", "-n", "1024",
        "--host", "10.77.0.11", "--port", "8080", "--metrics", "--chat-template", "gemma", "-lv", "4",
    ]
    lines = result["unit"].splitlines()
    assert lines[:4] == ["#", "# Ansible managed: do not edit", "#", "# llama.cpp build b1-cpu"]
    assert lines[4] == "# split: --rpc 10.77.0.12:50052,10.77.0.13:50052 -ts %s (policy balanced)" % (
        plan["tensor_split_arg"])
    assert "WorkingDirectory=/var/lib/llamafleet" in lines and "ReadWritePaths=/var/lib/llamafleet" in lines
    assert "ExecStartPre=/usr/local/libexec/llamafleet-rpc-wait \\" in lines


def test_cpu_layers_on_a_cpu_orchestrator_render_ngl_below_the_units(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    orchestrator = {"host": "lab1", "devices": [dict(cpu(400), reserve_mib=0)]}
    rc, result = run_module(render_args(tmp_path / "u.service", orchestrator=orchestrator), capsys)
    assert rc == 0, result
    plan = result["plan"]
    assert plan["cpu_layers"] > 0 and plan["ngl"] == 19 - plan["cpu_layers"] == sum(plan["tensor_split"])
    argv = result["argv"]
    assert argv[argv.index("-ngl") + 1] == str(plan["ngl"]) and argv[argv.index("-ts") + 1] == plan["tensor_split_arg"]
    assert "# split: --rpc %s -ts %s (policy balanced, layers 0-%d on the CPU (-ngl %d))" % (
        ",".join(plan["rpc"]), plan["tensor_split_arg"], plan["cpu_layers"] - 1, plan["ngl"]) in result["unit"]
    # 0 keeps every layer on the workers
    rc, result = run_module(render_args(tmp_path / "v.service", orchestrator=orchestrator, cpu_layers=0), capsys)
    assert rc == 0 and result["plan"]["ngl"] == 19 and result["plan"]["cpu"] is None
    rc, result = run_module(args(orchestrator=orchestrator, cpu_layers="lots"), capsys)
    assert rc == 1 and "lab1: cpu_layers (llama_server_cpu_layers) is 'lots'" in result["msg"]


def test_changed_content_and_mode_are_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = tmp_path / "u.service"
    run_module(render_args(unit), capsys)
    os.chmod(unit, 0o600)
    rc, result = run_module(dict(render_args(unit), _ansible_check_mode=True), capsys)
    assert rc == 0 and result["changed"] is True and (unit.stat().st_mode & 0o7777) == 0o600
    rc, result = run_module(render_args(unit), capsys)
    assert result["changed"] is True and (unit.stat().st_mode & 0o7777) == 0o644
    rc, result = run_module(render_args(unit, ctx_size=8192, _ansible_diff=True), capsys)
    assert result["changed"] is True and "-c 8192" in unit.read_text()
    assert "-c 4096" in result["diff"]["before"] and "-c 8192" in result["diff"]["after"]


def test_old_build_features_render_old_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = detect_features((FIXTURES / "llama-server_no-mmap-era_help_excerpt_reconstructed.txt").read_text())
    a = render_args(tmp_path / "u.service", features=old, kv_unified=False)
    a["server"]["load_mode"] = "none"
    rc, result = run_module(a, capsys)
    assert rc == 0
    assert "--fit" not in result["argv"] and "--no-mmap" in result["argv"]
    assert "--kv-unified" not in result["argv"] and "--no-kv-unified" not in result["argv"]
    # the default, one cache shared by the 2 slots, needs --kv-unified, which that build lacks
    rc, result = run_module(dict(a, kv_unified=True), capsys)
    assert rc == 1
    assert "llama_server_kv_unified (kv_unified) asks for one KV cache shared by the 2 slots" in result["msg"]


@pytest.mark.parametrize("extra, message", [
    ({"ctx_size": 10_000_000}, "lab1: the model at ctx_size 10000000 needs"),
    ({"ctx_size": 10_000_000}, "add hosts or lower ctx_size (llama_server_ctx_size)"),
    ({"tensor_split": [1.0]}, "tensor_split: 1 values given, there are 2 devices in this order: "
                              "RPC0 10.77.0.12:50052, RPC1 10.77.0.13:50052"),
    ({"binary": BINARY, "model": [MODEL]}, "features is required"),
    ({"unit_path": "/tmp/x.service"}, "unit_path needs binary"),
    ({"binary": BINARY, "features": FEATURES}, "model (the GGUF path on this host) is required"),
    ({"binary": BINARY, "model": [MODEL], "features": {"llama_server": {}}}, "no flag for RPC workers"),
])
def test_errors(extra: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(args(**extra), capsys)
    assert rc == 1, result
    assert message in result["msg"]


def test_unreadable_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a gguf")
    a = args(model=[str(bad)])
    del a["model_facts"]
    rc, result = run_module(a, capsys)
    assert rc == 1 and result["msg"].startswith("cannot read model %s" % bad)


def test_missing_unit_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(render_args(tmp_path / "nope" / "u.service"), capsys)
    assert rc == 1 and "directory %s does not exist" % (tmp_path / "nope") in result["msg"]


def test_local_cuda_gpus_pin_the_cuda_device_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = [{"backend": "cuda", "index": 0, "name": "NVIDIA GeForce RTX 4090", "total_mib": 24564,
              "free_mib": 24000}]
    rc, result = run_module(render_args(tmp_path / "u.service", orchestrator={"host": "lab1", "devices": local}),
                            capsys)
    assert rc == 0
    assert result["plan"]["device_names"] == ["RPC0", "RPC1", "CUDA0"]
    assert 'Environment="CUDA_DEVICE_ORDER=PCI_BUS_ID"' in result["unit"].splitlines()
    rc, result = run_module(render_args(tmp_path / "u.service"), capsys)
    assert "CUDA_DEVICE_ORDER" not in result["unit"]


# --- split policies ------------------------------------------------------------------------------

def test_fewest_hops_waits_only_for_the_workers_it_uses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(render_args(tmp_path / "u.service", policy="fewest_hops"), capsys)
    assert rc == 0, result
    plan = result["plan"]
    assert (plan["rpc"], plan["tensor_split"], plan["policy"]) == (["10.77.0.12:50052"], [19], "fewest_hops")
    assert plan["excluded"] == [{"host": "lab3", "endpoint": "10.77.0.13:50052", "devices": ["RPC1"]}]
    argv = result["argv"]
    assert argv[argv.index("--rpc") + 1] == "10.77.0.12:50052" and "-ts" not in argv  # one device: no -ts
    lines = result["unit"].splitlines()
    pre = lines.index("ExecStartPre=/usr/local/libexec/llamafleet-rpc-wait \\")
    assert lines[pre + 1].strip() == "10.77.0.12:50052" and lines[pre + 2].startswith("ExecStart=")


def test_measured_round_trips_let_balanced_use_fewer_workers(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(args(link_rtt_ms=5), capsys)
    assert rc == 0
    assert (result["plan"]["policy"], result["plan"]["requested_policy"]) == ("fewest_hops", "balanced")
    assert result["plan"]["estimate"]["hops"] == 1
    rc, result = run_module(args(), capsys)
    assert (result["plan"]["policy"], result["plan"]["estimate"]) == ("balanced", None)


def test_fit_renders_no_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(render_args(tmp_path / "u.service", policy="fit"), capsys)
    assert rc == 0, result
    argv = result["argv"]
    assert argv[argv.index("--rpc") + 1] == "10.77.0.12:50052,10.77.0.13:50052"
    assert not {"-ts", "-ngl", "--fit"} & set(argv)
    assert "# split: --rpc 10.77.0.12:50052,10.77.0.13:50052, policy fit (llama.cpp fits -ngl and -ts at load)" \
        in result["unit"].splitlines()


def test_fit_needs_a_build_with_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = detect_features((FIXTURES / "llama-server_no-mmap-era_help_excerpt_reconstructed.txt").read_text())
    rc, result = run_module(render_args(tmp_path / "u.service", policy="fit", features=old), capsys)
    assert rc == 1 and "split policy fit needs --fit" in result["msg"]


@pytest.mark.parametrize("extra, message", [
    ({"policy": "fastest"}, "value of policy must be one of: balanced, even, fewest_hops, fit"),
    ({"link_rtt_ms": -3.0}, "link_rtt_ms is -3.0, expected a round trip in ms"),
    ({"policy": "even", "tensor_split": [1.0, 1.0]}, "tensor_split sets the split by hand and policy even"),
])
def test_policy_errors(extra: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(args(**extra), capsys)
    assert rc == 1 and message in result["msg"], result


# --- one compute margin, one policy list: the module, its docs and the llama_server role agree -------------

ROLE = Path(__file__).resolve().parents[4] / "roles" / "llama_server"


def test_module_docs_and_role_agree_on_margin_and_policies() -> None:
    import yaml

    from llamafleet.core.split_plan import DEFAULT_COMPUTE_MIB, POLICIES

    options = yaml.safe_load(rpc_plan.DOCUMENTATION)["options"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert options["compute_mib"]["default"] == DEFAULT_COMPUTE_MIB == defaults["llama_server_compute_margin_mib"]
    assert options["policy"]["choices"] == list(POLICIES) == specs["llama_server_split_policy"]["choices"]
    assert options["policy"]["default"] == defaults["llama_server_split_policy"]
    configure = (ROLE / "tasks" / "configure.yml").read_text()
    assert "policy: \"{{ llama_server_split_policy }}\"" in configure


def test_module_and_role_default_to_automatic_slots_sharing_one_cache() -> None:
    import yaml

    options = yaml.safe_load(rpc_plan.DOCUMENTATION)["options"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert options["n_parallel"]["default"] == defaults["llama_server_parallel"] == 0
    assert options["kv_unified"]["default"] is defaults["llama_server_kv_unified"] is True
    configure = (ROLE / "tasks" / "configure.yml").read_text()
    assert "kv_unified: \"{{ llama_server_kv_unified | bool }}\"" in configure


def test_default_slots_are_resolved_and_recorded(capsys: pytest.CaptureFixture[str]) -> None:
    a = args()
    del a["n_parallel"]
    rc, result = run_module(a, capsys)
    assert rc == 0
    plan = result["plan"]
    assert (plan["n_parallel"], plan["n_parallel_auto"], plan["kv_unified"], plan["slot_ctx"]) == (16, True, True, 4096)
    assert "16 slots (auto: 4096 ctx / 128, at most 16)" in result["explain"][1]
    # the shared cache the gate guards, and the bound of a generation without max_tokens (-n): a quarter of it
    assert (plan["kv_budget"], plan["max_tokens"]) == (4096, 1024)


def test_split_cache_too_small_per_slot_fails(capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(args(ctx_size=1024, n_parallel=8, kv_unified=False), capsys)
    assert rc == 1
    assert "llama_server_parallel" in result["msg"] and "llama_server_ctx_size" in result["msg"]


def test_degrade_plans_the_cluster_without_each_worker_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(render_args(tmp_path / "llama.service", degrade=True), capsys)
    assert rc == 0
    without = {entry["without"]: entry for entry in result["degraded"]}
    assert list(without) == ["lab2", "lab3"] and all(entry["fits"] for entry in without.values())
    lab3 = without["lab3"]
    assert lab3["name"] == "without-lab3" and lab3["rpc"] == ["10.77.0.12:50052"]
    dropin = lab3["dropin"].splitlines()
    # the full unit's ExecStartPre and ExecStart are reset, then replaced by the plan over lab2 alone
    service = dropin.index("[Service]")
    assert dropin[service + 1:service + 4] == [
        "ExecStartPre=", "ExecStartPre=/usr/local/libexec/llamafleet-rpc-wait \\", "    10.77.0.12:50052"]
    start = "\n".join(dropin[dropin.index("ExecStart="):])
    assert "--rpc 10.77.0.12:50052" in start and "10.77.0.13" not in start
    assert dropin[0] == "#" and any("without worker lab3" in line for line in dropin)
    # without degrade: nothing planned
    rc, result = run_module(render_args(tmp_path / "llama.service"), capsys)
    assert result["degraded"] == []


def test_degrade_reports_a_plan_that_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # lab2 and lab3 hold the model only together; the orchestrator has no device of its own
    small = [dict(worker, devices=[cpu(260)]) for worker in WORKERS]
    rc, result = run_module(render_args(tmp_path / "llama.service", degrade=True, workers=small, ctx_size=512,
                                        n_parallel=1), capsys)
    assert rc == 0, result
    assert [entry["fits"] for entry in result["degraded"]] == [False, False]
    assert result["degraded"][0]["reason"].startswith("the model does not fit without lab2: ")
    assert result["degraded"][0]["dropin"] == ""


def test_gate_degrade_names_each_plan_or_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_module(render_args(tmp_path / "llama.service", degrade=True), capsys)
    assert result["gate_degrade"]["plans"] == {"lab2": "without-lab2", "lab3": "without-lab3"}
    small = [dict(worker, devices=[cpu(260)]) for worker in WORKERS]
    rc, result = run_module(render_args(tmp_path / "llama.service", degrade=True, workers=small, ctx_size=512,
                                        n_parallel=1), capsys)
    assert result["gate_degrade"]["plans"] == {"lab2": None, "lab3": None}
    assert result["gate_degrade"]["reasons"]["lab3"].startswith("the model does not fit without lab3")


def test_the_recorded_plan_is_kept_while_it_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = tmp_path / "llama.service"
    recorded = tmp_path / "plan.json"
    # lab2 and lab3 hold gemma together, lab3 alone too (a degraded plan), lab2 alone not
    workers = [dict(WORKERS[0], devices=[cpu(300)]), dict(WORKERS[1], devices=[cpu(700)])]
    rc, first = run_module(render_args(unit, degrade=True, workers=workers, recorded_plan=str(recorded)), capsys)
    assert rc == 0 and first["changed"] is True and first["plan"]["keep"]["degraded"]
    assert first["recorded"] == {"identity": "", "keep": {}}
    recorded.write_text(json.dumps(first["plan"]))  # as the role records it
    # the next run measures a little more on lab2 and a little less on lab3
    moved = [dict(WORKERS[0], devices=[cpu(320)]), dict(WORKERS[1], devices=[cpu(680)])]
    rc, fresh = run_module(render_args(tmp_path / "fresh.service", degrade=True, workers=moved), capsys)
    assert fresh["plan"]["tensor_split"] != first["plan"]["tensor_split"], "the fixture must move a layer"
    rc, again = run_module(render_args(unit, degrade=True, workers=moved, recorded_plan=str(recorded)), capsys)
    assert rc == 0 and again["changed"] is False, again.get("diff")
    assert again["plan"]["tensor_split"] == first["plan"]["tensor_split"]
    assert again["plan"]["keep"] == first["plan"]["keep"]
    # what it read, for the role to compare without reading the file again
    assert again["recorded"] == {"identity": first["plan"]["identity"], "keep": first["plan"]["keep"]}
    assert [e["dropin"] for e in again["degraded"]] == [e["dropin"] for e in first["degraded"]]
    # a recorded plan that cannot be read is a warning, and the split is planned afresh
    recorded.write_text("{not json")
    rc, unread = run_module(render_args(tmp_path / "fresh.service", degrade=True, workers=moved,
                                        recorded_plan=str(recorded)), capsys)
    assert rc == 0 and unread["plan"]["tensor_split"] == fresh["plan"]["tensor_split"]
    assert any("cannot be read" in warning for warning in warning_messages(unread)), unread.get("warnings")
    assert unread["recorded"] == {"identity": "", "keep": {}}


@pytest.fixture()
def served_model(tmp_path: Path, serve_dir) -> tuple[Path, str]:
    """A synthetic llama model (llamafleet.bench.synth, 4 layers of about 3.5 MiB) and its URL on a loopback server."""
    from llamafleet.bench.synth import SynthSpec, write_model

    root = tmp_path / "www"
    root.mkdir()
    path = root / "synth.gguf"
    write_model(path, SynthSpec(layers=4, hidden=512, ffn=1536, heads=8, kv_heads=2, wtype="q8_0"))
    return path, "%s/synth.gguf" % serve_dir(root)


@pytest.mark.parametrize(("cap", "ctx"), [(600, 4096), (20, 4096), (600, 2 ** 20)],
                         ids=["fits", "refused-weights", "refused-context"])
def test_preflight_plan_from_the_header_is_the_plan_from_the_file(served_model, tmp_path: Path, cap: int, ctx: int,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """deploy.yml's preflight fit check: model_fetch in check mode reads the header over HTTP ranges and returns the
    planner's facts (nothing is fetched), and rpc_plan plans from them exactly as from the file, or refuses with the
    same message, naming the orchestrator."""
    path, url = served_model
    dest = tmp_path / "cache"
    rc, fetched = run_main(model_fetch.main, {
        "files": [{"url": url, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}], "dest": str(dest), "facts": True,
        "_ansible_check_mode": True}, capsys)
    assert rc == 0 and fetched["fetched"] == ["synth.gguf"], fetched
    assert not dest.exists()
    workers = [dict(worker, devices=[cpu(cap)]) for worker in WORKERS]
    base = {"workers": workers, "orchestrator": {"host": "lab1", "devices": []}, "ctx_size": ctx, "n_parallel": 1,
            "compute_margin_mib": 16}
    from_header = run_module(dict(base, model_facts=fetched["model_facts"]), capsys)
    from_file = run_module(dict(base, model=[str(path)]), capsys)
    for outcome in (from_header, from_file):
        outcome[1].pop("invocation")
    assert from_header == from_file
    rc, result = from_header
    if cap == 600 and ctx == 4096:
        assert rc == 0 and sum(result["plan"]["tensor_split"]) == 5, result
    else:
        assert rc == 1 and result["msg"].startswith("lab1: "), result
        assert "lab2" in result["msg"] and "llama_server_" in result["msg"], result["msg"]
