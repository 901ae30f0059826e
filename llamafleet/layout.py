"""Where a deployment put things on a host: units, ports, users and paths.

Each value comes from the host's deployment record (``/etc/llamafleet/deployment.json``, written
by the roles with the values they used: :mod:`llamafleet.core.deployment_record`) where it has
one; else, for a host deployed before records existed, from the host's inventory variables where
the roles let users change it (``rpc_server_home``, ``llamacpp_build_root``, ``llama_server_port``,
``rpc_server_unit_per_device``, ...) and from ``llamafleet.core.constants`` (the roles' defaults and
the fixed names).  :func:`read_records` reads the records over SSH (:func:`fleet_layouts` and
:func:`orchestrator_layout` through it); the rest is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import shlex
from collections.abc import Iterable
from typing import Any

from .core import constants, deployment_record, rpc_workers
from .errors import UserError
from .fleet import TRUE_WORDS, Fleet, Host

FALSE_WORDS = frozenset({"0", "false", "no", "off", "n", "f", ""})


def as_bool(value: object, host: str = "", name: str = "") -> bool:
    """An inventory value as Ansible's ``bool`` filter reads it (INI inventories give strings)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise UserError(f"{host}: {name}={value!r} is not a boolean (true or false)")


@dataclass(frozen=True)
class RpcInstance:
    """One rpc-server unit on a worker and the port it listens on."""

    unit: str
    port: int
    devices: tuple[str, ...] = ()


def rpc_instances(host: Host) -> list[RpcInstance]:
    """The rpc-server units of a worker, as the rpc_server role plans them (``rpc_workers``)."""
    port = host.var("rpc_server_port", constants.RPC_SERVER_PORT)
    try:
        planned = rpc_workers.rpc_server_instances(
            host.var("rpc_server_devices", []),
            int(port) if str(port).isdigit() else port,
            as_bool(host.var("rpc_server_unit_per_device", False), host.name, "rpc_server_unit_per_device"),
        )
    except rpc_workers.WorkerError as exc:
        raise UserError(f"{host.name}: {exc}") from exc
    return [RpcInstance(i["unit"], i["port"], tuple(i["devices"])) for i in planned]


def rpc_endpoints(host: Host) -> list[str]:
    """``address:port`` of each rpc-server of a worker."""
    address = host.var("rpc_server_bind_address", host.cluster_address)
    return [f"{address}:{inst.port}" for inst in rpc_instances(host)]


def role_name(orchestrator: bool, worker: bool) -> str:
    """``orchestrator``, ``worker``, both joined by ``+``, or ``-`` for a host with neither role."""
    roles = [name for name, on in (("orchestrator", orchestrator), ("worker", worker)) if on]
    return "+".join(roles) or "-"


def inventory_role(fleet: Fleet, host: Host) -> str:
    """``host``'s role as the inventory's groups say (what the status shows when the host cannot be read)."""
    return role_name(fleet.is_orchestrator(host), fleet.is_worker(host))


@dataclass(frozen=True)
class HostLayout:
    """What the roles installed on one host, as far as the CLI needs to know."""

    host: str
    orchestrator: bool
    worker: bool
    build_root: str
    llama_unit: str | None
    rpc_units: tuple[str, ...]
    rpc_cache_dir: str | None
    # The serving gate's state file (orchestrator; see plugins/module_utils/gate_watchdog.py).
    gate_state_path: str | None = None
    # The split plan the deploy wrote and the file holding the API key (orchestrator).
    plan_path: str | None = None
    api_key_file: str | None = None
    gate_unit: str = constants.GATE_UNIT
    guard_unit: str = constants.RPC_GUARD_UNIT
    # Where the gate serves clients, as recorded: (address, port, tls); None when the record does not say.
    endpoint: tuple[str, int, bool] | None = None
    # Whether the values come from the host's deployment record (else from the inventory and the defaults).
    recorded: bool = False

    @property
    def role(self) -> str:
        """``orchestrator``, ``worker``, both joined by ``+``, or ``-`` for a host with neither role."""
        return role_name(self.orchestrator, self.worker)

    @property
    def units(self) -> tuple[str, ...]:
        """The host's server units, llama-server first (their helpers: :attr:`helper_units`)."""
        return ((self.llama_unit,) if self.llama_unit else ()) + self.rpc_units

    @property
    def helper_units(self) -> tuple[str, ...]:
        """The units that watch the servers: the gate on the orchestrator, the rpc-server guard on a worker."""
        return (((self.gate_unit,) if self.orchestrator else ())
                + ((self.guard_unit,) if self.worker else ()))

    @property
    def journal_units(self) -> tuple[str, ...]:
        """Every llamafleet unit of the host whose journal ``logs`` shows: the servers, then their helpers."""
        return self.units + self.helper_units

    @property
    def build_link(self) -> str:
        """The symlink to the build in use."""
        return f"{self.build_root.rstrip('/')}/current"


