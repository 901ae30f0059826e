"""How the CLI reaches a host: as ``ansible`` would for the same inventory, and why it could not, in words.

Ansible's ssh connection runs ``ssh`` with the options its configuration resolves for the host
(:func:`llamafleet.inventory.connection_options`: ``ansible_host``, ``ansible_user`` or
``remote_user``/``ANSIBLE_REMOTE_USER``, ``ansible_port``, ``ansible_ssh_private_key_file``, the ssh
arguments of ansible.cfg and of ``ansible_ssh_common_args``/``ansible_ssh_extra_args``); ``ssh`` then reads
the user's ssh config (``-F FILE`` when the arguments give one, else ``~/.ssh/config`` and
``/etc/ssh/ssh_config``) for what those leave open.  :func:`settle` does the same, in that order:

- address: ``ansible_host`` (else the inventory name), then the ssh config's ``HostName`` for it;
- user: Ansible's ``remote_user`` (``ansible_user``, ``ANSIBLE_REMOTE_USER``, ansible.cfg), else the ssh
  config's ``User``, else the local user (never root by default);
- port: ``ansible_port`` (``remote_port``), else the ssh config's ``Port``, else 22;
- keys: ``ansible_ssh_private_key_file`` (``private_key_file``), then every ``IdentityFile`` of the ssh config;
- ProxyJump: ``-J HOPS`` or ``-o ProxyJump=HOPS`` in the ssh arguments, else the ssh config's
  ``ProxyJump`` (each hop ``[user@]host[:port]``, itself looked up in the ssh config); a ``ProxyCommand``
  likewise.  Jump hosts' keys are checked against the same known_hosts files as the target's, plus the user's.
- ``ansible_connection: local`` (or ``ansible.cfg`` ``transport = local``): the commands run on this machine,
  without SSH, as the user running the CLI.

A connection that fails is described in words by :func:`describe_error`, beside the host's name
(``lab2: connection refused on port 22 (10.77.0.12)``, ``lab2: name not known (lab2.example): ...``,
``lab2: timed out after 10 s (...)``, ``lab2: authentication failed for user deploy (...)``), rather than by an
exception's name; a jump host that fails is named as such (``lab2: jump host bastion: ...``).
"""

from __future__ import annotations

import errno
import getpass
import os
import shlex
import socket
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import UserError

# Connection plugins whose settings the CLI follows with SSH (paramiko's speak the same variables).
SSH_TRANSPORTS = ("ssh", "smart", "paramiko", "paramiko_ssh", "ansible.builtin.ssh", "ansible.builtin.paramiko_ssh")
LOCAL_TRANSPORTS = ("local", "ansible.builtin.local")
USER_SSH_CONFIG = "~/.ssh/config"
SYSTEM_SSH_CONFIG = "/etc/ssh/ssh_config"
DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class Hop:
    """One jump host of a ProxyJump chain, as ssh resolves it."""

    spec: str
    address: str
    user: str
    port: int
    key_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """Where and how to reach a host (the connection half of ``fleet.Host``)."""

    address: str
    user: str
    port: int
    key_files: tuple[str, ...] = ()
    jumps: tuple[Hop, ...] = ()
    proxy_command: str | None = None
    local: bool = False
    timeout: float = DEFAULT_TIMEOUT


def local_user() -> str:
    """The user running the CLI (ssh's default user)."""
    return getpass.getuser()


def ssh_words(args: str) -> list[str]:
    return shlex.split(args or "")


def ssh_option(args: str, option: str) -> str | None:
    """The value of ``-o option=value`` (or ``-o "option value"``) in ssh arguments; the first wins, as in ssh."""
    words = ssh_words(args)
    for i, word in enumerate(words):
        value = None
        if word == "-o" and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith("-o"):
            value = word[2:]
        if not value:
            continue
        key, _sep, rest = value.strip().replace("=", " ", 1).partition(" ")
        if key.lower() == option.lower() and rest.strip():
            return rest.strip()
    return None


def ssh_flag(args: str, flag: str) -> str | None:
    """The value of a one-letter ssh flag (``-J hops``, ``-Jhops``, ``-F file``) in ssh arguments; the first wins."""
    words = ssh_words(args)
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag) and len(word) > len(flag):
            return word[len(flag):]
    return None


def config_files(args: str) -> tuple[str, ...]:
    """The ssh config files ssh reads: ``-F FILE`` alone when given, else the user's then the system's."""
    given = ssh_flag(args, "-F")
    if given:
        return () if given.lower() == "none" else (given,)
    return (USER_SSH_CONFIG, SYSTEM_SSH_CONFIG)


