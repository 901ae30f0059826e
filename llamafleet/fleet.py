"""A fleet read from an Ansible inventory, driven over SSH with fabric.

The inventory is the single description of the fleet: Ansible's own inventory, variable and
templating API reads it (groups, host and group vars, vault, Jinja), so the CLI sees exactly the
hosts, addresses and values the playbooks see.  A value is templated when it is read, with the
host's inventory variables; one that needs a fact or a vault password the CLI was not given is a
``UserError`` naming the host and the variable.

Commands run on every host at once; results and errors are collected per host
(like fabric's ``GroupResult``) instead of stopping at the first unreachable host.

SSH checks host keys as OpenSSH with the inventory's arguments would, and never adds one:
the known_hosts files are the inventory's ``UserKnownHostsFile`` (from ``ansible_ssh_common_args``
or ``ansible_ssh_extra_args``; several paths, ``~`` and ``%d``/``%u``/``%h``/``%p``/``%r`` expanded)
or, when it names none, ``~/.ssh/known_hosts`` and ``~/.ssh/known_hosts2``, plus
``GlobalKnownHostsFile`` (default ``/etc/ssh/ssh_known_hosts`` and ``ssh_known_hosts2``).  Plain,
hashed (``|1|...``) and ``[host]:port`` entries match; wildcard patterns, ``@cert-authority`` and
``@revoked`` lines are not understood (paramiko skips them).  An unknown or changed key is a
``HostKeyError`` that names the host, the key seen, the files read and what to do.  The inventory's
``StrictHostKeyChecking=no`` is not honoured: only ``LLAMAFLEET_SSH_INSECURE=1`` (or
``fabric_connection(..., insecure=True)``) skips the check, with a warning on stderr per connection.

Each host is reached as ``ansible`` would reach it (:mod:`llamafleet.connection`): the user, port, keys and
jump hosts that Ansible's configuration and the user's ssh config give, or, for ``ansible_connection: local``,
this machine without SSH.  A host that cannot be reached is described in words that name it.

Commands run as the connecting user, or through ``sudo`` when the inventory asks Ansible to
become another user (``ansible_become``, ``ansible_become_user``, ``ansible_become_method=sudo``,
``ansible_become_password`` / ``ansible_become_pass``), as the playbooks' tasks do.
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import connection
from .connection import ConnectError, Hop, LocalConnection, Target, describe_error, local_user, run_error
from .core import constants
from .errors import UserError

# The most SSH sessions open at once.
MAX_PARALLEL = 16

# ``LLAMAFLEET_SSH_INSECURE=1`` accepts any host key (with a warning); the inventory cannot ask for that.
INSECURE_ENV = "LLAMAFLEET_SSH_INSECURE"
# What OpenSSH reads when the ssh arguments name no known_hosts file.
USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
TRUE_WORDS = ("yes", "on", "true", "1", "y", "t")


class HostKeyError(UserError):
    """A host whose SSH host key is not in the known_hosts files, or differs from the one there."""


@dataclass
class Host:
    name: str
    address: str
    user: str = field(default_factory=local_user)
    port: int = 22
    key_file: str | None = None
    # Further keys ssh would try (the ssh config's IdentityFile), jump hosts, a ProxyCommand; see connection.settle.
    more_key_files: tuple[str, ...] = ()
    jumps: tuple[Hop, ...] = ()
    proxy_command: str | None = None
    # ``ansible_connection: local``: commands run on this machine, without SSH.
    local: bool = False
    timeout: float = connection.DEFAULT_TIMEOUT
    # The inventory's UserKnownHostsFile and GlobalKnownHostsFile, as written (unexpanded); empty: ssh's defaults.
    known_hosts: tuple[str, ...] = ()
    global_known_hosts: tuple[str, ...] = ()
    # Whether the ssh arguments say StrictHostKeyChecking=no/off (not honoured; named in the error).
    strict_off: bool = False
    vars: dict[str, Any] = field(default_factory=dict)
    # Templates one of ``vars`` (Jinja and vault) as Ansible would for this host; None: values are used as written.
    resolve: Callable[[str], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def cluster_address(self) -> str:
        return str(self.var("llamafleet_cluster_address", self.address))

    def var(self, name: str, default: Any = None) -> Any:
        """The inventory value of ``name``, templated, or ``default`` (the role default) when unset or empty."""
        if self.vars.get(name) is None:
            return default
        if self.resolve is not None:
            value = self.resolve(name)
        else:
            value = self.vars[name]
            if isinstance(value, str) and ("{{" in value or "{%" in value):
                raise UserError(f"{self.name}: {name} is a Jinja expression ({value!r}) and this fleet was read "
                                "without Ansible's templating: read the inventory with Fleet.from_inventory")
        return default if value is None or value == "" else value


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


_ssh_option = connection.ssh_option


def expand_known_hosts(paths: Iterable[str], host: Host) -> list[Path]:
    """known_hosts paths with ``~`` and ssh's ``%%``, ``%d``, ``%u``, ``%h``, ``%p``, ``%r`` tokens expanded."""
    tokens = {"%": "%", "d": str(Path.home()), "u": getpass.getuser(), "h": host.address, "p": str(host.port),
              "r": host.user}
    out = []
    for path in paths:
        path = re.sub(r"%(.)", lambda m: tokens.get(m.group(1), m.group(0)), path)
        out.append(Path(os.path.expanduser(path)))
    return out