def host_layout(fleet: Fleet, host: Host, record: dict[str, Any] | None = None) -> HostLayout:
    """The layout of ``host`` from its deployment record where it has one, else from its inventory variables."""
    orchestrator = fleet.is_orchestrator(host)
    worker = fleet.is_worker(host)
    rpc = deployment_record.section(record, "rpc_server") if worker else {}
    llama = deployment_record.section(record, "llama_server") if orchestrator else {}
    home = str(host.var("rpc_server_home", constants.RPC_SERVER_HOME))
    return HostLayout(
        host=host.name,
        orchestrator=orchestrator,
        worker=worker,
        build_root=str(llama.get("build_root") or rpc.get("build_root")
                       or host.var("llamacpp_build_root", constants.LLAMACPP_ROOT)),
        llama_unit=(llama.get("units") or [constants.LLAMA_SERVER_UNIT])[0] if orchestrator else None,
        rpc_units=tuple(rpc.get("units") or (inst.unit for inst in rpc_instances(host))) if worker else (),
        rpc_cache_dir=str(rpc.get("cache_dir") or constants.rpc_cache_dir(home)) if worker else None,
        gate_state_path=str(llama.get("gate_state_path") or constants.GATE_STATE_PATH) if orchestrator else None,
        plan_path=str(llama.get("plan_path") or constants.PLAN_PATH) if orchestrator else None,
        api_key_file=str(llama.get("api_key_file") or constants.API_KEY_PATH) if orchestrator else None,
        gate_unit=str(llama.get("gate_unit") or constants.GATE_UNIT),
        guard_unit=str(rpc.get("guard_unit") or constants.RPC_GUARD_UNIT),
        endpoint=recorded_endpoint(llama),
        recorded=bool(rpc or llama),
    )


def recorded_endpoint(llama: dict[str, Any]) -> tuple[str, int, bool] | None:
    """(address, port, tls) of the gate from the record's llama_server section; None when it does not say."""
    if not (llama.get("api_endpoint") and llama.get("port")):
        return None
    return str(llama["bind_address"]), int(llama["port"]), str(llama["api_endpoint"]).startswith("https://")


def record_command() -> str:
    """Prints the host's deployment record (nothing when it has none)."""
    path = shlex.quote(constants.DEPLOYMENT_RECORD_PATH)
    return f"if [ -e {path} ]; then cat {path}; fi"


def read_records(fleet: Fleet, hosts: Iterable[Host]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``(records, errors)``: each host's deployment record (``{}`` when it has none), or why it could not
    be read or used (unreachable, not JSON, written by a newer llamafleet)."""
    records: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for name, res in fleet.run(record_command(), list(hosts), timeout=30.0).items():
        if not res.ok:
            errors[name] = res.reason
            continue
        try:
            records[name] = deployment_record.parse(res.stdout, f"{name}:{constants.DEPLOYMENT_RECORD_PATH}")
        except deployment_record.RecordError as exc:
            errors[name] = str(exc)
    return records, errors


def fleet_layouts(fleet: Fleet, hosts: Iterable[Host]) -> tuple[dict[str, HostLayout], dict[str, dict[str, Any]],
                                                                 dict[str, str]]:
    """``(layouts, records, errors)`` of ``hosts``: their records read over SSH, then each layout."""
    hosts = list(hosts)
    records, errors = read_records(fleet, hosts)
    layouts: dict[str, HostLayout] = {}
    for host in hosts:
        if host.name in errors:
            continue
        try:
            layouts[host.name] = host_layout(fleet, host, records.get(host.name))
        except UserError as exc:
            errors[host.name] = str(exc)
    return layouts, records, errors


def orchestrator_layout(fleet: Fleet) -> HostLayout:
    """The orchestrator's layout from its deployment record alone (one SSH round; a host without a record
    gets the inventory's values and the defaults); a UserError naming the host when the record cannot be
    read or used (unreachable, not JSON, written by a newer llamafleet)."""
    orch = fleet.orchestrator
    records, errors = read_records(fleet, [orch])
    if orch.name in errors:
        raise UserError(f"{orch.name}: cannot read the deployment record {constants.DEPLOYMENT_RECORD_PATH}: "
                        f"{errors[orch.name]}")
    return host_layout(fleet, orch, records[orch.name])


def service_user(host: Host, server: str) -> tuple[str, str]:
    """(user, home) of ``server`` (``llama_server`` or ``rpc_server``) on ``host``."""
    defaults = {
        "llama_server": (constants.LLAMA_SERVER_USER, constants.LLAMA_SERVER_HOME),
        "rpc_server": (constants.RPC_SERVER_USER, constants.RPC_SERVER_HOME),
    }[server]
    return str(host.var(f"{server}_user", defaults[0])), str(host.var(f"{server}_home", defaults[1]))