@lru_cache(maxsize=32)
def _parsed(path: str, mtime: float) -> Any:
    from paramiko import SSHConfig  # imported late: the CLI's --help must not need it

    del mtime  # part of the cache key only: an edited file is read again
    return SSHConfig.from_path(path)


def ssh_config_lookup(name: str, files: Iterable[str]) -> dict[str, Any]:
    """What the ssh config files say for ``name`` (lower-case keys, paramiko's parser), the first file's value
    winning as in ssh; ``hostname`` only when a file sets it."""
    found: dict[str, Any] = {}
    for file in files:
        path = os.path.expanduser(file)
        if not os.path.isfile(path):
            continue
        entry = dict(_parsed(path, os.path.getmtime(path)).lookup(name))
        if entry.get("hostname") == name:
            entry.pop("hostname")
        for key, value in entry.items():
            if key == "identityfile":
                found[key] = [*found.get(key, []), *(v for v in value if v not in found.get(key, []))]
            else:
                found.setdefault(key, value)
    return found


def parse_hops(spec: str) -> list[tuple[str | None, str, int | None]]:
    """``[user@]host[:port],...`` (or ``ssh://[user@]host[:port]``) as ``[(user, host, port), ...]``."""
    hops = []
    for part in spec.split(","):
        part = part.strip()
        if part.startswith("ssh://"):
            part = part[len("ssh://"):]
        user, _at, rest = part.rpartition("@")
        host, port = rest, None
        if rest.startswith("["):  # [v6 address]:port
            host, _sep, tail = rest[1:].partition("]")
            port = int(tail[1:]) if tail.startswith(":") else None
        elif rest.count(":") == 1:
            host, text = rest.split(":")
            port = int(text)
        if not host:
            raise ValueError(f"ProxyJump {spec!r}: a hop without a host")
        hops.append((user or None, host, port))
    return hops


def resolve_hops(spec: str | None, files: Iterable[str]) -> tuple[Hop, ...]:
    """The jump hosts of a ProxyJump value, each completed from the ssh config as ssh does (``none``: none)."""
    if not spec or spec.strip().lower() == "none":
        return ()
    files = tuple(files)
    out = []
    for user, name, port in parse_hops(spec):
        cfg = ssh_config_lookup(name, files)
        out.append(Hop(spec=name, address=str(cfg.get("hostname", name)),
                       user=user or str(cfg.get("user") or local_user()),
                       port=int(port or cfg.get("port") or 22),
                       key_files=tuple(str(k) for k in cfg.get("identityfile", []))))
    return tuple(out)


def settle(name: str, options: dict[str, Any]) -> Target:
    """Where ``ssh`` would connect for a host with Ansible's resolved ``options`` (see the module's docstring).

    ``options``: ``transport``, ``host``, ``remote_user``, ``port``, ``private_key_file``, ``ssh_args``,
    ``ssh_common_args``, ``ssh_extra_args``, ``timeout`` (None or absent: not set).
    """
    timeout = float(options.get("timeout") or DEFAULT_TIMEOUT)
    address = str(options.get("host") or name)
    if address == "inventory_hostname":  # the ssh plugin's default, which Ansible templates to the host's name
        address = name
    transport = str(options.get("transport") or "ssh")
    if transport in LOCAL_TRANSPORTS:
        return Target(address=address, user=local_user(), port=0, local=True, timeout=timeout)
    if transport not in SSH_TRANSPORTS:
        raise ValueError(f"ansible_connection={transport}: the llamafleet CLI connects with ssh or local only")
    args = " ".join(str(options.get(k) or "") for k in ("ssh_args", "ssh_common_args", "ssh_extra_args"))
    files = config_files(args)
    cfg = ssh_config_lookup(address, files)
    key = options.get("private_key_file")
    keys = [os.path.expanduser(str(key))] if key else []
    keys += [str(k) for k in cfg.get("identityfile", []) if str(k) not in keys]
    port = options.get("port") or cfg.get("port") or 22
    jump = ssh_flag(args, "-J") or ssh_option(args, "ProxyJump") or cfg.get("proxyjump")
    command = ssh_option(args, "ProxyCommand") or cfg.get("proxycommand")
    return Target(address=str(cfg.get("hostname", address)),
                  user=str(options.get("remote_user") or cfg.get("user") or local_user()),
                  port=int(port), key_files=tuple(keys), jumps=resolve_hops(jump, files),
                  proxy_command=None if (jump or not command or command.lower() == "none") else command,
                  timeout=timeout)


# Errors in words