def known_hosts_files(host: Host) -> list[Path]:
    """The known_hosts files ssh reads for ``host``: the inventory's or the user's, then the global ones."""
    return expand_known_hosts([*(host.known_hosts or USER_KNOWN_HOSTS),
                               *(host.global_known_hosts or GLOBAL_KNOWN_HOSTS)], host)


def known_hosts_name(host: Host) -> str:
    """The name of ``host`` in known_hosts: the address, or ``[address]:port`` off port 22."""
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


def _fingerprint(key: Any) -> str:
    return f"{key.get_name()} {key.fingerprint}"


def _files_read(files: Iterable[Path]) -> str:
    return ", ".join(f"{f}" if f.is_file() else f"{f} (missing)" for f in files)


def unknown_key_message(host: Host, key: Any, files: list[Path]) -> str:
    """What to say when ``host`` presents ``key`` and no known_hosts file knows the host."""
    where = f"{host.name} ({host.address} port {host.port})"
    insecure = (f" The inventory's StrictHostKeyChecking=no is not honoured by llamafleet; {INSECURE_ENV}=1 skips "
                "the check (not recommended)." if host.strict_off else "")
    return (f"{where}: unknown SSH host key {_fingerprint(key)}; known_hosts files read: {_files_read(files)}. "
            f"Check the fingerprint with the host's administrator, then either add it to your known_hosts: "
            f"`ssh-keyscan -p {host.port} {host.address} >> ~/.ssh/known_hosts` (or ssh -p {host.port} "
            f"{host.user}@{host.address} once by hand), or pin it in the inventory: "
            f"ansible_ssh_common_args='-o UserKnownHostsFile=/path/to/known_hosts'.{insecure}")


def changed_key_message(host: Host, seen: Any, expected: Any, files: list[Path]) -> str:
    """What to say when ``host`` presents ``seen`` and known_hosts holds ``expected`` for it."""
    return (f"{host.name} ({host.address} port {host.port}): the SSH host key has CHANGED: the host presents "
            f"{_fingerprint(seen)}, known_hosts has {_fingerprint(expected)} (files read: {_files_read(files)}). "
            "Someone may be intercepting the connection, or the host was reinstalled. If the change is expected, "
            f"remove the old entry (`ssh-keygen -R '{known_hosts_name(host)}' -f FILE`) and add the new key "
            f"(`ssh-keyscan -p {host.port} {host.address}`), or pin it in the inventory's UserKnownHostsFile.")


