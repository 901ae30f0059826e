"""Where the roles put things on each host, from inventory variables and the roles' defaults."""

from __future__ import annotations

import pytest

from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.fleet import Fleet, Host
from llamafleet.layout import (
    as_bool,
    host_layout,
    orchestrator_layout,
    record_command,
    rpc_endpoints,
    rpc_instances,
    service_user,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", True), ("False", False), ("yes", True), ("off", False),
     ("1", True), (0, False), ("", False)],
)
def test_as_bool_reads_ini_strings_like_ansible(value, expected):
    assert as_bool(value) is expected


def test_as_bool_refuses_other_words():
    with pytest.raises(UserError, match=r"lab3: rpc_server_unit_per_device='maybe' is not a boolean"):
        as_bool("maybe", "lab3", "rpc_server_unit_per_device")


@pytest.mark.parametrize(
    ("vars_", "expected"),
    [
        ({}, [(constants.RPC_SERVER_UNIT, constants.RPC_SERVER_PORT, ())]),
        ({"rpc_server_devices": ["CUDA0", "CUDA1"], "rpc_server_port": 50100},
         [(constants.RPC_SERVER_UNIT, 50100, ("CUDA0", "CUDA1"))]),
        ({"rpc_server_devices": ["CUDA0", "Vulkan1"], "rpc_server_unit_per_device": "true"},
         [("llamafleet-rpc-server-cuda0.service", constants.RPC_SERVER_PORT, ("CUDA0",)),
          ("llamafleet-rpc-server-vulkan1.service", constants.RPC_SERVER_PORT + 1, ("Vulkan1",))]),
    ],
)
def test_rpc_instances(vars_, expected):
    got = rpc_instances(Host("w", "10.0.0.2", vars=vars_))
    assert [(i.unit, i.port, i.devices) for i in got] == expected


@pytest.mark.parametrize(
    ("vars_", "message"),
    [({"rpc_server_unit_per_device": True}, "rpc_server_unit_per_device needs rpc_server_devices"),
     ({"rpc_server_devices": "CUDA0"}, "rpc_server_devices must be a list"),
     ({"rpc_server_port": "http"}, "rpc_server_port must be a number")],
)
def test_settings_the_role_would_refuse_name_the_host_and_variable(vars_, message):
    with pytest.raises(UserError, match=f"^w: {message}"):
        rpc_instances(Host("w", "10.0.0.2", vars=vars_))


def test_rpc_endpoints_use_the_bind_address_or_the_cluster_address():
    per_device = {"rpc_server_devices": ["CUDA0", "CUDA1"], "rpc_server_unit_per_device": True,
                  "rpc_server_port": 50060}
    assert rpc_endpoints(Host("w", "192.168.0.2", vars={"llamafleet_cluster_address": "10.0.0.2", **per_device})) == [
        "10.0.0.2:50060", "10.0.0.2:50061"]
    assert rpc_endpoints(Host("w", "192.168.0.2", vars={"rpc_server_bind_address": "10.9.9.9"})) == [
        f"10.9.9.9:{constants.RPC_SERVER_PORT}"]


def test_layouts_of_the_recorded_lab_inventory(lab_inventory):
    fleet = Fleet.from_inventory_json(lab_inventory)
    orch, lab2, lab3 = (host_layout(fleet, fleet.hosts[n]) for n in ("lab1", "lab2", "lab3"))
    assert (orch.role, orch.units, orch.rpc_cache_dir) == ("orchestrator", (constants.LLAMA_SERVER_UNIT,), None)
    assert orch.build_link == f"{constants.LLAMACPP_ROOT}/current"
    assert (orch.plan_path, orch.api_key_file) == (constants.PLAN_PATH, constants.API_KEY_PATH)
    assert (lab2.role, lab2.units) == ("worker", (constants.RPC_SERVER_UNIT,))
    assert (lab2.plan_path, lab2.api_key_file) == (None, None)  # a worker has neither
    assert lab2.rpc_cache_dir == constants.rpc_cache_dir(constants.RPC_SERVER_HOME)
    # lab3's host_vars: one unit per device, its own home and build root
    assert lab3.units == ("llamafleet-rpc-server-cuda0.service", "llamafleet-rpc-server-cuda1.service")
    assert lab3.rpc_cache_dir == "/srv/rpc/cache/rpc"
    assert lab3.build_link == "/srv/llama.cpp/current"


