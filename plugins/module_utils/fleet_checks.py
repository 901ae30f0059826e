# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Is the inventory one cluster?  Checked in deploy.yml's preflight, before anything changes.

- :func:`fleet_groups_problem`: one orchestrator and at least one worker.
- :func:`endpoint_clash`: no two workers offer the same ``address:port`` (one host listed
  twice under two names would run one rpc-server that llama.cpp counts twice).
- :func:`bind_address_problem`: a service binds an address the host has.

Each returns the error text, or ``""`` when all is well; the playbook asserts on it,
so the message names the inventory groups, hosts and variables to change.

Stdlib only: shared by the Ansible filters (module_utils) and the ``llamafleet``
library (``llamafleet.core.fleet_checks``).
"""

from __future__ import annotations

import ipaddress
from typing import Mapping, Sequence


def fleet_groups_problem(orchestrators: Sequence[str], workers: Sequence[str] | None,
                         orchestrator_group: str, workers_group: str) -> str:
    """Why these groups are not one cluster (exactly one orchestrator, one worker or more), or ``""``.

    :param orchestrators: the hosts of ``orchestrator_group`` (after the election).
    :param workers: the hosts of ``workers_group``; None when the inventory has no such group.
    """
    if len(orchestrators) > 1:
        return ("the inventory group %s has %d hosts (%s): llama-server runs on exactly one orchestrator; keep one "
                "of them in %s (or leave it empty to elect one)"
                % (orchestrator_group, len(orchestrators), ", ".join(sorted(orchestrators)), orchestrator_group))
    if not workers:
        return ("the inventory group %s is %s: the model's layers live on rpc-server workers; put at least one host "
                "in %s" % (workers_group, "missing" if workers is None else "empty", workers_group))
    return ""


def endpoint_clash(endpoints: Mapping[str, Sequence[str]]) -> str:
    """``{host: ["address:port", ...]}`` -> an error naming every endpoint two hosts share, or ``""``.

    Two inventory names for one machine (same address and port) would give llama.cpp one
    rpc-server twice and the planner devices that do not exist. Endpoints on 0.0.0.0 or ``::``
    (every interface) name no machine and are left out.
    """
    hosts_of: dict[str, list[str]] = {}
    for host, offered in sorted(endpoints.items()):
        for endpoint in dict.fromkeys(str(e) for e in offered):
            if endpoint.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::"):
                continue
            hosts_of.setdefault(endpoint, []).append(host)
    shared = ["%s on %s" % (endpoint, " and ".join(hosts)) for endpoint, hosts in sorted(hosts_of.items())
              if len(hosts) > 1]
    if not shared:
        return ""
    return ("two inventory hosts offer the same rpc-server endpoint (%s): one machine listed twice, or a copied "
            "llamafleet_cluster_address / rpc_server_port; give each worker its own address or port, or remove "
            "the duplicate host" % "; ".join(shared))


def bind_address_problem(address: str, variable: str, host_addresses: Sequence[str], any_address_ok: bool = True,
                         any_address_variable: str = "", loopback_ok: bool = False) -> str:
    """Why a service cannot bind ``address`` on a host with ``host_addresses``, or ``""``.

    :param variable: the role variable that set it, named in the message.
    :param host_addresses: the host's addresses (Ansible's ``all_ipv4_addresses`` and
        ``all_ipv6_addresses``, which leave loopback out).
    :param any_address_ok: 0.0.0.0 / :: (every interface) is allowed; when it is not and
        ``any_address_variable`` is given, the message says to set that variable to allow it.
    :param loopback_ok: 127.0.0.0/8, ::1 and ``localhost`` are allowed.
    """
    text = str(address).strip()
    if loopback_ok and text == "localhost":
        return ""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return "%s=%r is not an IP address: give one of this host's addresses (%s)" % (
            variable, text, ", ".join(host_addresses) or "none known")
    if ip.is_unspecified:
        if any_address_ok:
            return ""
        return "%s=%s listens on every interface%s" % (
            variable, text, ": set %s=true to allow it" % any_address_variable if any_address_variable else "")
    if ip.is_loopback and loopback_ok:
        return ""
    mine = set()
    for known in host_addresses:
        try:
            mine.add(ipaddress.ip_address(str(known).split("%", maxsplit=1)[0]))
        except ValueError:
            continue
    if ip in mine:
        return ""
    return ("%s=%s is not an address of this host (its addresses: %s): set llamafleet_cluster_address (or %s) to "
            "one of them" % (variable, text, ", ".join(host_addresses) or "none", variable))
