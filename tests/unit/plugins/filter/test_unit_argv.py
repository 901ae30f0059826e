"""unit_argv filter plugin: the rpc_server role's chain rpc_server_argv | rpc_server_unit, errors as AnsibleFilterError."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.module_utils import _internal

# Importing ansible.errors marks the process as the controller (see test_llamafleet_filter.py): restore the flag.
_WAS_CONTROLLER = _internal.is_controller
from ansible.errors import AnsibleFilterError  # noqa: E402
from ansible_collections.llamafleet.cluster.plugins.filter.unit_argv import FilterModule  # noqa: E402
from llamafleet.core.llama_flags import rpc_server_features  # noqa: E402
from llamafleet.core.systemd_unit import device_policy, hardening  # noqa: E402
_internal.is_controller = _WAS_CONTROLLER

FILTERS = FilterModule().filters()
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
BUILD = {
    "bin_dir": "/opt/llamafleet/llama.cpp/b1-cuda/bin",
    "rpc_server": "ggml-rpc-server",
    "backend": "cuda",
    "build_id": "b1-cuda",
    "features": {"rpc_server": rpc_server_features((FIXTURES / "ggml-rpc-server_0c1e570_help_real.txt").read_text())},
}


def role_unit(build: dict, firewall: bool = True, memory_max_mib: object = 0) -> str:
    """What roles/rpc_server/tasks/configure.yml renders for one instance."""
    argv = FILTERS["rpc_server_argv"](build, host="10.77.0.12", port=50053, threads=0, devices=["CUDA1"], cache=True)
    return FILTERS["rpc_server_unit"](argv, build, port=50053, user="llamafleet-rpc", home="/var/lib/llamafleet-rpc",
                                      firewall=firewall, header="# Managed by Ansible", memory_max_mib=memory_max_mib)


def test_role_chain_renders_the_instance() -> None:
    lines = role_unit(BUILD).splitlines()
    assert lines[:2] == ["# Managed by Ansible", "# llama.cpp build b1-cuda (cuda)"]
    start = lines.index("ExecStart=/opt/llamafleet/llama.cpp/b1-cuda/bin/ggml-rpc-server \\")
    assert lines[start + 1:start + 5] == ["    -H 10.77.0.12 \\", "    -p 50053 \\", "    -d CUDA1 \\", "    -c"]
    assert "Description=llama.cpp RPC worker for the llamafleet cluster (port 50053)" in lines
    assert "Requires=llamafleet-rpc-firewall.service" in lines
    assert "PrivateDevices=yes" not in lines and "ProtectClock=yes" not in lines  # CUDA GPUs stay reachable
    assert "PrivateDevices=yes" in role_unit(dict(BUILD, backend="cpu")).splitlines()
    assert "Requires=llamafleet-rpc-firewall.service" not in role_unit(BUILD, firewall=False).splitlines()


def test_role_chain_renders_the_memory_limit() -> None:
    # gpu_facts' memory_max_mib, an int (or the string a template makes of it)
    for given in (2048, "2048"):
        lines = role_unit(dict(BUILD, backend="cpu"), memory_max_mib=given).splitlines()
        assert lines[lines.index("MemoryMax=2048M") + 1] == "MemorySwapMax=0"
    assert not [line for line in role_unit(BUILD).splitlines() if line.startswith("Memory")]
    with pytest.raises(AnsibleFilterError, match="rpc_server_unit: "):
        role_unit(BUILD, memory_max_mib="lots")


@pytest.mark.parametrize("build, message", [
    (dict(BUILD, backend="metal"), "rpc_server_unit: backend 'metal' builds run on macOS"),
    ({k: v for k, v in BUILD.items() if k != "backend"}, "rpc_server_unit: 'backend'"),
])
def test_rpc_server_unit_errors(build: dict, message: str) -> None:
    with pytest.raises(AnsibleFilterError, match=message):
        role_unit(build)


def test_rpc_server_argv_errors() -> None:
    with pytest.raises(AnsibleFilterError, match="rpc_server_argv: 'rpc_server'"):
        FILTERS["rpc_server_argv"]({"bin_dir": "/x"}, host="10.0.0.1", port=50052)


def test_unit_hardening_is_the_one_list_with_the_templates_differences() -> None:
    """What rpc-metrics.service.j2 asks for: values changed, a line after ProtectSystem=, the CPU device policy."""
    text = FILTERS["unit_hardening"]({"UMask": "0022", "ProtectHostname": None},
                                     after={"ProtectSystem": ["ReadWritePaths=/x"]}, backend="cpu")
    assert text.split("\n") == hardening({"UMask": "0022", "ProtectHostname": None},
                                         after={"ProtectSystem": ["ReadWritePaths=/x"], "PrivateTmp": device_policy("cpu")})
    assert "PrivateTmp=yes\nPrivateDevices=yes\nProtectClock=yes\n" in text and not text.endswith("\n")
    assert FILTERS["unit_hardening"]() == "\n".join(hardening())
    with pytest.raises(AnsibleFilterError, match="unit_hardening: not a hardening setting: Umask"):
        FILTERS["unit_hardening"]({"Umask": "0022"})
    with pytest.raises(AnsibleFilterError, match="unit_hardening: .*metal"):
        FILTERS["unit_hardening"](backend="metal")