def _os_error(exc: OSError) -> OSError:
    """The socket error inside paramiko's NoValidConnectionsError (all addresses failed), or ``exc``."""
    errors = getattr(exc, "errors", None)
    if isinstance(errors, dict) and errors:
        return next(iter(errors.values()))
    return exc


def describe_error(exc: BaseException, address: str, port: int, user: str, timeout: float, via: str = "",
                   keys: Iterable[str] = ()) -> str:
    """Why connecting to ``address`` failed, in words (``connection refused on port 22 (10.77.0.12)``); the
    caller names the host.  ``via``: the jump host the connection went through, when it failed beyond it;
    ``keys``: the key files offered."""
    try:
        from paramiko import AuthenticationException, ChannelException, SSHException
    except ImportError:  # pragma: no cover - paramiko is a dependency
        AuthenticationException = ChannelException = SSHException = ()  # type: ignore[assignment,misc]
    where = f"{address} port {port}" + (f" via {via}" if via else "")
    if isinstance(exc, AuthenticationException):
        offered = ", ".join(keys) or "none given: the ssh agent's and ~/.ssh/id_*"
        return f"authentication failed for user {user} ({where}; key files: {offered})"
    if isinstance(exc, ChannelException):
        return f"the jump host {via or '?'} could not open a connection to {address} port {port}: {exc}"
    if isinstance(exc, socket.gaierror):
        return f"name not known ({address}): {exc.strerror or exc}"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"timed out after {timeout:g} s ({where})"
    if isinstance(exc, OSError):
        inner = _os_error(exc)
        if isinstance(inner, socket.gaierror):
            return f"name not known ({address}): {inner.strerror or inner}"
        words = {errno.ECONNREFUSED: f"connection refused on port {port} ({address}{' via ' + via if via else ''})",
                 errno.EHOSTUNREACH: f"no route to host ({where})", errno.ENETUNREACH: f"network unreachable ({where})",
                 errno.ETIMEDOUT: f"timed out after {timeout:g} s ({where})"}
        if inner.errno in words:
            return words[inner.errno]
        return f"cannot connect ({where}): {inner.strerror or inner}"
    if isinstance(exc, SSHException):
        text = str(exc)
        # paramiko gives up on a silent peer at the banner, or (its negotiation timed out) at "No existing session"
        if any(word in text.lower() for word in ("banner", "no existing session", "negotiation")):
            return f"no SSH server answered on {where} within {timeout:g} s"
        return f"SSH failed ({where}): {text}"
    return f"{type(exc).__name__}: {exc}"


class ConnectError(UserError):
    """A host that could not be reached: ``words`` say why (:func:`describe_error`), the message names the host."""

    def __init__(self, name: str, words: str):
        super().__init__(f"{name}: {words}")
        self.name, self.words = name, words


def run_error(exc: BaseException, name: str, address: str, port: int, user: str, timeout: float) -> str:
    """Why a command could not run on host ``name``, for its RunResult (the host is named beside it): a
    connection's failure in words, a message that names the host as it is, anything else with its type."""
    if isinstance(exc, ConnectError):
        return exc.words
    if isinstance(exc, UserError):
        return str(exc)
    return describe_error(exc, address, port, user, timeout)


# Local hosts

@dataclass
class LocalResult:
    exited: int
    stdout: str
    stderr: str


class LocalConnection:
    """A host reached with ``ansible_connection: local``: fabric's ``run``/``sudo`` as local processes."""

    def __enter__(self) -> LocalConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None

    def run(self, command: str, hide: bool = True, warn: bool = True, timeout: float | None = None,
            in_stream: Any = False, stdin: str | None = None) -> LocalResult:
        del hide, warn, in_stream  # always hidden, never raised on exit status, no stdin but ``stdin``
        proc = subprocess.run(["/bin/sh", "-c", command], input=stdin or "", capture_output=True, text=True,
                              timeout=timeout, check=False)
        return LocalResult(proc.returncode, proc.stdout, proc.stderr)

    def sudo(self, command: str, user: str, password: str, **options: Any) -> LocalResult:
        """``command`` as ``user`` through ``sudo -S`` (the password on stdin, never on a command line)."""
        prompt = "[sudo] password: "
        return self.run(f"sudo -S -p {shlex.quote(prompt)} -H -u {user} {command}", stdin=password + "\n",
                        timeout=options.get("timeout"))


def known_files_for_jumps(target_files: Iterable[Path], user_files: Iterable[Path]) -> list[Path]:
    """The known_hosts files a jump host's key is checked against: the target's, then the user's (deduplicated)."""
    out: list[Path] = []
    for path in [*target_files, *user_files]:
        if path not in out:
            out.append(path)
    return out
