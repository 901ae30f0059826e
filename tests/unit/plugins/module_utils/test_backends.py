"""backends: the one table of llama.cpp backends, and every place that differs by backend reads it or agrees with it.

Python reads the table (CMake switches, device names, the unit's device nodes, preflight, the unit's environment);
the roles read it through the constants lookup (the service user's groups, the build packages); what Ansible needs
as static YAML (argument_specs choices, documentation) is compared with it here.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from llamafleet.core import backend_checks, constants, gpu_devices, gpu_probe, llamacpp_build, systemd_unit
from llamafleet.core.backends import BACKENDS, LINUX_BACKENDS, Backend, build_packages, user_groups
from llamafleet.core.llama_server_plan import unit_environment

REPO = Path(__file__).resolve().parents[4]
GPU_BACKENDS = tuple(name for name in LINUX_BACKENDS if BACKENDS[name].device_nodes)


def test_the_table_is_keyed_by_each_backends_name() -> None:
    assert list(BACKENDS) == ["cpu", "cuda", "vulkan", "metal", "rocm"]
    assert all(isinstance(b, Backend) and b.name == name for name, b in BACKENDS.items())
    assert LINUX_BACKENDS == ("cpu", "cuda", "vulkan", "rocm")


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_is_described_whole(name: str) -> None:
    b = BACKENDS[name]
    assert b.ggml_prefix
    assert b.cmake == () if name == "cpu" else all(re.fullmatch(r"-DGGML_[A-Z]+=ON", s) for s in b.cmake) and b.cmake
    if not b.linux:
        assert (b.device_nodes, b.user_groups, b.build_packages) == ((), (), {})
    elif name in GPU_BACKENDS:
        assert b.needs and b.fix and b.user_groups == ("video", "render")
        assert all(node.startswith("/dev/") for node in b.device_nodes)
    else:
        assert (b.needs, b.fix, b.user_groups) == ("", "", ())


def test_the_python_places_are_views_of_the_table() -> None:
    assert constants.LLAMACPP_BACKENDS == tuple(BACKENDS)
    assert llamacpp_build.BACKEND_CMAKE == {name: b.cmake for name, b in BACKENDS.items()}
    assert systemd_unit.BACKEND_DEVICE_NODES == {name: BACKENDS[name].device_nodes for name in LINUX_BACKENDS}
    assert backend_checks.SERVED_BACKENDS == LINUX_BACKENDS
    assert {name: gpu_devices.GGML_PREFIX[name] for name in BACKENDS} == {n: b.ggml_prefix for n, b in BACKENDS.items()}
    assert set(BACKENDS) <= set(gpu_devices.BACKENDS)


def test_the_code_per_backend_covers_the_table() -> None:
    """Each Linux backend has its device probe; each GPU backend its preflight check and its rank among GPUs."""
    assert set(gpu_probe.PROBE_BACKENDS) == set(LINUX_BACKENDS)
    assert gpu_probe.PROBE_BACKENDS[-1] == "cpu"
    assert set(backend_checks._LACKS) == set(GPU_BACKENDS)
    assert set(GPU_BACKENDS) <= set(gpu_devices.BACKEND_PREFERENCE)
    assert "metal" in gpu_devices.BACKEND_PREFERENCE


@pytest.mark.parametrize(("backend", "settings", "expected"), [
    ("cuda", {"cuda_architectures": "86"}, "-DCMAKE_CUDA_ARCHITECTURES=86"),
    ("rocm", {"rocm_targets": "gfx1100"}, "-DAMDGPU_TARGETS=gfx1100"),
])
def test_gpu_targets_come_from_the_table(backend: str, settings: dict, expected: str) -> None:
    args = llamacpp_build.cmake_args({"backend": backend, **settings})
    assert expected in args and BACKENDS[backend].cmake[0] in args
    assert expected not in llamacpp_build.cmake_args({"backend": "vulkan", **settings})


def test_metal_has_no_unit_and_no_host_to_serve() -> None:
    with pytest.raises(systemd_unit.UnitError, match="macOS"):
        systemd_unit.device_policy("metal")
    assert "builds for macOS" in backend_checks.host_problem("metal", {})


def test_preflight_says_what_the_table_says_a_backend_needs() -> None:
    problem = backend_checks.host_problem("rocm", {"kfd": False, "gpu_vendors": []})
    assert problem is not None
    assert BACKENDS["rocm"].needs in problem and BACKENDS["rocm"].fix in problem


def test_the_views_the_roles_read() -> None:
    assert constants.BACKEND_USER_GROUPS == user_groups() == {name: list(b.user_groups) for name, b in BACKENDS.items()}
    assert constants.BACKEND_BUILD_PACKAGES == build_packages()
    assert build_packages()["Debian"]["vulkan"] == ["libvulkan-dev", "glslc", "spirv-headers"]
    assert "metal" not in build_packages()["Debian"]


def test_the_constants_lookup_serves_them() -> None:
    from ansible_collections.llamafleet.cluster.plugins.lookup.constants import LookupModule

    groups, packages = LookupModule().run(["backend_user_groups", "backend_build_packages"])
    assert groups["vulkan"] == ["video", "render"] and groups["cpu"] == []
    assert packages["RedHat"]["cuda"] == ["cuda-toolkit"]


def test_the_roles_read_the_table_through_the_lookup() -> None:
    user = (REPO / "roles/_common/tasks/user.yml").read_text(encoding="utf-8")
    packages = (REPO / "roles/llamacpp_build/vars/main.yml").read_text(encoding="utf-8")
    assert "lookup('llamafleet.cluster.constants', 'backend_user_groups')[_common_user_backend]" in user
    assert "'backend_build_packages').get(ansible_facts['os_family'], {})\n       .get(llamacpp_build_backend | string, [])" \
        in packages
    for text in (user, packages):
        assert not re.search(r"\[\s*'(cuda|rocm|vulkan)'", text), "a backend typed in a role"


def test_every_os_family_the_role_knows_has_each_backends_packages() -> None:
    families = sorted(p.stem for p in (REPO / "roles/llamacpp_build/vars").glob("*.yml") if p.stem != "main")
    assert families == ["Debian", "RedHat"]
    for family in families:
        assert set(build_packages()[family]) == set(LINUX_BACKENDS), family


def _documentation(path: Path, name: str = "DOCUMENTATION") -> dict:
    if path.suffix == ".yml":
        return yaml.safe_load(path.read_text(encoding="utf-8"))["DOCUMENTATION"]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return yaml.safe_load(next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                               and getattr(node.targets[0], "id", "") == name))


def test_the_static_yaml_agrees_with_the_table() -> None:
    """Where Ansible needs the backends typed (choices, documentation), they are the table's."""
    specs = yaml.safe_load((REPO / "roles/llamacpp_build/meta/argument_specs.yml").read_text(encoding="utf-8"))
    assert specs["argument_specs"]["main"]["options"]["llamacpp_build_backend"]["choices"] == list(BACKENDS)
    common = yaml.safe_load((REPO / "roles/_common/meta/argument_specs.yml").read_text(encoding="utf-8"))
    described = common["argument_specs"]["user"]["options"]["_common_user_backend"]["description"]
    assert re.findall(r"C\((\w+)\)", described) == list(BACKENDS)
    identity = _documentation(REPO / "plugins/filter/llamacpp_build_identity.yml")["options"]["_input"]["description"]
    assert "C(backend) (%s)" % ", ".join("V(%s)" % b for b in BACKENDS) in " ".join(identity)
    probes = _documentation(REPO / "plugins/modules/gpu_facts.py")["options"]["backends"]["description"]
    assert "V(auto) probes %s and C(cpu)." % ", ".join("C(%s)" % b for b in gpu_probe.PROBE_BACKENDS[:-1]) \
        in " ".join(probes)
    readme = (REPO / "roles/llamacpp_build/README.md").read_text(encoding="utf-8")
    assert "One of %s;" % ", ".join("`%s`" % b for b in BACKENDS) in readme
    readme = (REPO / "roles/_common/README.md").read_text(encoding="utf-8")
    assert "runs (%s). |" % ", ".join("`%s`" % b for b in BACKENDS) in readme
    grouped = sorted(name for name in BACKENDS if BACKENDS[name].user_groups)
    groups = " and ".join("`%s`" % g for g in BACKENDS["cuda"].user_groups)
    assert "%s for %s and `%s`)" % (groups, ", ".join("`%s`" % b for b in grouped[:-1]), grouped[-1]) in readme


def test_llama_server_gets_the_environment_of_its_local_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda's CUDA_DEVICE_ORDER when the plan has a local CUDA device, unless given; a new backend's as well."""
    cuda, rpc = {"local": True, "backend": "cuda"}, {"local": False, "backend": "rpc"}
    assert unit_environment([rpc, cuda], {"A": "1"}) == {"A": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert unit_environment([rpc, cuda], {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) == {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert unit_environment([rpc, {"local": False, "backend": "cuda"}], {}) == {}
    monkeypatch.setitem(BACKENDS, "rocm", dataclasses.replace(BACKENDS["rocm"], unit_environment={"HIP_X": "1"}))
    assert unit_environment([{"local": True, "backend": "rocm"}], {}) == {"HIP_X": "1"}
