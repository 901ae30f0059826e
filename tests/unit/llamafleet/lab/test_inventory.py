"""The inventory `lab up` writes: hosts.ini, group_vars, known_hosts (pure rendering)."""

from __future__ import annotations

import configparser
import resource
import shlex
from pathlib import Path

import pytest
import yaml

from llamafleet.lab.inventory import (
    EDGE_MAXCONN_DEFAULT,
    lab_edge_maxconn,
    lab_group_vars,
    remove_inventory,
    render_group_vars,
    render_hosts_ini,
    render_known_hosts,
    write_inventory,
)
from llamafleet.lab.net import lab_hosts

REPO = Path(__file__).resolve().parents[4]
KEY = Path("/var/cache/llamafleet/lab/id_ed25519")
KNOWN = Path("/var/cache/llamafleet/lab/run/known_hosts")


def _ini(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(allow_no_value=True, delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


def test_hosts_ini_groups_and_addresses() -> None:
    ini = _ini(render_hosts_ini(lab_hosts(3), KEY, KNOWN))
    assert list(ini["llamafleet_orchestrator"]) == ["lab1 ansible_host"]
    assert ini["llamafleet_orchestrator"]["lab1 ansible_host"] == "10.77.0.11 llamafleet_cluster_address=10.77.0.11"
    assert [k.split()[0] for k in ini["llamafleet_workers"]] == ["lab2", "lab3"]
    assert list(ini["llamafleet:children"]) == ["llamafleet_orchestrator", "llamafleet_workers"]
    assert ini["llamafleet:vars"]["ansible_user"] == "root"
    assert ini["llamafleet:vars"]["ansible_ssh_private_key_file"] == str(KEY)
    assert ini["llamafleet:vars"]["ansible_python_interpreter"] == "/usr/bin/python3"


def test_hosts_ini_pins_host_keys_for_the_lab_only() -> None:
    ini = _ini(render_hosts_ini(lab_hosts(2), KEY, KNOWN))
    args = shlex.split(shlex.split(ini["llamafleet:vars"]["ansible_ssh_common_args"])[0])
    assert args == ["-o", f"UserKnownHostsFile={KNOWN}", "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes"]


def test_single_host_lab_has_an_empty_workers_group() -> None:
    text = render_hosts_ini(lab_hosts(1), KEY, KNOWN)
    ini = _ini(text)
    assert list(ini["llamafleet_workers"]) == []
    assert "lab1 ansible_host=10.77.0.11" in text


def test_paths_that_would_break_the_ini_are_refused() -> None:
    with pytest.raises(ValueError, match="spaces or quotes"):
        render_hosts_ini(lab_hosts(1), Path("/my cache/id"), KNOWN)


def test_lab_group_vars() -> None:
    values = lab_group_vars()
    assert values["llamafleet_lab"] is True
    assert values["llamacpp_build_source_type"] == "archive"
    assert values["llamacpp_build_archive_url"] == "http://10.77.0.1:8089/src/llama_cpp_python-0.3.36.tar.gz"
    assert values["llamacpp_build_archive_sha256"] == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert values["llamacpp_build_archive_subdir"] == "llama_cpp_python-0.3.36/vendor/llama.cpp"
    assert values["llamacpp_build_version"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert values["model_name"] == "gemma-3-270m-q4_k_m"
    assert values["model_files"] == [{
        "url": "http://10.77.0.1:8089/models/gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    }]


def test_the_labs_edge_maxconn_fits_the_descriptors_its_hosts_inherit() -> None:
    """HAProxy needs 2 descriptors a connection and the role adds 1024: this machine's hard limit of 20000 gives 9488;
    a host without a tight limit keeps the edge role's own default (the two cannot drift apart)."""
    defaults = yaml.safe_load((REPO / "roles" / "edge" / "defaults" / "main.yml").read_text())
    assert EDGE_MAXCONN_DEFAULT == defaults["edge_maxconn"]
    assert lab_edge_maxconn(20000) == 9488
    assert lab_edge_maxconn(9488 * 2 + 1024) == 9488
    assert lab_edge_maxconn(1048576) == EDGE_MAXCONN_DEFAULT
    assert lab_edge_maxconn(resource.RLIM_INFINITY) == EDGE_MAXCONN_DEFAULT
    assert lab_edge_maxconn(1024) == 1
    assert lab_group_vars()["edge_maxconn"] == lab_edge_maxconn(resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def test_group_vars_yaml_round_trips() -> None:
    text = render_group_vars(lab_group_vars())
    assert text.startswith("---\n# Written by `llamafleet lab up`")
    assert yaml.safe_load(text) == lab_group_vars()


def test_known_hosts_lines() -> None:
    keys = {"lab1": {"ssh-ed25519": "AAAA1", "ssh-rsa": "BBBB1"}, "lab2": {"ssh-ed25519": "AAAA2"}}
    assert render_known_hosts(keys, lab_hosts(2)) == (
        "10.77.0.11 ssh-ed25519 AAAA1\n10.77.0.11 ssh-rsa BBBB1\n10.77.0.12 ssh-ed25519 AAAA2\n"
    )


def test_write_then_remove_inventory(tmp_path: Path) -> None:
    hosts_ini = write_inventory(tmp_path, lab_hosts(3), KEY, KNOWN)
    group_vars = tmp_path / "group_vars" / "all" / "lab.yml"
    assert hosts_ini.read_text() == render_hosts_ini(lab_hosts(3), KEY, KNOWN)
    assert yaml.safe_load(group_vars.read_text()) == lab_group_vars()
    assert remove_inventory(tmp_path) == [hosts_ini, group_vars]
    assert not hosts_ini.exists() and not group_vars.exists()


def test_a_vulkan_host_gets_its_backend_group_and_vars(tmp_path: Path) -> None:
    hosts = lab_hosts(3)
    ini = _ini(render_hosts_ini(hosts, KEY, KNOWN, {"lab3": "vulkan", "lab1": "cpu"}))
    assert list(ini["llamafleet_backend_vulkan"]) == ["lab3"]
    assert not [section for section in ini.sections() if section.startswith("llamafleet_backend_cpu")]
    write_inventory(tmp_path, hosts, KEY, KNOWN, {"lab3": "vulkan"})
    vulkan = tmp_path / "group_vars" / "llamafleet_backend_vulkan" / "lab.yml"
    values = yaml.safe_load(vulkan.read_text())
    assert values["llamacpp_build_backend"] == "vulkan"
    assert values["rpc_server_environment"] == {"GGML_VK_VISIBLE_DEVICES": "0"}
    # the same lab without a Vulkan host: its group vars go, with their folder
    write_inventory(tmp_path, hosts, KEY, KNOWN)
    assert not vulkan.parent.exists()
    assert "llamafleet_backend_vulkan" not in (tmp_path / "hosts.ini").read_text()
    write_inventory(tmp_path, hosts, KEY, KNOWN, {"lab3": "vulkan"})
    assert vulkan in remove_inventory(tmp_path) and not vulkan.parent.exists()


def test_host_kinds() -> None:
    from llamafleet.lab.core import host_kinds
    from llamafleet.lab.image import HOST_KINDS
    from llamafleet.lab.system import LabError
    assert host_kinds(lab_hosts(3), {"lab3": "vulkan"}) == {"lab1": "cpu", "lab2": "cpu", "lab3": "vulkan"}
    assert (HOST_KINDS["vulkan"].suite, HOST_KINDS["cpu"].suite) == ("trixie", "bookworm")
    assert {"mesa-vulkan-drivers", "libvulkan1", "vulkan-tools"} <= set(HOST_KINDS["vulkan"].packages)
    with pytest.raises(LabError, match="lab4 is not a host of this lab"):
        host_kinds(lab_hosts(3), {"lab4": "vulkan"})
    with pytest.raises(LabError, match="lab2: unknown host kind 'cuda'"):
        host_kinds(lab_hosts(3), {"lab2": "cuda"})


def test_remove_inventory_leaves_files_it_did_not_write(tmp_path: Path) -> None:
    mine = tmp_path / "hosts.ini"
    mine.write_text("[web]\nweb1\n")
    assert remove_inventory(tmp_path) == []
    assert mine.exists()
