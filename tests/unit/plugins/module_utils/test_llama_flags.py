"""llama_flags: flag detection from real --help texts, argv rendering by feature."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llamafleet.core.llama_flags import (
    FlagError,
    chat_template_args,
    detect_features,
    kv_unified_args,
    load_mode_args,
    parse_help_flags,
    parse_version,
    pick_binary,
    render_llama_server_argv,
    render_rpc_server_argv,
    rpc_server_features,
    server_features,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
SERVER_HELP = (FIXTURES / "llama-server_0c1e570_help_real.txt").read_text()
OLD_SERVER_HELP = (FIXTURES / "llama-server_no-mmap-era_help_excerpt_reconstructed.txt").read_text()
RPC_HELP = (FIXTURES / "ggml-rpc-server_0c1e570_help_real.txt").read_text()
OLD_RPC_HELP = (FIXTURES / "rpc-server_with-mem_help_reconstructed.txt").read_text()
NEW = server_features(SERVER_HELP)
OLD = server_features(OLD_SERVER_HELP)

PLAN = {
    "rpc": ["10.77.0.11:50052", "10.77.0.12:50052"],
    "devices": [{"name": "RPC0"}, {"name": "RPC1"}, {"name": "CUDA0"}],
    "device_names": ["RPC0", "RPC1", "CUDA0"],
    "tensor_split": [11, 8, 14],
    "ngl": 33,
    "split_mode": "layer",
    "ctx_size": 8192,
    "n_parallel": 2,
    "cache_type_k": "f16",
    "cache_type_v": "f16",
}
BIN = "/opt/llamafleet/llama.cpp/b1/bin/llama-server"
MODEL = "/var/lib/llamafleet/models/m.gguf"


# --- detection -----------------------------------------------------------------------------------

@pytest.mark.parametrize("feature, new, old", [
    ("rpc", True, True),
    ("tensor_split", True, True),
    ("split_mode", True, True),
    ("n_gpu_layers", True, True),
    ("device", True, True),
    ("fit", True, False),
    ("load_mode", True, False),
    ("no_mmap", False, True),
    ("mlock", False, True),
    ("metrics", True, True),
    ("api_key_file", True, True),
    ("ctx_size", True, True),
    ("parallel", True, True),
    ("kv_unified", True, False),
    ("no_kv_unified", True, False),
    ("chat_template", True, True),
    ("chat_template_file", True, False),
    ("jinja", True, False),
    ("no_jinja", True, False),  # "--jinja, --no-jinja" on one line: both spellings
    ("alias", True, False),
    ("log_verbosity", True, True),
])
def test_server_features(feature: str, new: bool, old: bool) -> None:
    assert (NEW[feature], OLD[feature]) == (new, old)


def test_flags_only_from_the_flag_column() -> None:
    flags = parse_help_flags(SERVER_HELP)
    assert "--cpu-range-batch" in flags and "-Crb" in flags
    # "-----  common params -----" headers and "- auto: mmap ..." description bullets are not flags
    assert not [f for f in flags if f.startswith("---") or f == "-"]
    # a flag named only inside a description does not count
    text = "--foo                     replaces --no-mmap (removed)\n"
    assert parse_help_flags(text) == ["--foo"]


def test_aligned_old_layout_keeps_both_spellings() -> None:
    assert parse_help_flags(OLD_RPC_HELP) == ["-h", "--help", "-t", "--threads", "-H", "--host", "-p", "--port",
                                              "-m", "--mem", "-c", "--cache"]


@pytest.mark.parametrize("text, expected", [
    (RPC_HELP, {"host": True, "port": True, "threads": True, "device": True, "cache": True, "mem": False}),
    (OLD_RPC_HELP, {"host": True, "port": True, "threads": True, "device": False, "cache": True, "mem": True}),
])
def test_rpc_server_features(text: str, expected: dict) -> None:
    assert rpc_server_features(text) == expected


def test_binary_names() -> None:
    assert pick_binary(["llama-server", "rpc-server", "ggml-rpc-server"]) == "ggml-rpc-server"
    assert pick_binary(["llama-server", "llama-rpc-server"]) == "llama-rpc-server"
    assert pick_binary(["llama-server"]) is None


@pytest.mark.parametrize("name, expected", [
    ("llama-server_0c1e570_version_real.txt",
     {"version": "0.5.0-dev", "build": 0, "commit": None, "compiler": "GNU 12.2.0", "target": "Linux x86_64"}),
    ("llama-server_build-number-era_version_reconstructed.txt",
     {"version": None, "build": 4589, "commit": "a1b2c3d4", "compiler": "cc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0",
      "target": "x86_64-linux-gnu"}),
])
def test_parse_version(name: str, expected: dict) -> None:
    assert parse_version((FIXTURES / name).read_text()) == expected


def test_parse_version_with_commit() -> None:
    assert parse_version("version: 0.5.0 (build 6123, commit 0c1e570)\n")["commit"] == "0c1e570"
    with pytest.raises(FlagError, match="not llama.cpp --version output"):
        parse_version("error: unknown argument: --version\n")


def test_detect_features() -> None:
    found = detect_features(SERVER_HELP, RPC_HELP, (FIXTURES / "llama-server_0c1e570_version_real.txt").read_text())
    assert found["llama_server"]["fit"] and found["rpc_server"]["cache"] and found["version"]["version"]
    assert detect_features() == {"llama_server": {}, "rpc_server": {}, "version": None}


# --- rpc-server argv -------------------------------------------------------------------------------

RPC_NEW = rpc_server_features(RPC_HELP)
RPC_OLD = rpc_server_features(OLD_RPC_HELP)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, ["-H", "127.0.0.1", "-p", "50052"]),
    ({"host": "10.77.0.11", "port": 50053, "threads": 2, "devices": ["CUDA0", "CUDA1"], "cache": True},
     ["-H", "10.77.0.11", "-p", "50053", "-t", "2", "-d", "CUDA0,CUDA1", "-c"]),
])
def test_rpc_server_argv(kwargs: dict, expected: list[str]) -> None:
    assert render_rpc_server_argv("/b/ggml-rpc-server", RPC_NEW, **kwargs) == ["/b/ggml-rpc-server"] + expected


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": ["CUDA0"]}, "rpc-server of this build has no flag for choosing devices"),
    ({"threads": 0}, "at least 1"),
])
def test_rpc_server_argv_refuses_what_the_build_lacks(kwargs: dict, message: str) -> None:
    with pytest.raises(FlagError, match=message):
        render_rpc_server_argv("/b/rpc-server", RPC_OLD, **kwargs)


def test_rpc_server_device_names_are_checked() -> None:
    with pytest.raises(FlagError, match="'CUDA0 --evil'"):
        render_rpc_server_argv("/b/ggml-rpc-server", RPC_NEW, devices=["CUDA0 --evil"])


# --- llama-server argv -----------------------------------------------------------------------------

def test_llama_server_argv_current_build() -> None:
    argv = render_llama_server_argv(BIN, PLAN, NEW, MODEL, host="0.0.0.0", port=8080, metrics=True,
                                    api_key_file="/etc/llamafleet/llama-server.key", chat_template="gemma",
                                    load_mode="none", log_verbosity=3, extra_args=["--no-warmup"])
    assert argv == [
        BIN, "-m", MODEL, "--rpc", "10.77.0.11:50052,10.77.0.12:50052", "-ngl", "33", "-sm", "layer",
        "-ts", "11,8,14", "--fit", "off", "-c", "8192", "-np", "2", "--host", "0.0.0.0", "--port", "8080",
        "--metrics", "--api-key-file", "/etc/llamafleet/llama-server.key", "--chat-template", "gemma",
        "-lm", "none", "-lv", "3", "--no-warmup",
    ]


def test_llama_server_argv_old_build() -> None:
    argv = render_llama_server_argv(BIN, PLAN, OLD, [MODEL, "/ignored/shard2.gguf"], load_mode="mlock")
    assert "--fit" not in argv and "-lm" not in argv
    assert argv[-2:] == ["--no-mmap", "--mlock"]
    assert argv[1:3] == ["-m", MODEL]


def test_pinned_devices_come_after_rpc() -> None:
    argv = render_llama_server_argv(BIN, PLAN, NEW, MODEL, pin_devices=True)
    assert argv.index("--device") > argv.index("--rpc")
    assert argv[argv.index("--device") + 1] == "RPC0,RPC1,CUDA0"


def test_single_device_plan_needs_no_split_and_quantized_kv_is_rendered() -> None:
    plan = dict(PLAN, rpc=[], devices=[{"name": "CUDA0"}], device_names=["CUDA0"], tensor_split=[33],
                cache_type_k="q8_0", cache_type_v="q8_0")
    argv = render_llama_server_argv(BIN, plan, NEW, MODEL)
    assert "--rpc" not in argv and "-ts" not in argv
    assert argv[argv.index("-ctk") + 1] == "q8_0" and argv[argv.index("-ctv") + 1] == "q8_0"


# A build from before automatic slots: -kvu/--kv-unified without the negative spelling.
KVU_ONLY = {**NEW, "no_kv_unified": False}


@pytest.mark.parametrize("slots, unified, features, expected", [
    (8, True, NEW, ["-np", "8", "--kv-unified"]),
    (8, True, KVU_ONLY, ["-np", "8", "--kv-unified"]),
    (2, False, NEW, ["-np", "2", "--no-kv-unified"]),
    (2, False, KVU_ONLY, ["-np", "2"]),          # per-slot caches are all such a build does unasked
    (2, False, OLD, ["-np", "2"]),
    (1, True, NEW, ["-np", "1"]),                # one slot: both layouts are one stream of -c cells
    (1, True, OLD, ["-np", "1"]),
    (1, False, NEW, ["-np", "1"]),
    (2, None, NEW, ["-np", "2"]),                # a plan from before kv_unified was recorded
])
def test_slots_and_kv_layout_are_rendered_by_feature(slots: int, unified: bool | None, features: dict,
                                                     expected: list[str]) -> None:
    plan = dict(PLAN, n_parallel=slots, kv_unified=unified)
    argv = render_llama_server_argv(BIN, plan, features, MODEL)
    start = argv.index("-np")
    assert argv[start:argv.index("--host")] == expected


def test_one_slot_without_a_unified_cache_renders_as_before() -> None:
    before = render_llama_server_argv(BIN, dict(PLAN, n_parallel=1), NEW, MODEL)
    assert render_llama_server_argv(BIN, dict(PLAN, n_parallel=1, kv_unified=False), NEW, MODEL) == before
    assert before[before.index("-np"):before.index("-np") + 3] == ["-np", "1", "--host"]


@pytest.mark.parametrize("bound, expected", [(0, []), (512, ["-n", "512"])])
def test_the_bound_of_a_generation_without_max_tokens_renders_as_n(bound: int, expected: list[str]) -> None:
    argv = render_llama_server_argv(BIN, dict(PLAN, n_parallel=4, kv_unified=True, max_tokens=bound), NEW, MODEL)
    assert argv[argv.index("--kv-unified") + 1:argv.index("--host")] == expected
    with pytest.raises(FlagError, match=r"no flag for a bound on generations without max_tokens "
                                        r"\(llama_server_max_tokens\) \(-n/--predict/--n-predict\)"):
        render_llama_server_argv(BIN, dict(PLAN, max_tokens=512), {**NEW, "n_predict": False}, MODEL)


@pytest.mark.parametrize("features", [OLD, {**NEW, "kv_unified": False, "no_kv_unified": False}])
def test_a_unified_cache_needs_the_flag(features: dict) -> None:
    with pytest.raises(FlagError, match=r"llama_server_kv_unified \(kv_unified\) asks for one KV cache shared by the "
                                        r"4 slots, but llama-server of this build has no --kv-unified"):
        render_llama_server_argv(BIN, dict(PLAN, n_parallel=4, kv_unified=True), features, MODEL)
    assert kv_unified_args(False, 4, features, "llama-server") == []


@pytest.mark.parametrize("features, kwargs, message", [
    ({**NEW, "rpc": False}, {}, "no flag for RPC workers"),
    (OLD, {"load_mode": "dio"}, "needs -lm/--load-mode"),
    ({**OLD, "mlock": False}, {"load_mode": "mmap+mlock"}, "needs --mlock"),
    (NEW, {"load_mode": "fast"}, "load_mode 'fast' is not one of"),
    ({**NEW, "metrics": False}, {"metrics": True}, "the metrics endpoint"),
])
def test_llama_server_argv_errors(features: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(FlagError, match=message):
        render_llama_server_argv(BIN, PLAN, features, MODEL, **kwargs)


@pytest.mark.parametrize("mode, new, old", [
    ("auto", [], []),
    (None, [], []),
    ("mmap", ["-lm", "mmap"], []),
    ("none", ["-lm", "none"], ["--no-mmap"]),
    ("mlock", ["-lm", "mlock"], ["--no-mmap", "--mlock"]),
    ("mmap+mlock", ["-lm", "mmap+mlock"], ["--mlock"]),
])
def test_load_mode_args(mode: str | None, new: list[str], old: list[str]) -> None:
    assert (load_mode_args(mode, NEW), load_mode_args(mode, OLD)) == (new, old)


# --- the model's name and chat templates ------------------------------------------------------------

def test_alias_jinja_and_template_file_on_the_current_build() -> None:
    argv = render_llama_server_argv(BIN, PLAN, NEW, MODEL, alias="gemma-3-270m-q4_k_m", jinja=True,
                                    chat_template_file="/etc/llamafleet/chat-template.jinja", load_mode="none")
    tail = argv[argv.index("--port") + 2:]
    assert tail == ["--alias", "gemma-3-270m-q4_k_m", "--jinja", "--chat-template-file",
                    "/etc/llamafleet/chat-template.jinja", "-lm", "none"]


@pytest.mark.parametrize("template, jinja, template_file, features, expected", [
    (None, None, None, NEW, []),
    (None, True, None, NEW, ["--jinja"]),
    (None, False, None, NEW, ["--no-jinja"]),
    (None, False, None, {**NEW, "no_jinja": False}, []),  # a build without Jinja by default needs no flag
    ("gemma", True, None, NEW, ["--jinja", "--chat-template", "gemma"]),
    ("chatml", False, None, NEW, ["--no-jinja", "--chat-template", "chatml"]),
    (None, True, "/t.jinja", NEW, ["--jinja", "--chat-template-file", "/t.jinja"]),
    (None, None, "/t.jinja", NEW, ["--chat-template-file", "/t.jinja"]),
])
def test_chat_template_args(template, jinja, template_file, features, expected) -> None:
    assert chat_template_args(template, jinja, template_file, features) == expected


@pytest.mark.parametrize("template, jinja, template_file, features, message", [
    ("gemma", True, "/t.jinja", NEW, "both name a template"),
    (None, False, "/t.jinja", NEW, "is a Jinja template, and llama_server_jinja is false"),
    (None, True, None, OLD, "Jinja chat templates (llama_server_jinja)"),
    (None, None, "/t.jinja", OLD, "a chat template file (llama_server_chat_template_file)"),
])
def test_chat_template_args_refuse(template, jinja, template_file, features, message) -> None:
    with pytest.raises(FlagError, match=re.escape(message)):
        chat_template_args(template, jinja, template_file, features)


def test_an_alias_needs_the_flag() -> None:
    with pytest.raises(FlagError, match=re.escape("a model alias (llama_server_alias)")):
        render_llama_server_argv(BIN, PLAN, OLD, MODEL, alias="m")
    assert "--alias" not in render_llama_server_argv(BIN, PLAN, NEW, MODEL, alias="")
