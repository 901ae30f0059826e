"""A fleet read from an Ansible inventory, driven over SSH with fabric.

The inventory is the single description of the fleet: ``ansible-inventory``
resolves it (groups, host and group vars) and this module only reads the
result, so the CLI sees exactly the hosts and addresses the playbooks see.

Commands run on every host at once; results and errors are collected per host
(like fabric's ``GroupResult``) instead of stopping at the first unreachable host.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core import constants
from .errors import UserError

# The most SSH sessions open at once.
MAX_PARALLEL = 16


@dataclass
class Host:
    name: str
    address: str
    user: str = "root"
    port: int = 22
    key_file: str | None = None
    known_hosts: str | None = None
    vars: dict[str, Any] = field(default_factory=dict)

    @property
    def cluster_address(self) -> str:
        return str(self.var("llamafleet_cluster_address", self.address))

    def var(self, name: str, default: Any = None) -> Any:
        """The inventory value of ``name``, or ``default`` (the role default) when unset or empty.

        ``ansible-inventory`` does not template values, so a Jinja expression cannot be used as is.
        """
        value = self.vars.get(name)
        if value is None or value == "":
            return default
        if isinstance(value, str) and "{{" in value:
            raise UserError(f"{self.name}: {name} is a Jinja expression ({value!r}); the CLI reads inventory values "
                            "as written: set it to a literal value in the inventory")
        return value


@dataclass
class RunResult:
    host: str
    ok: bool
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    error: str | None = None

    @property
    def reason(self) -> str:
        """Why the command failed, in a few words: the connection error or the end of stderr."""
        return self.error or self.stderr.strip()[-300:] or f"exit status {self.exit_code}"


class GroupResult(dict):
    """``{host name: RunResult}`` of one command on several hosts."""

    @property
    def failed(self) -> dict[str, RunResult]:
        return {name: res for name, res in self.items() if not res.ok}

    @property
    def succeeded(self) -> dict[str, RunResult]:
        return {name: res for name, res in self.items() if res.ok}


# ``connect(host, timeout)``: a context manager whose ``run(command, hide, warn, timeout, in_stream)``
# returns an object with ``exited``, ``stdout`` and ``stderr`` (a fabric Connection, or a test double).
Connect = Callable[[Host, float], Any]
Command = str | Callable[[Host], str]


def tool(name: str) -> str:
    """The path of a program of this Python environment (ansible-*), or the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise UserError(f"{name} not found: run inside the project's virtual environment (make venv)")
    return found


def _ssh_option(args: str, option: str) -> str | None:
    words = shlex.split(args or "")
    for i, word in enumerate(words):
        value = None
        if word == "-o" and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith("-o"):
            value = word[2:]
        if value and value.split("=", 1)[0].strip().lower() == option.lower() and "=" in value:
            return value.split("=", 1)[1].strip()
    return None


def group_members(data: dict[str, Any], group: str, seen: set[str] | None = None) -> list[str]:
    """Hosts of ``group`` in ``ansible-inventory --list`` output, its children's included, in order."""
    seen = set() if seen is None else seen
    if group in seen:
        return []
    seen.add(group)
    entry = data.get(group, {})
    out = list(entry.get("hosts", []))
    for child in entry.get("children", []):
        out.extend(h for h in group_members(data, child, seen) if h not in out)
    return out


def host_from_vars(name: str, hostvars: dict[str, Any]) -> Host:
    """A Host from its inventory variables (connection settings as Ansible reads them)."""
    ssh_args = " ".join(str(hostvars.get(k, "")) for k in ("ansible_ssh_common_args", "ansible_ssh_extra_args"))
    return Host(
        name=name,
        address=str(hostvars.get("ansible_host", name)),
        user=str(hostvars.get("ansible_user", "root")),
        port=int(hostvars.get("ansible_port", 22)),
        key_file=hostvars.get("ansible_ssh_private_key_file"),
        known_hosts=_ssh_option(ssh_args, "UserKnownHostsFile"),
        vars=hostvars,
    )


def fabric_connection(host: Host, timeout: float = 10.0) -> Any:
    """A fabric Connection that pins host keys when the inventory names a known_hosts file."""
    from fabric import Connection  # imported late: the CLI's --help must not need it
    from paramiko import RejectPolicy

    connect_kwargs: dict[str, Any] = {"timeout": timeout, "banner_timeout": timeout}
    if host.key_file:
        connect_kwargs["key_filename"] = str(host.key_file)
    conn = Connection(host.address, user=host.user, port=host.port, connect_kwargs=connect_kwargs)
    if host.known_hosts:
        conn.client.load_host_keys(host.known_hosts)
        conn.client.set_missing_host_key_policy(RejectPolicy())
    return conn


