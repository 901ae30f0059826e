# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A service's system group and user (module ``host_user``): what the host has against what is wanted, as the
``groupadd``, ``useradd`` and ``usermod`` command lines that make it so. Pure: the module reads the host
(``grp``, ``pwd``) and runs the lines."""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional


class Account(NamedTuple):
    """The user as the host has it: ``None`` for a missing user."""

    gid: int
    home: str
    shell: str
    groups: tuple  # the supplementary groups' names


def device_groups(wanted: Iterable[str], host_groups: Iterable[str]) -> list[str]:
    """The ``wanted`` supplementary groups the host has, in the order given (a minimal host has no render group)."""
    present = set(host_groups)
    return [name for name in dict.fromkeys(wanted) if name in present]


def account_commands(name: str, home: str, shell: str, groups: list[str], group_gid: Optional[int],
                     account: Optional[Account]) -> list[list[str]]:
    """The command lines that give the host the system group ``name`` and the system user ``name`` in it (``shell``,
    ``home`` not created, member of ``groups`` too, added to those it has, never taken out of others); none when
    the host has them already. ``group_gid`` is the group's id, ``None`` when the host has no such group."""
    commands = []
    if group_gid is None:
        commands.append(["groupadd", "--system", "--", name])
    if account is None:
        line = ["useradd", "--system", "--gid", name, "--shell", shell, "--home-dir", home, "--no-create-home"]
        if groups:
            line += ["--groups", ",".join(groups)]
        return commands + [line + ["--", name]]
    change = []
    if group_gid is None or account.gid != group_gid:
        change += ["--gid", name]
    if account.shell != shell:
        change += ["--shell", shell]
    if account.home != home:
        change += ["--home", home]
    missing = [group for group in groups if group not in account.groups]
    if missing:
        change += ["--append", "--groups", ",".join(missing)]
    if change:
        commands.append(["usermod", *change, "--", name])
    return commands


def account_state(name: str, group_gid: Optional[int], account: Optional[Account]) -> dict:
    """The group and user as a diff shows them."""
    state = {"group": name if group_gid is not None else "absent"}
    if account is None:
        state["user"] = "absent"
    else:
        state["user"] = {"home": account.home, "shell": account.shell, "groups": sorted(account.groups),
                         "primary_group_is_own": group_gid is not None and account.gid == group_gid}
    return state


def wanted_state(name: str, home: str, shell: str, groups: list[str], account: Optional[Account]) -> dict:
    """The group and user as they will be (supplementary groups added to those the user has)."""
    kept = list(account.groups) if account is not None else []
    return {"group": name, "user": {"home": home, "shell": shell, "groups": sorted(set(kept) | set(groups)),
                                    "primary_group_is_own": True}}