def insecure_requested(insecure: bool | None = None) -> bool:
    """``insecure`` when given, else whether ``LLAMAFLEET_SSH_INSECURE`` is set to a true word."""
    if insecure is not None:
        return insecure
    return os.environ.get(INSECURE_ENV, "").strip().lower() in TRUE_WORDS


def _truthy(value: Any) -> bool:
    """An inventory boolean as Ansible reads it (``true``, ``yes``, ``1``, ``on``...)."""
    return value if isinstance(value, bool) else str(value).strip().lower() in TRUE_WORDS


def become_user(host: Host) -> str | None:
    """The user ``sudo`` runs commands as on ``host``, or None when the inventory asks for no become.

    As in Ansible: ``ansible_become`` turns it on, ``ansible_become_user`` (default root) is the target,
    and connecting as the target user needs no sudo.  Only ``ansible_become_method=sudo`` is supported.
    """
    if not _truthy(host.var("ansible_become", False)):
        return None
    user = str(host.var("ansible_become_user", "root"))
    if user == host.user:
        return None
    method = str(host.var("ansible_become_method", "sudo"))
    if method != "sudo":
        raise UserError(f"{host.name}: ansible_become_method={method}: the llamafleet CLI becomes {user} with sudo "
                        "only: set ansible_become_method=sudo or ansible_user=root for this host")
    return user


def become_password(host: Host) -> str | None:
    """``ansible_become_password`` (or ``ansible_become_pass``) as written in the inventory, or None."""
    for name in ("ansible_become_password", "ansible_become_pass"):
        value = host.var(name)
        if value is None:
            continue
        if not isinstance(value, (str, int)):
            raise UserError(f"{host.name}: {name} is not a plain string (a vault-encrypted value?): the CLI reads "
                            "inventory values as written: use NOPASSWD sudo for the CLI, or a plain value")
        return str(value)
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


def host_from_vars(name: str, hostvars: dict[str, Any], resolve: Callable[[str], Any] | None = None,
                   options: Callable[[Host], dict[str, Any]] | None = None) -> Host:
    """A Host from its inventory variables, reached as Ansible would reach it: ``options(host)`` gives the
    settings Ansible resolves for its connection (default: :func:`llamafleet.inventory.connection_options`),
    completed from the user's ssh config by :func:`llamafleet.connection.settle`."""
    host = Host(name=name, address=name, vars=hostvars, resolve=resolve)
    if options is None:
        from .inventory import connection_options  # imports ansible: only when an inventory is read

        options = connection_options
    resolved = options(host)
    port = resolved.get("port")
    if port is not None and not str(port).strip().isdigit():
        raise UserError(f"{name}: ansible_port is {port!r}, not a port number")
    try:
        target: Target = connection.settle(name, resolved)
    except ValueError as exc:
        raise UserError(f"{name}: {exc}") from None
    ssh_args = " ".join(str(resolved.get(k) or "") for k in ("ssh_args", "ssh_common_args", "ssh_extra_args"))
    strict = (_ssh_option(ssh_args, "StrictHostKeyChecking") or "").lower()
    host.address, host.user, host.port, host.local = target.address, target.user, target.port, target.local
    host.key_file = target.key_files[0] if target.key_files else None
    host.more_key_files = target.key_files[1:]
    host.jumps, host.proxy_command, host.timeout = target.jumps, target.proxy_command, target.timeout
    host.known_hosts = tuple((_ssh_option(ssh_args, "UserKnownHostsFile") or "").split())
    host.global_known_hosts = tuple((_ssh_option(ssh_args, "GlobalKnownHostsFile") or "").split())
    host.strict_off = strict in ("no", "off", "false")
    return host


class _RejectUnknown:
    """paramiko's missing-host-key policy: a HostKeyError that says what to do (or, insecure, a warning)."""

    def __init__(self, host: Host, files: list[Path], insecure: bool):
        self.host, self.files, self.insecure = host, files, insecure

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        if not self.insecure:
            raise HostKeyError(unknown_key_message(self.host, key, self.files))
        print(f"llamafleet: WARNING: {self.host.name} ({self.host.address} port {self.host.port}): host key "
              f"{_fingerprint(key)} NOT checked ({INSECURE_ENV}=1)", file=sys.stderr)


