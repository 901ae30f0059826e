"""A mixed-backend fleet for real: lab3 becomes a Vulkan worker (Debian 13, Mesa's lavapipe) beside the CPU hosts.

Runs first (tests/e2e/conftest.ORDER): ``lab up --vulkan lab3`` boots lab3 again from the Debian 13
image, and deploy.yml takes the fleet from there. Two build groups compile (or take the controller's cached
artifact): the CPU build of lab1 and lab2 (Debian 12) and the Vulkan build of lab3 (Debian 13). On a machine with
an empty cache the two compiles run side by side (about 16 minutes on 2 cores, against 10 + 13 one after the other),
and the other modules find the CPU build cached. Their ``deployed`` fixture sets the lab back to Debian 12 CPU hosts
(``lab up --hosts 3``). Then, from the real parts:

- lab3's rpc-server runs the Vulkan build on the Vulkan device its own ``vulkaninfo`` and rpc-server listing show;
- the planner split the layers over the CPU worker and the Vulkan worker, and llama.cpp's own load log puts them
  where the plan said;
- lab3's weight cache was seeded from its own GGUF and a load sends it only the small tensors;
- a completion is served through the mixed cluster.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from llamafleet.cluster import Endpoint, read_plan, server_log
from llamafleet.core.log_parse import buffers_by_device, compare_with_plan, layer_ranges, parse_load_log
from llamafleet.core import constants
from llamafleet.core.rpc_workers import rpc_server_instances
from llamafleet.lab.image import LAVAPIPE_ICD, SECOND_LAVAPIPE_ICD
from llamafleet.lab.paths import LabPaths
from tests.helpers import EVERY_TASK, cli, listeners, playbook

VULKAN_HOST = "lab3"
# The mixed lab's hosts run without the lab's default memory limit (4,096 MiB each): the Vulkan build compiles
# ggml-vulkan's embedded shaders (mul_mm.comp.cpp and the like), and two such compiler jobs in 4 GiB were killed for
# memory on an empty cache (session 30: "c++: fatal error: Killed signal terminated program cc1plus"). The other
# modules' ``deployed`` fixture brings the limit back (``lab up --hosts 3``).
NO_MEMORY_LIMIT = ("--memory-mib", "0")
BUILDINFO = "/opt/llamafleet/llama.cpp/current/BUILDINFO.json"


@pytest.fixture(scope="module")
def mixed(lab):
    started = time.monotonic()
    cli("lab", "up", "--hosts", "3", "--vulkan", VULKAN_HOST, *NO_MEMORY_LIMIT, timeout=1200)
    run = playbook("deploy.yml", timeout=5400)
    assert run.rc == 0, f"deploy.yml on the mixed lab failed:\n{run.output[-8000:]}"
    print(f"mixed lab up and deployed: {time.monotonic() - started:.1f} s")
    return run


@pytest.fixture(scope="module")
def mixed_fleet(mixed):
    from llamafleet.fleet import Fleet
    from tests.helpers import INVENTORY

    return Fleet.from_inventory(INVENTORY)


def _host(fleet, name):
    return fleet.hosts[name]


def test_the_vulkan_host_is_debian_13_with_a_vulkan_device(mixed_fleet):
    out = mixed_fleet.run_one(". /etc/os-release; echo $VERSION_ID; vulkaninfo --summary 2>/dev/null",
                              _host(mixed_fleet, VULKAN_HOST))
    assert out.splitlines()[0] == "13", out
    assert "PHYSICAL_DEVICE_TYPE_CPU" in out and "llvmpipe" in out, out


def test_two_build_groups_two_builds(mixed_fleet):
    infos = {name: json.loads(res.stdout) for name, res in mixed_fleet.run(f"cat {BUILDINFO}").items() if res.ok}
    assert sorted(infos) == ["lab1", "lab2", "lab3"], infos
    assert {name: info["backend"] for name, info in infos.items()} == {"lab1": "cpu", "lab2": "cpu", "lab3": "vulkan"}
    assert infos["lab1"]["build_id"] == infos["lab2"]["build_id"] != infos["lab3"]["build_id"]
    assert infos["lab3"]["builder"] == VULKAN_HOST and infos["lab1"]["builder"] in ("lab1", "lab2")
    # one llama.cpp source everywhere (one RPC protocol)
    assert len({info["rpc_protocol"] for info in infos.values()}) == 1
    # each artifact is cached on the controller for the next fresh lab
    cached = {path.name for path in (LabPaths.default().root / "artifacts").glob("*.tar.gz")}
    for info in infos.values():
        assert any(name.startswith(info["build_id"]) for name in cached), (info["build_id"], cached)


def test_rpc_server_on_the_vulkan_worker_runs_the_vulkan_build(mixed_fleet):
    host = _host(mixed_fleet, VULKAN_HOST)
    unit = mixed_fleet.run_one("systemctl cat llamafleet-rpc-server.service", host)
    assert "GGML_VK_VISIBLE_DEVICES=0" in unit and "PrivateDevices=yes" not in unit, unit
    assert mixed_fleet.run_one("systemctl is-active llamafleet-rpc-server.service", host).strip() == "active"
    log = mixed_fleet.run_one("journalctl -u llamafleet-rpc-server.service -b --no-pager -o cat | tail -n 200", host)
    assert "llvmpipe" in log or "Vulkan0" in log, log[-3000:]


def test_plan_splits_over_the_cpu_and_the_vulkan_worker_as_llama_cpp_loads(mixed_fleet):
    plan = read_plan(mixed_fleet)
    by_host = {d["host"]: d for d in plan["devices"] if not d.get("local")}
    assert by_host["lab2"]["backend"] == "cpu" and by_host[VULKAN_HOST]["backend"] == "vulkan", plan["devices"]
    assert by_host["lab2"]["layers"]["count"] > 0 and by_host[VULKAN_HOST]["layers"]["count"] > 0, plan["explanation"]
    parsed = parse_load_log(server_log(mixed_fleet))
    seen = layer_ranges(parsed)
    for dev in by_host.values():
        assert seen.get(dev["name"]), (dev["name"], dev["host"], parsed)
    assert compare_with_plan(plan, parsed) == [], parsed
    loaded = buffers_by_device(parsed, "model")
    for dev in plan["devices"]:
        assert loaded.get(dev["name"], 0.0) == pytest.approx(dev["weights_mib"], abs=0.1), (dev, loaded)


def _rx_bytes(fleet, host) -> int:
    device = fleet.run_one(f"ip -o route get {fleet.orchestrator.cluster_address}", host).split(" dev ")[1].split()[0]
    return int(fleet.run_one(f"cat /sys/class/net/{device}/statistics/rx_bytes", host))


def test_the_vulkan_worker_loads_the_large_tensors_from_its_cache(mixed_fleet):
    host = _host(mixed_fleet, VULKAN_HOST)
    plan = read_plan(mixed_fleet)
    vulkan = next(d for d in plan["devices"] if d["host"] == VULKAN_HOST)
    # the last RPC device holds the output matrix (gemma ties it to token_embd, 168 MiB: the one tensor over 10 MiB)
    assert vulkan["layers"]["output"], plan["explanation"]
    before = _rx_bytes(mixed_fleet, host)
    mixed_fleet.run_one("systemctl restart llamafleet-llama-server.service", mixed_fleet.orchestrator, timeout=120)
    Endpoint.of(mixed_fleet).wait_healthy(timeout=300)
    sent = _rx_bytes(mixed_fleet, host) - before
    weights = vulkan["weights_mib"] * 2**20
    print(f"bytes sent to the Vulkan worker at load: {sent} of {weights:.0f} planned weight bytes")
    assert 0 < sent < 0.2 * weights, (sent, weights)


def test_the_mixed_cluster_serves(mixed_fleet):
    endpoint = Endpoint.of(mixed_fleet)
    endpoint.wait_healthy(timeout=300)
    # lavapipe computes the output matrix (262144 x 640) on 2 shared cores: seconds a token, so few tokens here
    answer = endpoint.complete("The capital of France is", n_predict=4)
    assert answer["timings"]["predicted_n"] == 4 and answer["content"].strip(), answer
    print(f"mixed lab: {answer['timings']['predicted_per_second']:.2f} tok/s")


def test_a_second_deploy_changes_nothing(mixed):
    run = playbook("deploy.yml", *EVERY_TASK, timeout=1800)
    assert run.rc == 0 and run.changed == 0, run.output[-6000:]


# Two Vulkan devices on lab3: the loader lists lavapipe twice when VK_DRIVER_FILES names two manifests of it.
TWO_DEVICES = ["Vulkan0", "Vulkan1"]


def _two_device_inventory(tmp_path, per_device: bool) -> list[str]:
    path = tmp_path / ("per-device.yml" if per_device else "one-server.yml")
    path.write_text(yaml.safe_dump({"all": {"hosts": {VULKAN_HOST: {
        "rpc_server_environment": {"VK_DRIVER_FILES": f"{LAVAPIPE_ICD}:{SECOND_LAVAPIPE_ICD}",
                                   "GGML_VK_VISIBLE_DEVICES": "0,1"},
        "rpc_server_devices": TWO_DEVICES, "rpc_server_unit_per_device": per_device}}}}))
    return ["-i", str(path)]


def _rpc_units(fleet, host) -> list[str]:
    out = fleet.run_one("systemctl list-units --all --plain --no-legend 'llamafleet-rpc-server*.service'", host)
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


# One unit per Vulkan device is left to make separate-e2e-test (marker separate): on the lab it took 224 to 381 s, lavapipe
# warming up in two rpc-server processes on lab3's two cores; the unit-per-device shape itself is in make test on the
# CPU lab (test_fleet_changes.py: to one rpc-server per device and back).
@pytest.mark.parametrize("per_device", [pytest.param(True, id="unit-per-device", marks=pytest.mark.separate),
                                        pytest.param(False, id="one-server-two-devices")])
def test_two_vulkan_devices_in_either_shape(mixed, mixed_fleet, tmp_path, per_device):
    host = _host(mixed_fleet, VULKAN_HOST)
    run = playbook("deploy.yml", *_two_device_inventory(tmp_path, per_device), timeout=1800)
    assert run.rc == 0, run.output[-8000:]
    instances = rpc_server_instances(TWO_DEVICES, constants.RPC_SERVER_PORT, per_device)
    # exactly the units of this shape: the switch from the other one left none behind
    assert _rpc_units(mixed_fleet, host) == sorted(i["unit"] for i in instances), run.output[-3000:]
    for instance in instances:
        unit = mixed_fleet.run_one(f"systemctl cat {instance['unit']}", host)
        assert f"-d {','.join(instance['devices'])}" in unit.replace("--device", "-d"), unit
    plan = read_plan(mixed_fleet)
    on_vulkan = [d for d in plan["devices"] if d["host"] == VULKAN_HOST]
    assert len(on_vulkan) == 2 and all(d["backend"] == "vulkan" for d in on_vulkan), plan["devices"]
    assert len({d["endpoint"] for d in on_vulkan}) == (2 if per_device else 1), on_vulkan
    parsed = parse_load_log(server_log(mixed_fleet))
    assert compare_with_plan(plan, parsed) == [], parsed
    assert all(layer_ranges(parsed).get(d["name"]) for d in on_vulkan if d["layers"]["count"]), parsed
    answer = Endpoint.of(mixed_fleet).complete("The capital of France is", n_predict=2)
    assert answer["timings"]["predicted_n"] == 2


def test_an_orchestrator_with_a_local_vulkan_device_puts_it_after_the_rpc_devices(mixed):
    """lab1 becomes a Vulkan host too: llama-server uses its own Vulkan0 beside the two workers. llama.cpp orders
    the devices RPC first, then local: the plan's -ts follows that order, and the load log agrees. lab3 is back to
    one rpc-server (the inventory without the two-device variables): no unit of the other shapes is left. The edge
    (on by default) serves the clients' port on this Debian 13 orchestrator: Debian 13's haproxy, installed through
    the lab's package proxy, answers the completion in front of the gate."""
    cli("lab", "up", "--hosts", "3", "--vulkan", "lab1", "--vulkan", VULKAN_HOST, *NO_MEMORY_LIMIT, timeout=1200)
    run = playbook("deploy.yml", timeout=5400)
    assert run.rc == 0, run.output[-8000:]
    from llamafleet.fleet import Fleet
    from tests.helpers import INVENTORY

    fleet = Fleet.from_inventory(INVENTORY)
    assert _rpc_units(fleet, _host(fleet, VULKAN_HOST)) == [constants.RPC_SERVER_UNIT]
    plan = read_plan(fleet)
    names = [d["name"] for d in plan["devices"]]
    assert names == ["RPC0", "RPC1", "Vulkan0"], plan["explanation"]
    local = plan["devices"][-1]
    assert local["local"] and local["host"] == "lab1" and local["backend"] == "vulkan", local
    assert plan["device_names"] == names
    parsed = parse_load_log(server_log(fleet))
    assert compare_with_plan(plan, parsed) == [], parsed
    assert all(layer_ranges(parsed).get(d["name"]) for d in plan["devices"] if d["layers"]["count"]), parsed
    unit = fleet.run_one("systemctl cat llamafleet-llama-server.service", fleet.orchestrator)
    assert "GGML_VK_VISIBLE_DEVICES=0" in unit, unit
    endpoint = Endpoint.of(fleet)
    assert [line.split()[0] for line in listeners(fleet, endpoint.port)] == ["haproxy"]
    haproxy = fleet.run_one("dpkg-query -W -f '${Version}' haproxy; echo; . /etc/os-release; echo $VERSION_ID",
                            fleet.orchestrator).split()
    assert haproxy[-1] == "13", haproxy
    print(f"lab1 (Debian 13) serves through haproxy {haproxy[0]}")
    answer = endpoint.complete("The capital of France is", n_predict=2)
    assert answer["timings"]["predicted_n"] == 2
