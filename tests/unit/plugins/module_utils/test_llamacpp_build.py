"""llamacpp_build: the build id (the artifact cache key) and the CMake arguments.

The id must not change for the same inputs: it names every cached artifact and installed build.
Each case is checked against the Jinja the role used before (rendered by Ansible's own templar from
tests/unit/fixtures/llamacpp_build/identity_jinja_737b23b.yml), and the lab's id is pinned.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils import _internal

from llamafleet.core.constants import LLAMACPP_BACKENDS
from llamafleet.core.llamacpp_build import (
    BACKEND_CMAKE,
    BuildSettingsError,
    build_identity,
    cluster_source,
    cluster_source_mismatch,
    NO_AMX_CMAKE,
    key_material,
)

_WAS_CONTROLLER = _internal.is_controller
try:
    # Controller imports mark the process as the controller (see test_llamafleet_filter.py): restore the flag.
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template
finally:
    _internal.is_controller = _WAS_CONTROLLER

OLD_JINJA = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp_build" / "identity_jinja_737b23b.yml"
ROLE = Path(__file__).resolve().parents[4] / "roles" / "llamacpp_build"

LAB_FACTS = {"distribution": "Debian", "distribution_major_version": "12", "architecture": "x86_64",
             "processor": ["0", "AuthenticAMD", "AMD EPYC", "1", "AuthenticAMD", "AMD EPYC"]}
# What `llamafleet lab up` sets (llamafleet/lab/inventory.py), on top of the role defaults.
LAB_SETTINGS = {
    "source_type": "archive",
    "archive_sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "archive_subdir": "llama_cpp_python-0.3.36/vendor/llama.cpp",
    "version": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
}
GIT = {"source_type": "git", "git_repo": "https://github.com/ggml-org/llama.cpp.git",
       "git_version": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"}


def _role_defaults() -> dict[str, Any]:
    with (ROLE / "defaults" / "main.yml").open(encoding="utf-8") as handle:
        defaults = yaml.safe_load(handle)
    return {k[len("llamacpp_build_"):]: v for k, v in defaults.items()
            if k[len("llamacpp_build_"):] in ("backend", "source_type", "git_repo", "git_version", "archive_sha256",
                                              "archive_subdir", "version", "cmake_args", "native",
                                              "cuda_architectures", "rocm_targets", "ccache", "amx")}


def _trusted(value: Any) -> Any:
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, list):
        return [_trusted(v) for v in value]
    if isinstance(value, dict):
        return {k: _trusted(v) for k, v in value.items()}
    return value


def old_jinja(settings: dict[str, Any], facts: dict[str, Any], recipe: int) -> dict[str, Any]:
    """The role's former Jinja, rendered by Ansible for these settings and facts."""
    with OLD_JINJA.open(encoding="utf-8") as handle:
        old = yaml.safe_load(handle)
    variables = {"llamacpp_build_" + k: v for k, v in settings.items()}
    variables.update(old["vars"], **old["task_vars"])
    variables.update(_llamacpp_build_recipe=recipe, ansible_facts=facts)
    templar = Templar(loader=DataLoader(), variables=_trusted(variables))
    out = {k: templar.template(trust_as_template(v)) for k, v in old["set_fact"].items()}
    return {"id": out["_llamacpp_build_id"], "label": out["_llamacpp_build_version_label"],
            "cmake": list(out["_llamacpp_build_cmake"])}


CASES = [
    pytest.param({}, LAB_FACTS, 2, id="defaults"),
    pytest.param(LAB_SETTINGS, LAB_FACTS, 2, id="lab"),
    pytest.param(dict(LAB_SETTINGS, native=False), LAB_FACTS, 2, id="lab-not-native"),
    pytest.param(dict(LAB_SETTINGS, version=""), LAB_FACTS, 2, id="archive-without-version"),
    pytest.param(dict(GIT, version="  b6000  "), LAB_FACTS, 3, id="git-version-trimmed"),
    pytest.param(dict(GIT, backend="cuda", cuda_architectures="86;89", cmake_args=["-DGGML_CUDA_F16=ON"]),
                 dict(LAB_FACTS, processor=[]), 2, id="cuda-arch-extra-args-no-cpu-fact"),
    pytest.param(dict(GIT, backend="rocm", rocm_targets="gfx1100", ccache=False, native=False),
                 dict(LAB_FACTS, distribution="Ubuntu", distribution_major_version="24"), 2, id="rocm-no-ccache"),
    pytest.param(dict(GIT, backend="cuda", rocm_targets="gfx1100"), LAB_FACTS, 2, id="rocm-targets-ignored-for-cuda"),
    pytest.param(dict(GIT, backend="metal"), dict(LAB_FACTS, processor=["Apple M2"], architecture="arm64",
                                                  distribution="MacOSX", distribution_major_version="14"),
                 2, id="metal"),
    pytest.param(dict(GIT, backend="vulkan", archive_sha256="ignored-for-git"), LAB_FACTS, 2, id="vulkan"),
]