class _Chain:
    """The connection to a host through its jump hosts: commands go to the last, ``close`` closes them all."""

    def __init__(self, conns: list[Any]):
        self.conns = conns

    def __enter__(self) -> Any:
        return self.conns[-1] if len(self.conns) == 1 else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.conns[-1].run(*args, **kwargs)

    def sudo(self, *args: Any, **kwargs: Any) -> Any:
        return self.conns[-1].sudo(*args, **kwargs)

    def close(self) -> None:
        for conn in reversed(self.conns):
            conn.close()


def jump_host(host: Host, hop: Hop) -> Host:
    """A jump host of ``host`` as a Host: its key checked against ``host``'s known_hosts files and the user's."""
    return Host(name=f"{host.name}'s jump host {hop.spec}", address=hop.address, user=hop.user, port=hop.port,
                key_file=hop.key_files[0] if hop.key_files else None, more_key_files=hop.key_files[1:],
                known_hosts=tuple(dict.fromkeys([*host.known_hosts, *USER_KNOWN_HOSTS])),
                global_known_hosts=host.global_known_hosts, strict_off=host.strict_off, timeout=host.timeout)


def _open_one(host: Host, timeout: float, skip: bool, sock: Any) -> Any:
    """An open fabric Connection to one hop, over ``sock`` when given; HostKeyError for a wrong key."""
    from fabric import Config, Connection  # imported late: the CLI's --help must not need them
    from paramiko import AuthenticationException, BadHostKeyException

    connect_kwargs: dict[str, Any] = {"timeout": timeout, "banner_timeout": timeout, "auth_timeout": timeout}
    keys = [k for k in (host.key_file, *host.more_key_files) if k]
    if keys:
        connect_kwargs["key_filename"] = keys
    if sock is not None:
        connect_kwargs["sock"] = sock
    # lazy: fabric reads no ssh config of its own; connection.settle already applied the user's
    conn = Connection(host.address, user=host.user, port=host.port, connect_kwargs=connect_kwargs, gateway=False,
                      config=Config(lazy=True))
    files = known_hosts_files(host)
    if not skip:
        known = conn.client.get_host_keys()  # checked by paramiko; never saved (no file name is set)
        for path in files:
            if path.is_file():
                known.load(str(path))
    conn.client.set_missing_host_key_policy(_RejectUnknown(host, files, skip))
    try:
        conn.open()
    except BadHostKeyException as exc:
        conn.close()
        raise HostKeyError(changed_key_message(host, exc.key, exc.expected_key, files)) from None
    except Exception as exc:
        transport = conn.client.get_transport()
        # paramiko reports a refused key as the last error it met trying key types: an authentication failure
        refused = (transport is not None and getattr(transport, "host_key", None) is not None  # keys exchanged
                   and not transport.is_authenticated())
        conn.close()
        if refused and not isinstance(exc, (AuthenticationException, HostKeyError)):
            raise AuthenticationException(str(exc)) from exc
        raise
    except BaseException:
        conn.close()
        raise
    return conn


def _proxy_command(host: Host) -> Any:
    """paramiko's ProxyCommand for ``host``'s ProxyCommand, its ``%h``/``%p``/``%r`` expanded."""
    from paramiko import ProxyCommand

    tokens = {"%": "%", "h": host.address, "p": str(host.port), "r": host.user, "n": host.name}
    return ProxyCommand(re.sub(r"%(.)", lambda m: tokens.get(m.group(1), m.group(0)), host.proxy_command or ""))


