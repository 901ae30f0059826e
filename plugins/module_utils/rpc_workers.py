# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The rpc-server instances of a worker and the endpoints it offers the orchestrator.

A worker runs one rpc-server serving its devices, or (``rpc_server_unit_per_device``)
one per device, each on its own port (``port + i`` for the i-th device) and in its own
systemd unit.  The ``rpc_server`` role plans the instances with
:func:`rpc_server_instances` and publishes :func:`rpc_server_endpoints` as the fact
``rpc_server_endpoints``, which the ``llama_server`` role hands to the split planner.
Stdlib only (``llamafleet.core.rpc_workers``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .constants import rpc_server_unit


class WorkerError(ValueError):
    """Settings that give no valid set of instances; the message names the variable."""


def rpc_server_instances(devices: Sequence[str], port: int, per_device: bool = False) -> list[dict[str, Any]]:
    """``[{unit, devices, port}]``: the rpc-server units of a worker.

    :param devices: devices to serve (ggml names such as ``CUDA0``); empty serves every GPU, or the CPU.
    :param port: the port of the first (or only) instance.
    :param per_device: one instance per device, on consecutive ports.
    """
    if isinstance(devices, (str, bytes)) or not all(isinstance(d, str) and d for d in devices):
        raise WorkerError("rpc_server_devices must be a list of device names such as [CUDA0, CUDA1], got %r"
                          % (devices,))
    if isinstance(port, bool) or not isinstance(port, int):
        raise WorkerError("rpc_server_port must be a number, got %r" % (port,))
    last = port + (len(devices) - 1 if per_device and devices else 0)
    if port < 1 or last > 65535:
        raise WorkerError("rpc_server_port %d gives ports %d-%d, outside 1-65535" % (port, port, last))
    if not per_device:
        return [{"unit": rpc_server_unit(), "devices": list(devices), "port": port}]
    if not devices:
        raise WorkerError("rpc_server_unit_per_device needs rpc_server_devices, one unit per listed device")
    if len({d.lower() for d in devices}) != len(devices):
        raise WorkerError("rpc_server_devices lists a device twice: %s" % ", ".join(devices))
    return [{"unit": rpc_server_unit(dev), "devices": [dev], "port": port + i} for i, dev in enumerate(devices)]


def rpc_server_endpoints(instances: Sequence[Mapping[str, Any]], rpc_devices: Sequence[Mapping[str, Any]],
                         host: str, address: str) -> list[dict[str, Any]]:
    """``[{host, address, port, unit, devices}]``: what each instance offers the orchestrator.

    :param instances: from :func:`rpc_server_instances`.
    :param rpc_devices: the worker's devices as its rpc-server reports them (``gpu_facts``'
        ``rpc_devices``: dicts with ``ggml_name`` and memory); an instance gets the ones it
        serves, in the order the worker reports them, or all of them when it serves no list.
    :param host: the worker's inventory name; ``address``: the address its rpc-servers bind.
    """
    endpoints = []
    for instance in instances:
        wanted = instance.get("devices") or []
        devices = [d for d in rpc_devices if not wanted or d.get("ggml_name") in wanted]
        endpoints.append({"host": host, "address": address, "port": int(instance["port"]),
                          "unit": instance["unit"], "devices": devices})
    return endpoints