@pytest.mark.parametrize(("settings", "facts", "recipe"), CASES)
def test_same_as_the_former_jinja(settings: dict[str, Any], facts: dict[str, Any], recipe: int) -> None:
    # The former Jinja had no AMX switch: it built what llamacpp_build_amx=true builds (test_amx_left_out_...).
    full = dict(_role_defaults(), **settings, amx=True)
    identity = build_identity(full, facts, recipe)
    assert identity.pop("source") == cluster_source(full)  # new: what the cluster compares
    assert identity == old_jinja(full, facts, recipe)


def test_the_lab_id_is_pinned() -> None:
    """The lab's artifact cache holds this build: its id must stay, or the lab compiles again (~12 min).

    For the lab's settings on hosts of Debian 12, x86_64, 2 x "AMD EPYC" (as /proc/cpuinfo showed inside the lab
    containers of earlier machines), recipe 2 (roles/llamacpp_build/vars/main.yml). It was 0c1e57098bba-cpu-cc8d0a3f18
    (the former Jinja's, as with llamacpp_build_amx=true) until native builds left AMX out.
    """
    with (ROLE / "vars" / "main.yml").open(encoding="utf-8") as handle:
        recipe = yaml.safe_load(handle)["_llamacpp_build_recipe"]
    identity = build_identity(dict(_role_defaults(), **LAB_SETTINGS), LAB_FACTS, recipe)
    assert identity["id"] == "0c1e57098bba-cpu-8b00f86314"
    assert identity["label"] == LAB_SETTINGS["version"]


@pytest.mark.parametrize(("change", "same"), [
    ({"ccache": False}, True),                       # ccache changes how, not what, is built
    ({"cmake_args": ["-DGGML_AVX512=OFF"]}, False),
    ({"native": False}, False),
    ({"archive_subdir": "other"}, False),
    ({"cuda_architectures": "86"}, False),           # in the key even for a cpu build
])
def test_what_changes_the_id(change: dict[str, Any], same: bool) -> None:
    base = dict(_role_defaults(), **LAB_SETTINGS)
    assert (build_identity(dict(base, **change), LAB_FACTS, 2)["id"]
            == build_identity(base, LAB_FACTS, 2)["id"]) is same


def test_cpu_model_counts_only_for_native_builds() -> None:
    other_cpu = dict(LAB_FACTS, processor=["Intel Xeon"])
    base = dict(_role_defaults(), **LAB_SETTINGS)
    assert key_material(base, LAB_FACTS, 2)["cpu"] == "AMD EPYC"
    assert build_identity(base, other_cpu, 2)["id"] != build_identity(base, LAB_FACTS, 2)["id"]
    portable = dict(base, native=False)
    assert build_identity(portable, other_cpu, 2)["id"] == build_identity(portable, LAB_FACTS, 2)["id"]


@pytest.mark.parametrize(("change", "facts", "left_out"), [
    ({}, LAB_FACTS, True),                                          # the default: native x86_64, AMX left out
    ({"amx": True}, LAB_FACTS, False),                              # asked for
    ({"native": False}, LAB_FACTS, False),                          # no -march=native: ggml's AMX options are off
    ({}, dict(LAB_FACTS, architecture="aarch64"), False),           # GCC knows no -mno-amx-* there
    ({"backend": "vulkan"}, LAB_FACTS, True),                       # the CPU part of every backend's build
])
def test_amx_left_out_of_native_x86_64_builds(change: dict[str, Any], facts: dict[str, Any], left_out: bool) -> None:
    """At the pinned llama.cpp ggml's AMX kernels die with SIGILL on an AMX CPU (seen on this project's CI
    machine): a native x86_64 build compiles with -mno-amx-*, unless llamacpp_build_amx asks for AMX."""
    settings = dict(_role_defaults(), **LAB_SETTINGS, **change)
    identity = build_identity(settings, facts, 2)
    flags = [arg for arg in identity["cmake"] if arg.startswith(("-DCMAKE_C_FLAGS=", "-DCMAKE_CXX_FLAGS="))]
    assert flags == (list(NO_AMX_CMAKE) if left_out else [])
    if left_out:
        assert flags == ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                         "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
        # GGML_NATIVE=ON comes first; the user's own arguments come after and may replace the flags
        assert identity["cmake"].index("-DGGML_NATIVE=ON") < identity["cmake"].index(flags[0])
        # an artifact compiled with AMX is never taken for one without
        assert identity["id"] != build_identity(dict(settings, amx=True), facts, 2)["id"]
        assert list(NO_AMX_CMAKE) == key_material(settings, facts, 2)["cmake"][-2:]