class Fleet:
    """The hosts of an inventory, their groups, and SSH access to them."""

    def __init__(self, hosts: dict[str, Host], groups: dict[str, list[str]], connect: Connect = fabric_connection):
        self.hosts = hosts
        self.groups = groups
        self.connect = connect

    @classmethod
    def from_inventory(cls, inventory: str | Path) -> Fleet:
        if not Path(inventory).exists():
            raise UserError(f"inventory {inventory} does not exist (for the lab: llamafleet lab up)")
        proc = subprocess.run([tool("ansible-inventory"), "-i", str(inventory), "--list"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise UserError(f"ansible-inventory could not read {inventory}: {proc.stderr.strip()}")
        return cls.from_inventory_json(json.loads(proc.stdout))

    @classmethod
    def from_inventory_json(cls, data: dict[str, Any], connect: Connect = fabric_connection) -> Fleet:
        """The fleet of ``ansible-inventory --list`` output."""
        hostvars = data.get("_meta", {}).get("hostvars", {})
        groups = {group: group_members(data, group) for group in data if group != "_meta"}
        names = dict.fromkeys([*hostvars, *(h for members in groups.values() for h in members)])
        hosts = {name: host_from_vars(name, hostvars.get(name, {})) for name in names}
        return cls(hosts, groups, connect)

    def group(self, name: str) -> list[Host]:
        return [self.hosts[h] for h in self.groups.get(name, []) if h in self.hosts]

    def in_group(self, host: Host, name: str) -> bool:
        return host.name in self.groups.get(name, [])

    @property
    def orchestrator(self) -> Host:
        found = self.group(constants.GROUP_ORCHESTRATOR)
        if not found:
            raise UserError(f"the inventory has no host in group {constants.GROUP_ORCHESTRATOR} "
                            "(deploy.yml elects one; pin it in the inventory to use the CLI)")
        return found[0]

    @property
    def workers_group(self) -> str:
        """The group whose rpc-servers the orchestrator uses (its ``llama_server_workers_group``)."""
        orchestrators = self.group(constants.GROUP_ORCHESTRATOR)
        if not orchestrators:
            return constants.GROUP_WORKERS
        return str(orchestrators[0].var("llama_server_workers_group", constants.GROUP_WORKERS))

    @property
    def workers(self) -> list[Host]:
        return self.group(self.workers_group)

    def is_orchestrator(self, host: Host) -> bool:
        return self.in_group(host, constants.GROUP_ORCHESTRATOR)

    def is_worker(self, host: Host) -> bool:
        return self.in_group(host, self.workers_group)

    def members(self) -> list[Host]:
        """Every host that deploy.yml manages (group ``llamafleet``, orchestrator, workers), by name."""
        names = {h.name for g in (constants.GROUP_FLEET, constants.GROUP_ORCHESTRATOR, self.workers_group)
                 for h in self.group(g)}
        return [self.hosts[n] for n in sorted(names)]

    def run(self, command: Command, hosts: Iterable[Host] | None = None, timeout: float = 60.0) -> GroupResult:
        """Run ``command`` on every host in parallel; one RunResult per host, failures included.

        ``command`` is a shell command line, or a function that writes the one for a host.
        """
        targets = list(hosts) if hosts is not None else list(self.hosts.values())

        def one(host: Host) -> RunResult:
            try:
                line = command(host) if callable(command) else command
                with self.connect(host, 10.0) as conn:
                    res = conn.run(line, hide=True, warn=True, timeout=timeout, in_stream=False)
                return RunResult(host.name, res.exited == 0, res.stdout, res.stderr, res.exited)
            except Exception as exc:  # noqa: BLE001 - every failure is reported per host
                return RunResult(host.name, False, error=f"{type(exc).__name__}: {exc}")

        if not targets:
            return GroupResult()
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(targets))) as pool:
            return GroupResult((r.host, r) for r in pool.map(one, targets))

    def run_one(self, command: str, host: Host, timeout: float = 60.0, what: str = "") -> str:
        """stdout of ``command`` on one host; a UserError naming the host (and ``what``) when it fails."""
        res = self.run(command, [host], timeout=timeout)[host.name]
        if not res.ok:
            raise UserError(f"{host.name}: {what or command}: {res.reason}")
        return res.stdout
