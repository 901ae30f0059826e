"""A fleet read from an Ansible inventory, driven over SSH with fabric.

The inventory is the single description of the fleet: ``ansible-inventory``
resolves it (groups, host and group vars) and this module only reads the
result, so the CLI sees exactly the hosts and addresses the playbooks see.

Errors are collected per host (like fabric's ``GroupResult``) instead of
stopping at the first unreachable host.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError

ORCHESTRATOR_GROUP = "llamafleet_orchestrator"
WORKERS_GROUP = "llamafleet_workers"


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
        return str(self.vars.get("llamafleet_cluster_address") or self.address)


@dataclass
class RunResult:
    host: str
    ok: bool
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    error: str | None = None


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


class Fleet:
    """The hosts of an inventory, their groups, and SSH access to them."""

    def __init__(self, hosts: dict[str, Host], groups: dict[str, list[str]]):
        self.hosts = hosts
        self.groups = groups

    @classmethod
    def from_inventory(cls, inventory: str | Path) -> Fleet:
        exe = shutil.which("ansible-inventory")
        if not exe:
            raise UserError("ansible-inventory not found: run inside the project's virtual environment (make venv)")
        if not Path(inventory).exists():
            raise UserError(f"inventory {inventory} does not exist (for the lab: llamafleet lab up)")
        proc = subprocess.run([exe, "-i", str(inventory), "--list"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise UserError(f"ansible-inventory could not read {inventory}: {proc.stderr.strip()}")
        return cls.from_inventory_json(json.loads(proc.stdout))

    @classmethod
    def from_inventory_json(cls, data: dict[str, Any]) -> Fleet:
        hostvars = data.get("_meta", {}).get("hostvars", {})
        groups: dict[str, list[str]] = {}

        def members(group: str, seen: set[str]) -> list[str]:
            if group in seen:
                return []
            seen.add(group)
            entry = data.get(group, {})
            out = list(entry.get("hosts", []))
            for child in entry.get("children", []):
                out.extend(h for h in members(child, seen) if h not in out)
            return out

        for group in data:
            if group != "_meta":
                groups[group] = members(group, set())
        hosts = {}
        for name, hv in hostvars.items():
            ssh_args = " ".join(str(hv.get(k, "")) for k in ("ansible_ssh_common_args", "ansible_ssh_extra_args"))
            hosts[name] = Host(
                name=name,
                address=str(hv.get("ansible_host", name)),
                user=str(hv.get("ansible_user", "root")),
                port=int(hv.get("ansible_port", 22)),
                key_file=hv.get("ansible_ssh_private_key_file"),
                known_hosts=_ssh_option(ssh_args, "UserKnownHostsFile"),
                vars=hv,
            )
        return cls(hosts, groups)

    def group(self, name: str) -> list[Host]:
        return [self.hosts[h] for h in self.groups.get(name, []) if h in self.hosts]

    @property
    def orchestrator(self) -> Host:
        found = self.group(ORCHESTRATOR_GROUP)
        if not found:
            raise UserError(f"the inventory has no host in group {ORCHESTRATOR_GROUP}")
        return found[0]

    @property
    def workers(self) -> list[Host]:
        return self.group(WORKERS_GROUP)

    def connection(self, host: Host, timeout: float = 10.0):
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

    def run(self, command: str, hosts: list[Host] | None = None, timeout: float = 60.0) -> dict[str, RunResult]:
        """Run ``command`` on every host in parallel; one RunResult per host, failures included."""
        targets = hosts if hosts is not None else list(self.hosts.values())

        def one(host: Host) -> RunResult:
            try:
                with self.connection(host) as conn:
                    res = conn.run(command, hide=True, warn=True, timeout=timeout, in_stream=False)
                return RunResult(host.name, res.exited == 0, res.stdout, res.stderr, res.exited)
            except Exception as exc:  # noqa: BLE001 - every failure is reported per host
                return RunResult(host.name, False, error=f"{type(exc).__name__}: {exc}")

        if not targets:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            return {r.host: r for r in pool.map(one, targets)}