def test_amx_flags_really_turn_amx_off_under_march_native() -> None:
    """The compiler the hosts build with (Debian's gcc) drops AMX for -march=native followed by -mno-amx-*, whether
    or not this machine's CPU has AMX: -march=sapphirerapids has it on every x86_64 machine."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed (make deps installs it)"
    flags = NO_AMX_CMAKE[1].split("=", 1)[1].split()

    def macros(*args: str) -> str:
        return subprocess.run([gcc, *args, "-dM", "-E", "-"], input="", capture_output=True, text=True,
                              check=True).stdout

    assert "__AMX_INT8__" in macros("-march=sapphirerapids")
    for order in (["-march=sapphirerapids", *flags], [*flags, "-march=sapphirerapids"]):
        got = macros(*order)
        assert "__AMX_TILE__" not in got and "__AMX_INT8__" not in got and "__AMX_BF16__" not in got
        assert "__AVX512F__" in got  # the rest of the CPU's features stay


@pytest.mark.parametrize(("settings", "facts", "message"), [
    ({"backend": "opencl"}, LAB_FACTS, "llamacpp_build_backend='opencl' is not one of cpu, cuda"),
    ({"source_type": "svn"}, LAB_FACTS, "llamacpp_build_source_type='svn' is not git or archive"),
    ({"cmake_args": "-DX=1"}, LAB_FACTS, "llamacpp_build_cmake_args must be a list of strings"),
    ({"native": "yes"}, LAB_FACTS, "llamacpp_build_native must be a boolean"),
    ({"amx": "no"}, LAB_FACTS, "llamacpp_build_amx must be a boolean"),
    ({"jobs": 4}, LAB_FACTS, "unknown build settings: jobs"),
    ({}, {"architecture": "x86_64"}, "needs the host's facts distribution, distribution_major_version: gather"),
])
def test_bad_settings_name_the_variable(settings: dict[str, Any], facts: dict[str, Any], message: str) -> None:
    with pytest.raises(BuildSettingsError, match=message):
        build_identity(settings, facts, 2)


def test_every_backend_has_its_switch() -> None:
    assert tuple(BACKEND_CMAKE) == LLAMACPP_BACKENDS


SHA_A, SHA_B = "a" * 64, "b" * 64


@pytest.mark.parametrize(("settings", "source"), [
    (GIT, "git commit %s" % GIT["git_version"]),
    (dict(GIT, git_repo="https://mirror.invalid/llama.cpp.git", backend="cuda", native=False),
     "git commit %s" % GIT["git_version"]),  # another repository, backend or CPU: the same source
    (dict(LAB_SETTINGS, archive_sha256=SHA_A, archive_subdir="llama.cpp-x"), "archive sha256 %s subdir llama.cpp-x" % SHA_A),
    (dict(LAB_SETTINGS, archive_sha256=SHA_A, archive_subdir=""), "archive sha256 %s" % SHA_A),
])
def test_cluster_source_is_the_commit_or_the_archive(settings: dict[str, Any], source: str) -> None:
    assert cluster_source(dict(_role_defaults(), **settings)) == source


def test_one_source_is_one_cluster() -> None:
    assert cluster_source_mismatch({"lab1": "git commit x", "lab2": "git commit x", "lab3": "git commit x"}) is None
    assert cluster_source_mismatch({"lab1": "git commit x"}) is None
    assert cluster_source_mismatch({}) is None


def test_mixed_sources_are_named_with_their_hosts_and_the_variables() -> None:
    message = cluster_source_mismatch({"lab3": "archive sha256 " + SHA_B, "lab1": "archive sha256 " + SHA_A,
                                       "lab2": "archive sha256 " + SHA_A, "lab4": "git commit c"})
    assert message is not None
    # the largest group first, then by source; hosts by name
    assert ("(archive sha256 %s on lab1, lab2; archive sha256 %s on lab3; git commit c on lab4)" % (SHA_A, SHA_B)
            in message)
    for variable in ("llamacpp_build_git_version", "llamacpp_build_archive_sha256", "llamacpp_build_archive_subdir",
                     "llamacpp_build_source_type"):
        assert variable in message
