# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Thin Jinja filters over the split planner's helpers.

- ``rpc_endpoints``: workers ``[{host, address, port}]`` -> ``["address:port", ...]`` for ``--rpc``.
- ``elect_orchestrator``: ``[{host, devices}]`` or ``{host: devices}`` -> the host with the most GPU memory.
- ``gpu_memory_mib``: a device list -> its total GPU memory in MiB (CPU entries count 0).

(``rpc_server_argv`` and ``systemd_exec`` live in unit_argv.py.)
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.llamafleet.cluster.plugins.module_utils.split_plan import (
    PlanError,
    elect_orchestrator,
    gpu_memory_mib,
)


def rpc_endpoints(workers, default_port=50052):
    """``[{host, address, port}]`` -> ``["address:port", ...]``."""
    if not isinstance(workers, list):
        raise AnsibleFilterError("rpc_endpoints expects a list of workers, got %s" % type(workers).__name__)
    endpoints = []
    for position, worker in enumerate(workers):
        if isinstance(worker, str):
            worker = {"host": worker}
        if not isinstance(worker, dict) or not (worker.get("address") or worker.get("host")):
            raise AnsibleFilterError("rpc_endpoints: workers[%d] needs a host or an address, got %r" % (position, worker))
        port = worker.get("port") or default_port
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise AnsibleFilterError("rpc_endpoints: workers[%d] port %r is not a number" % (position, port))
        endpoints.append("%s:%d" % (worker.get("address") or worker["host"], port))
    return endpoints


def llamafleet_elect_orchestrator(hosts, pinned=None):
    """``[{host, devices}]`` or ``{host: devices}`` -> the host with the most GPU memory (ties: by name)."""
    try:
        return elect_orchestrator(hosts, pinned=pinned or None)
    except (PlanError, AttributeError, TypeError) as exc:
        raise AnsibleFilterError("elect_orchestrator: %s" % exc)


def llamafleet_gpu_memory_mib(devices):
    """Total GPU memory (MiB) of a device list; CPU entries count 0."""
    try:
        return gpu_memory_mib(devices)
    except (AttributeError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("gpu_memory_mib: %s" % exc)


class FilterModule:
    """llamafleet filters."""

    def filters(self):
        return {
            "rpc_endpoints": rpc_endpoints,
            "elect_orchestrator": llamafleet_elect_orchestrator,
            "gpu_memory_mib": llamafleet_gpu_memory_mib,
        }
