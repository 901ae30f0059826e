# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters that render rpc-server's argv, the units of rpc-server and the gate, and the hardening of the units
templates render (thin wrappers over module_utils)."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.llamafleet.cluster.plugins.module_utils.llama_flags import FlagError, render_rpc_server_argv
from ansible_collections.llamafleet.cluster.plugins.module_utils.systemd_unit import (
    device_policy,
    hardening,
    render_gate_unit,
    render_plan_switch_units,
    render_rpc_guard_unit,
    render_rpc_server_unit,
)


def rpc_server_argv(llamacpp, host, port, threads=0, devices=None, cache=True):
    """argv of rpc-server for the build described by the ``llamacpp_build_info`` fact."""
    try:
        binary = "%s/%s" % (llamacpp["bin_dir"], llamacpp["rpc_server"])
        features = (llamacpp.get("features") or {}).get("rpc_server") or {}
        return render_rpc_server_argv(
            binary,
            features,
            host=host,
            port=int(port),
            threads=int(threads) if threads and int(threads) > 0 else None,
            devices=list(devices or []),
            cache=bool(cache),
        )
    except (FlagError, KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("rpc_server_argv: %s" % exc) from exc


def rpc_server_unit(argv, llamacpp, port, user, home, firewall=True, header="", environment=None, memory_max_mib=0):
    """The systemd unit text of one rpc-server running ``argv`` (from ``rpc_server_argv``) of the
    ``llamacpp_build_info`` build, with that build's backend's device policy, ``environment`` and, when
    ``memory_max_mib`` is not 0, that memory limit."""
    try:
        return render_rpc_server_unit([str(a) for a in argv], backend=llamacpp["backend"], port=int(port),
                                      user=str(user), home=str(home), build_id=llamacpp.get("build_id"),
                                      firewall=bool(firewall), header=str(header),
                                      environment={str(k): str(v) for k, v in (environment or {}).items()},
                                      memory_max_mib=int(memory_max_mib or 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("rpc_server_unit: %s" % exc) from exc


def gate_unit(user, header=""):
    """The systemd unit text of the orchestrator's serving gate, run as ``user`` (llama-server's user)."""
    try:
        return render_gate_unit(user=str(user), header=str(header))
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError("gate_unit: %s" % exc) from exc


def rpc_guard_unit(instances, user, stale, header=""):
    """The systemd unit text of a worker's rpc-server guard, for the ``rpc_server_instances`` of the host."""
    try:
        servers = {int(item["port"]): str(item["unit"]) for item in instances}
        return render_rpc_guard_unit(servers, stale=int(stale), user=str(user), header=str(header))
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("rpc_guard_unit: %s" % exc) from exc


def plan_switch_units(header=""):
    """The units of degraded mode's plan switch: ``{service, path}`` texts (root service, and the path unit
    that starts it when the serving gate writes its request)."""
    try:
        service, path = render_plan_switch_units(header=str(header))
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError("plan_switch_units: %s" % exc) from exc
    return {"service": service, "path": path}


def unit_hardening(values=None, after=None, backend=None):
    """The collection's one hardening list (systemd_unit.HARDENING) as ``[Service]`` lines, one string, with a
    unit's differences: ``values`` ({setting: value, or None to leave it out}), ``after`` ({setting: [lines]}
    added after it) and ``backend``'s device policy after PrivateTmp=."""
    try:
        extra = {str(k): [str(line) for line in v] for k, v in (after or {}).items()}
        if backend is not None:
            extra["PrivateTmp"] = device_policy(str(backend)) + extra.get("PrivateTmp", [])
        return "\n".join(hardening({str(k): None if v is None else str(v) for k, v in (values or {}).items()},
                                   after=extra))
    except (AttributeError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("unit_hardening: %s" % exc) from exc


class FilterModule:
    """llamafleet argv and unit filters."""

    def filters(self):
        return {"rpc_server_argv": rpc_server_argv, "rpc_server_unit": rpc_server_unit, "gate_unit": gate_unit,
                "rpc_guard_unit": rpc_guard_unit, "plan_switch_units": plan_switch_units,
                "unit_hardening": unit_hardening}
