"""An Ansible inventory read through Ansible's own Python API: groups, variables, vault and Jinja.

The playbooks and the CLI must see the same values, so nothing here parses an inventory:
``InventoryManager`` reads the sources (any format and plugin ``ansible-inventory`` reads),
``VariableManager`` layers host and group variables (``group_vars``/``host_vars`` included) as
a play would before facts, and a ``Templar`` resolves a value when the CLI asks for it, with the
host's variables: a ``"{{ 8000 + 80 }}"`` port arrives as 8080 and a vaulted API key as its text.

Vault secrets come from the files given, else from Ansible's configuration; the CLI never prompts.
A value that cannot be resolved (a vault without its password, a fact only a play gathers) is a
``UserError`` that names the host, the variable and what to do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .errors import UserError

VAULT_HINT = ("give the vault password: --vault-password-file FILE, ANSIBLE_VAULT_PASSWORD_FILE, or "
              "vault_password_file in ansible.cfg")


def _plain(value: Any) -> Any:
    """``value`` as builtin JSON types (Ansible hands out tagged subclasses of str and int)."""
    return json.loads(json.dumps(value, default=str))


def _ansible() -> Any:
    """Ansible's modules, imported on first use (the CLI's --help must not need them)."""
    try:
        from ansible import constants as C
        from ansible.cli import CLI
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.template import Templar
        from ansible.vars.manager import VariableManager
    except ImportError as exc:  # pragma: no cover - ansible-core is a declared dependency
        raise UserError(f"ansible-core is not importable ({exc}): install llamafleet with pip, which brings it") from exc
    return C, CLI, AnsibleError, InventoryManager, DataLoader, Templar, VariableManager


def default_sources() -> list[str]:
    """Ansible's configured inventory (``ANSIBLE_INVENTORY``, ansible.cfg's ``inventory``)."""
    C = _ansible()[0]
    return [str(s) for s in (C.DEFAULT_HOST_LIST or [])]


def collection_playbook(fqcn: str) -> Path:
    """The file of the collection playbook ``fqcn`` (``namespace.collection.playbook``) in Ansible's configured
    collections path (``ANSIBLE_COLLECTIONS_PATH``, ansible.cfg's ``collections_path``), where ansible-playbook
    finds it; a ``UserError`` that says how to install the collection when no path holds it."""
    namespace, collection, name = fqcn.split(".", 2)
    roots = [Path(p).expanduser() for p in (_ansible()[0].COLLECTIONS_PATHS or [])]
    for root in roots:
        for suffix in (".yml", ".yaml"):
            path = root / "ansible_collections" / namespace / collection / "playbooks" / (name + suffix)
            if path.is_file():
                return path
    where = ", ".join(str(r) for r in roots) or "(none configured)"
    raise UserError(
        f"the collection {namespace}.{collection} is not installed where Ansible looks for collections ({where}), "
        f"so ansible-playbook cannot run {fqcn}: install it (ansible-galaxy collection install "
        f"{namespace}-{collection}-<version>.tar.gz, or from Galaxy), set ANSIBLE_COLLECTIONS_PATH to where it is, "
        f"or run from a checkout of llamafleet (its ansible.cfg finds the collection in the checkout)")


def _vault_secrets(cli: Any, loader: Any, vault_ids: list[str], files: list[str]) -> list[Any]:
    """Ansible's vault secrets for ``files``; from ansible-core 2.19 on, also the process's secrets context
    (which decrypts vaulted values on use), replaced rather than refused when a second inventory is read."""
    options = {"vault_ids": vault_ids, "vault_password_files": files, "ask_vault_pass": False, "auto_prompt": False}
    try:
        from ansible.parsing.vault import VaultSecretsContext
    except ImportError:  # ansible-core before 2.19: secrets live in the loader only
        return cli.setup_vault_secrets(loader, **options)
    secrets = cli.setup_vault_secrets(loader, initialize_context=False, **options)
    current = VaultSecretsContext.current(optional=True)
    if current is None:
        VaultSecretsContext.initialize(VaultSecretsContext(secrets))
    else:
        current.secrets = secrets
    return secrets


def read_inventory(inventory: str | Path | None = None, vault_password_files: Iterable[str] = ()
                   ) -> tuple[dict[str, list[str]], dict[str, tuple[dict[str, Any], Callable[[str], Any]]]]:
    """``(groups, hosts)`` of an inventory: ``{group: [host, ...]}`` (children's hosts included, in
    inventory order) and ``{host: (variables as written, resolve(name) -> templated value)}``."""
    C, CLI, AnsibleError, InventoryManager, DataLoader, Templar, VariableManager = _ansible()
    sources = [str(inventory)] if inventory else default_sources()
    missing = [s for s in sources if "," not in s and not os.path.exists(s)]
    if not sources or missing == sources:
        where = ", ".join(missing) or "no inventory configured"
        raise UserError(f"inventory not found ({where}): pass -i INVENTORY (for the lab: llamafleet lab up)")

    loader = DataLoader()
    files = [str(f) for f in vault_password_files]
    if not files and C.DEFAULT_VAULT_PASSWORD_FILE:
        files = [str(C.DEFAULT_VAULT_PASSWORD_FILE)]
    try:
        secrets = _vault_secrets(CLI, loader, list(C.DEFAULT_VAULT_IDENTITY_LIST or []), files)
    except AnsibleError as exc:
        raise UserError(f"cannot read the vault password ({', '.join(files)}): {exc}") from None
    loader.set_vault_secrets(secrets)
    try:
        manager = InventoryManager(loader=loader, sources=sources)
    except AnsibleError as exc:
        raise UserError(f"Ansible could not read the inventory {', '.join(sources)}: {exc}") from None
    if not manager.hosts and all(not g.get_hosts() for g in manager.groups.values()):
        raise UserError(f"the inventory {', '.join(sources)} has no hosts (Ansible could not parse it?)")
    variables = VariableManager(loader=loader, inventory=manager)

    groups = {name: [h.name for h in group.get_hosts()] for name, group in manager.groups.items()}
    hosts: dict[str, tuple[dict[str, Any], Callable[[str], Any]]] = {}
    for host in manager.get_hosts(ignore_limits=True, ignore_restrictions=True):
        try:
            hostvars = variables.get_vars(host=host, include_hostvars=False)
        except AnsibleError as exc:
            hint = f"; {VAULT_HINT}" if "vault" in str(exc).lower() else ""
            raise UserError(f"{host.name}: Ansible could not read its inventory variables: {exc}{hint}") from None
        hosts[host.name] = (dict(hostvars), _resolver(host.name, hostvars, Templar(loader=loader, variables=hostvars),
                                                      AnsibleError))
    return groups, hosts


def _resolver(host: str, hostvars: dict[str, Any], templar: Any, error: type) -> Callable[[str], Any]:
    """A function templating one of ``host``'s variables as a play would (memoised)."""
    done: dict[str, Any] = {}

    def resolve(name: str) -> Any:
        if name not in done:
            try:
                done[name] = _plain(templar.template(hostvars[name]))
            except error as exc:
                text = str(exc).splitlines()[0]
                if "vault" in text.lower() or "decrypt" in text.lower():
                    raise UserError(f"{host}: {name} is vault-encrypted and cannot be decrypted ({text}): "
                                    f"{VAULT_HINT}") from None
                raise UserError(f"{host}: {name} cannot be resolved from the inventory alone ({text}); facts are "
                                "not gathered by the CLI: set a value that needs none") from None
        return done[name]

    return resolve


# The ssh connection plugin's options that say where and how to connect (its variables, environment and
# ansible.cfg keys come from the plugin's own documentation, read by Ansible's configuration manager).
CONNECTION_OPTIONS = ("host", "remote_user", "port", "private_key_file", "ssh_args", "ssh_common_args",
                      "ssh_extra_args", "timeout")


def _ssh_definitions() -> dict[str, Any]:
    """The ssh connection plugin's option definitions (loading the plugin registers them)."""
    C = _ansible()[0]
    from ansible.plugins.loader import connection_loader

    connection_loader.get("ssh", class_only=True)
    return C.config.get_configuration_definitions("connection", "ssh")


def connection_options(host: Any) -> dict[str, Any]:
    """What Ansible's ssh connection would use for ``host`` (a ``fleet.Host``): each of CONNECTION_OPTIONS
    resolved by Ansible's configuration manager from the host's variables (templated), the environment
    (``ANSIBLE_REMOTE_USER``, ...) and ansible.cfg (``[defaults] remote_user``, ``remote_port``,
    ``private_key_file``, ``timeout``; ``[ssh_connection] ssh_args``, ...), and ``transport``: the host's
    ``ansible_connection``, else ansible.cfg's ``transport``."""
    C = _ansible()[0]
    definitions = _ssh_definitions()
    names = {entry["name"] for option in CONNECTION_OPTIONS for entry in definitions[option].get("vars") or ()}
    variables = {name: host.var(name) for name in sorted(names) if host.var(name) is not None}
    AnsibleError = _ansible()[2]
    out = {}
    for option in CONNECTION_OPTIONS:
        try:
            out[option] = C.config.get_config_value(option, plugin_type="connection", plugin_name="ssh",
                                                    variables=variables)
        except AnsibleError as exc:
            given = {entry["name"]: variables[entry["name"]] for entry in definitions[option].get("vars") or ()
                     if entry["name"] in variables}
            if option == "port" and given:
                name, value = next(iter(given.items()))
                raise UserError(f"{host.name}: {name} is {value!r}, not a port number") from None
            raise UserError(f"{host.name}: Ansible's ssh setting {option} is not valid: {exc}") from None
    out["transport"] = host.var("ansible_connection") or C.DEFAULT_TRANSPORT
    return out
