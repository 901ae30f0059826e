# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Thin Jinja filters over module_utils (errors become AnsibleFilterError).

- ``elect_orchestrator``: ``[{host, devices}]`` or ``{host: devices}`` -> the host with the most GPU memory.
- ``rpc_server_instances``: a worker's devices and port -> its rpc-server units ``[{unit, devices, port}]``.
- ``rpc_server_endpoints``: those units and the worker's devices -> the endpoints the orchestrator plans with.
- ``llamacpp_build_identity``: build settings and host facts -> ``{id, label, cmake, source}``.
- ``llamacpp_cluster_source_mismatch``: ``{host: source}`` -> an error naming the hosts of each source, or ``""``.
- ``rpc_server_instances_problem``: the same arguments as ``rpc_server_instances`` -> why they plan no units, or ``""``.
- ``fleet_groups_problem``, ``rpc_endpoint_clash``, ``bind_address_problem``: the inventory's shape, endpoints
  two hosts share, an address the host does not have -> the error, or ``""`` (module_utils/fleet_checks.py).

- ``gate_ping_group_range``: the current ``net.ipv4.ping_group_range`` and the gate's group id -> ``{value, note}``.

(``rpc_server_argv`` and ``rpc_server_unit`` live in unit_argv.py.)
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.llamafleet.cluster.plugins.module_utils.fleet_checks import (
    bind_address_problem,
    endpoint_clash,
    fleet_groups_problem,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.llamacpp_build import (
    BuildSettingsError,
    build_identity,
    cluster_source_mismatch,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.rpc_workers import (
    WorkerError,
    rpc_server_endpoints,
    rpc_server_instances,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.deploy_stamp import sync_report
from ansible_collections.llamafleet.cluster.plugins.module_utils.host_observation import ping_group_range
from ansible_collections.llamafleet.cluster.plugins.module_utils.split_plan import PlanError, elect_orchestrator


def llamafleet_gate_ping_group_range(current, gid):
    """``{value, note}``: the ping_group_range that lets the gate's group ``gid`` ping (``value`` "" when it is to
    stay as it is), see host_observation.ping_group_range."""
    try:
        value, note = ping_group_range(str(current), int(gid))
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError("gate_ping_group_range: %s" % exc) from exc
    return {"value": value or "", "note": note}


def llamafleet_elect_orchestrator(hosts, pinned=None):
    """``[{host, devices}]`` or ``{host: devices}`` -> the host with the most GPU memory (ties: by name)."""
    try:
        return elect_orchestrator(hosts, pinned=pinned or None)
    except (PlanError, AttributeError, TypeError) as exc:
        raise AnsibleFilterError("elect_orchestrator: %s" % exc) from exc


def llamafleet_rpc_server_instances(devices, port, per_device=False):
    """A worker's rpc-server units: ``[{unit, devices, port}]`` (see module_utils/rpc_workers.py)."""
    try:
        return rpc_server_instances([] if devices is None else devices, port, per_device=per_device)
    except (WorkerError, TypeError) as exc:
        raise AnsibleFilterError("rpc_server_instances: %s" % exc) from exc


def llamafleet_rpc_server_instances_problem(devices, port, per_device=False):
    """Why ``rpc_server_instances`` refuses these settings (the message names the variable), or ``""``."""
    try:
        rpc_server_instances([] if devices is None else devices, port, per_device=per_device)
    except (WorkerError, TypeError) as exc:
        return str(exc)
    return ""


def llamafleet_fleet_groups_problem(orchestrators, workers, orchestrator_group, workers_group):
    """Not exactly one orchestrator, or no worker (``workers`` None: no such group) -> the error, or ``""``."""
    return fleet_groups_problem(list(orchestrators or []), None if workers is None else list(workers),
                                orchestrator_group, workers_group)


def llamafleet_rpc_endpoint_clash(endpoints):
    """``{host: ["address:port", ...]}`` -> an error naming the endpoints two hosts share, or ``""``."""
    try:
        return endpoint_clash(dict(endpoints))
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError("rpc_endpoint_clash: %s" % exc) from exc


def llamafleet_bind_address_problem(address, variable, host_addresses, any_address_ok=True, any_address_variable="",
                                    loopback_ok=False):
    """Why a service cannot bind ``address`` on a host with ``host_addresses``, or ``""``."""
    return bind_address_problem(address, variable, list(host_addresses or []), any_address_ok=bool(any_address_ok),
                                any_address_variable=any_address_variable, loopback_ok=bool(loopback_ok))


def llamafleet_rpc_server_endpoints(instances, rpc_devices, host, address):
    """``[{host, address, port, unit, devices}]`` for the orchestrator (see module_utils/rpc_workers.py)."""
    try:
        return rpc_server_endpoints(instances, rpc_devices or [], host=host, address=address)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("rpc_server_endpoints: %s" % exc) from exc


def llamafleet_build_identity(settings, facts, recipe):
    """``{id, label, cmake, source}`` of a llama.cpp build (see module_utils/llamacpp_build.py)."""
    try:
        return build_identity(settings, facts, recipe)
    except (BuildSettingsError, TypeError) as exc:
        raise AnsibleFilterError("llamacpp_build_identity: %s" % exc) from exc


def llamafleet_cluster_source_mismatch(sources):
    """``{host: source}`` -> why the hosts cannot form one cluster, or ``""`` (see module_utils/llamacpp_build.py)."""
    try:
        return cluster_source_mismatch(dict(sources)) or ""
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError("llamacpp_cluster_source_mismatch: %s" % exc) from exc


def llamafleet_stamp_report(hosts, results):
    """What the deploy does after comparing each host with its stamp (module_utils/deploy_stamp.py)."""
    return sync_report(list(hosts), list(results))


class FilterModule:
    """llamafleet filters."""

    def filters(self):
        return {
            "gate_ping_group_range": llamafleet_gate_ping_group_range,
            "elect_orchestrator": llamafleet_elect_orchestrator,
            "rpc_server_instances": llamafleet_rpc_server_instances,
            "rpc_server_instances_problem": llamafleet_rpc_server_instances_problem,
            "fleet_groups_problem": llamafleet_fleet_groups_problem,
            "rpc_endpoint_clash": llamafleet_rpc_endpoint_clash,
            "bind_address_problem": llamafleet_bind_address_problem,
            "rpc_server_endpoints": llamafleet_rpc_server_endpoints,
            "llamacpp_build_identity": llamafleet_build_identity,
            "llamacpp_cluster_source_mismatch": llamafleet_cluster_source_mismatch,
            "stamp_report": llamafleet_stamp_report,
        }