def test_a_host_in_both_groups_runs_both_servers():
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["solo"]}, constants.GROUP_WORKERS: {"hosts": ["solo"]},
            constants.GROUP_FLEET: {"hosts": ["spare"]}, "_meta": {"hostvars": {}}}
    fleet = Fleet.from_inventory_json(data)
    solo = host_layout(fleet, fleet.hosts["solo"])
    assert solo.role == "orchestrator+worker"
    assert solo.units == (constants.LLAMA_SERVER_UNIT, constants.RPC_SERVER_UNIT)
    spare = host_layout(fleet, fleet.hosts["spare"])
    assert (spare.role, spare.units) == ("-", ())


@pytest.mark.parametrize(
    ("server", "vars_", "expected"),
    [
        ("llama_server", {}, (constants.LLAMA_SERVER_USER, constants.LLAMA_SERVER_HOME)),
        ("rpc_server", {}, (constants.RPC_SERVER_USER, constants.RPC_SERVER_HOME)),
        ("rpc_server", {"rpc_server_user": "rpc", "rpc_server_home": "/srv/rpc"}, ("rpc", "/srv/rpc")),
    ],
)
def test_service_user(server, vars_, expected):
    assert service_user(Host("h", "h", vars=vars_), server) == expected


# The orchestrator's layout, read from its deployment record (one SSH round)

def _two_host_fleet(connector, answer) -> Fleet:
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["lab1"]}, constants.GROUP_WORKERS: {"hosts": ["lab2"]},
            "_meta": {"hostvars": {}}}
    return Fleet.from_inventory_json(data, connector(answer))


def _orchestrator_values(layout) -> tuple:
    return layout.llama_unit, layout.gate_unit, layout.plan_path, layout.api_key_file, layout.recorded


@pytest.mark.parametrize(
    ("llama", "expected"),
    [
        ({"units": ["lf-llama-b.service"], "gate_unit": "lf-gate-b.service", "plan_path": "/srv/lf-b/plan.json",
          "api_key_file": "/srv/lf-b/api.key"},
         ("lf-llama-b.service", "lf-gate-b.service", "/srv/lf-b/plan.json", "/srv/lf-b/api.key", True)),
        # no record (a host deployed before records): the defaults
        (None, (constants.LLAMA_SERVER_UNIT, constants.GATE_UNIT, constants.PLAN_PATH, constants.API_KEY_PATH,
                False)),
        # a section without those keys: the defaults for each one missing
        ({"units": ["lf-llama-b.service"]},
         ("lf-llama-b.service", constants.GATE_UNIT, constants.PLAN_PATH, constants.API_KEY_PATH, True)),
    ],
)
def test_orchestrator_layout_reads_only_the_orchestrators_record(connector, recorded, llama, expected):
    record = None if llama is None else {"schema": constants.DEPLOYMENT_RECORD_SCHEMA,
                                         "sections": {"llama_server": llama}}
    fleet = _two_host_fleet(connector, recorded(record, lambda host, command: (1, "", "not asked")))
    assert _orchestrator_values(orchestrator_layout(fleet)) == expected
    assert fleet.connect.calls == [("lab1", record_command())]


def _unreachable(host, command):
    raise TimeoutError("timed out")


@pytest.mark.parametrize(
    ("answer", "message"),
    [(_unreachable, r"timed out after 10 s \(lab1 port 22\)$"),
     (lambda host, command: (0, '{"schema": 99, "sections": {}}', ""), "written by a newer llamafleet"),
     (lambda host, command: (0, "{not json", ""), "is not JSON"),
     (lambda host, command: (1, "", "cat: Permission denied"), "cat: Permission denied")],
)
def test_orchestrator_layout_errors_name_the_host(connector, answer, message):
    with pytest.raises(UserError, match=f"^lab1: cannot read the deployment record .*{message}"):
        orchestrator_layout(_two_host_fleet(connector, answer))