def fabric_connection(host: Host, timeout: float = 10.0, insecure: bool | None = None) -> Any:
    """An open connection to ``host`` (fabric, through its jump hosts; or local for ``ansible_connection: local``)
    whose host keys are in the known_hosts files ssh would read.

    Nothing is ever added to a known_hosts file.  ``insecure`` (default: ``LLAMAFLEET_SSH_INSECURE``)
    accepts any key with a warning.  Raises HostKeyError for an unknown or changed key, and ConnectError,
    in words that name the host, when it cannot be reached.
    """
    if host.local:
        return LocalConnection()
    skip = insecure_requested(insecure)
    hops = [*(jump_host(host, hop) for hop in host.jumps), host]
    conns: list[Any] = []
    sock = _proxy_command(host) if host.proxy_command else None
    via = ""
    try:
        for i, hop in enumerate(hops):
            try:
                conns.append(_open_one(hop, timeout, skip, sock))
            except HostKeyError:
                raise
            except Exception as exc:  # noqa: BLE001 - described in words
                words = describe_error(exc, hop.address, hop.port, hop.user, timeout, via,
                                       [k for k in (hop.key_file, *hop.more_key_files) if k])
                raise ConnectError(host.name, words if hop is host else f"jump host {host.jumps[i].spec}: {words}"
                                   ) from None
            if i + 1 < len(hops):
                nxt = hops[i + 1]
                try:
                    sock = conns[-1].transport.open_channel("direct-tcpip", (nxt.address, nxt.port), ("", 0),
                                                            timeout=timeout)
                except Exception as exc:  # noqa: BLE001 - described in words
                    raise ConnectError(host.name, describe_error(exc, nxt.address, nxt.port, nxt.user, timeout,
                                                                 hop.address)) from None
                via = hop.address
    except BaseException:
        for conn in reversed(conns):
            conn.close()
        raise
    return _Chain(conns)


def _execute(conn: Any, host: Host, line: str, timeout: float) -> Any:
    """Run ``line`` on ``conn``: as the connecting user, or through sudo when the inventory asks to become."""
    options = {"hide": True, "warn": True, "timeout": timeout, "in_stream": False}
    user = become_user(host)
    if user is None:
        return conn.run(line, **options)
    password = become_password(host)
    wrapped = f"sh -c {shlex.quote(line)}"
    if password is None:  # -n: fail at once ("a password is required") rather than wait for one
        return conn.run(f"sudo -n -H -u {shlex.quote(user)} -- {wrapped}", **options)
    return conn.sudo(wrapped, user=shlex.quote(user), password=password, **options)


class Fleet:
    """The hosts of an inventory, their groups, and SSH access to them."""

    def __init__(self, hosts: dict[str, Host], groups: dict[str, list[str]], connect: Connect = fabric_connection):
        self.hosts = hosts
        self.groups = groups
        self.connect = connect

    @classmethod
    def from_inventory(cls, inventory: str | Path | None = None, vault_password_files: Iterable[str] = (),
                       connect: Connect = fabric_connection) -> Fleet:
        """The fleet of an Ansible inventory (default: Ansible's configured one), read by Ansible itself.

        Vault passwords come from ``vault_password_files``, else from Ansible's configuration
        (``ANSIBLE_VAULT_PASSWORD_FILE``, ``vault_password_file``/``vault_identity_list`` in ansible.cfg);
        nothing is ever prompted for.
        """
        from .inventory import read_inventory  # imports ansible: only when an inventory is read

        groups, hosts = read_inventory(inventory, vault_password_files)
        return cls({name: host_from_vars(name, raw, resolve) for name, (raw, resolve) in hosts.items()},
                   groups, connect)

    @classmethod
    def from_inventory_json(cls, data: dict[str, Any], connect: Connect = fabric_connection) -> Fleet:
        """The fleet of ``ansible-inventory --list`` output, values as written (tests, recorded inventories)."""
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
                with self.connect(host, host.timeout) as conn:
                    res = _execute(conn, host, line, timeout)
                return RunResult(host.name, res.exited == 0, res.stdout, res.stderr, res.exited)
            except Exception as exc:  # noqa: BLE001 - every failure is reported per host, in words
                return RunResult(host.name, False, error=run_error(exc, host.name, host.address, host.port,
                                                                   host.user, host.timeout))

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
