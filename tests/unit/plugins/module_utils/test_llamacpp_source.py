"""llamacpp_source: RPC constants read from llama.cpp source text, and the module around it."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from llamafleet.core.llamacpp_source import (
    RPC_HEADER,
    RPC_SOURCE,
    SourceFactsError,
    parse_hash_threshold,
    parse_rpc_proto_major,
    read_source_facts,
)
from ansible_collections.llamafleet.cluster.plugins.modules import llamacpp_source_facts
from llamafleet.lab.artifacts import LLAMA_CPP_ARCHIVE_SUBDIR
from tests.unit.module_runner import run_main
from tests.unit.needs import LAB_SOURCE, needs

# Excerpts of llama.cpp 0c1e570 (vendored in llama-cpp-python 0.3.36).
CPP_0C1E570 = """\
static_assert(RPC_CMD_HELLO == 14, "RPC_CMD_HELLO must be always 14");

// Try RPC_CMD_SET_TENSOR_HASH first when data size is larger than this threshold
const size_t HASH_THRESHOLD = 10 * 1024 * 1024;

struct rpc_msg_hello_req {
"""
CPP_USE = """\
    return size > HASH_THRESHOLD && tensor->buffer->usage == GGML_BACKEND_BUFFER_USAGE_WEIGHTS;
"""
H_0C1E570 = """\
#define RPC_PROTO_MAJOR_VERSION    7
#define RPC_PROTO_MINOR_VERSION    0
#define RPC_PROTO_PATCH_VERSION    0
"""


@pytest.mark.parametrize(("text", "expected"), [
    (CPP_0C1E570 + CPP_USE, 10 * 1024 * 1024),
    ("static constexpr size_t HASH_THRESHOLD = 1024ULL * 1024;\n", 1024 * 1024),
    ("    const uint64_t HASH_THRESHOLD = (4 * 1024 * 1024); // smaller\n", 4 * 1024 * 1024),
    ("#define HASH_THRESHOLD (10*1024*1024) // bytes\n", 10 * 1024 * 1024),
    ("const size_t HASH_THRESHOLD = 5;\n", 5),
    (CPP_USE, None),                       # used but not defined here: not our business
    ("// a backend without a weight cache\n", None),
    ("if (x == HASH_THRESHOLD) {}\n", None),  # a comparison is no definition
])
def test_hash_threshold(text: str, expected: int | None) -> None:
    assert parse_hash_threshold(text) == expected


@pytest.mark.parametrize("text", [
    "const size_t HASH_THRESHOLD = 10 << 20;\n",
    "const size_t HASH_THRESHOLD = MIB(10);\n",
    "size_t threshold() { return 1; }\nstatic size_t HASH_THRESHOLD = 7;\n",
])
def test_hash_threshold_it_cannot_read_fails(text: str) -> None:
    with pytest.raises(SourceFactsError, match="HASH_THRESHOLD"):
        parse_hash_threshold(text)


@pytest.mark.parametrize(("text", "expected"), [
    (H_0C1E570, 7),
    ("#  define RPC_PROTO_MAJOR_VERSION 3 // old\n", 3),
    ("#define RPC_PROTO_MAJOR_VERSION (12)\n", 12),
    ("#define RPC_PROTO_MINOR_VERSION 1\n", None),
    ("", None),
])
def test_rpc_proto_major(text: str, expected: int | None) -> None:
    assert parse_rpc_proto_major(text) == expected


def test_rpc_proto_major_it_cannot_read_fails() -> None:
    with pytest.raises(SourceFactsError, match="RPC_PROTO_MAJOR_VERSION"):
        parse_rpc_proto_major("#define RPC_PROTO_MAJOR_VERSION GGML_RPC_MAJOR\n")


def _tree(root: Path, cpp: str | None, header: str | None) -> Path:
    (root / "CMakeLists.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    for relative, text in ((RPC_SOURCE, cpp), (RPC_HEADER, header)):
        if text is not None:
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text(text)
    return root


@pytest.mark.parametrize(("cpp", "header", "expected"), [
    (CPP_0C1E570, H_0C1E570, {"rpc_hash_threshold": 10485760, "rpc_protocol": 7}),
    (None, H_0C1E570, {"rpc_hash_threshold": None, "rpc_protocol": 7}),
    (None, None, {"rpc_hash_threshold": None, "rpc_protocol": None}),
])
def test_read_source_facts(tmp_path: Path, cpp: str | None, header: str | None, expected: dict) -> None:
    assert read_source_facts(str(_tree(tmp_path, cpp, header))) == expected


def test_not_a_source_tree(tmp_path: Path) -> None:
    with pytest.raises(SourceFactsError, match="is not a llama.cpp source tree"):
        read_source_facts(str(tmp_path))


def test_unreadable_definition_names_the_file(tmp_path: Path) -> None:
    _tree(tmp_path, "const size_t HASH_THRESHOLD = 10 << 20;\n", H_0C1E570)
    with pytest.raises(SourceFactsError, match=r"ggml-rpc\.cpp: HASH_THRESHOLD = 10 << 20"):
        read_source_facts(str(tmp_path))


@needs(LAB_SOURCE.is_file(), "the lab's llama.cpp source %s (python -m llamafleet.lab.fetch source)" % LAB_SOURCE)
def test_the_lab_source(tmp_path: Path) -> None:
    """llama.cpp 0c1e570, as the lab builds it: 10 MiB and protocol 7 (what the e2e tests expect)."""
    wanted = {"%s/%s" % (LLAMA_CPP_ARCHIVE_SUBDIR, name) for name in ("CMakeLists.txt", RPC_SOURCE, RPC_HEADER)}
    with tarfile.open(LAB_SOURCE, "r|gz") as sdist:  # streamed: stop once the three files are out
        for member in sdist:
            if member.name in wanted:
                sdist.extract(member, tmp_path, filter="data")
                wanted.discard(member.name)
                if not wanted:
                    break
    assert not wanted
    assert read_source_facts(str(tmp_path / LLAMA_CPP_ARCHIVE_SUBDIR)) == {
        "rpc_hash_threshold": 10 * 1024 * 1024, "rpc_protocol": 7}


@pytest.mark.parametrize("check_mode", [False, True])
def test_module(tmp_path: Path, capsys: pytest.CaptureFixture[str], check_mode: bool) -> None:
    src = _tree(tmp_path, CPP_0C1E570, H_0C1E570)
    rc, result = run_main(llamacpp_source_facts.main, {"src": str(src), "_ansible_check_mode": check_mode}, capsys)
    assert rc == 0 and result["changed"] is False
    assert (result["rpc_hash_threshold"], result["rpc_protocol"]) == (10485760, 7)


def test_module_fails_naming_the_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = run_main(llamacpp_source_facts.main, {"src": str(tmp_path / "nothing")}, capsys)
    assert rc == 1 and "nothing is not a llama.cpp source tree" in result["msg"]
