"""The CLI reaches each host as ``ansible`` would: real inventories, real ansible.cfg files, a real ssh config.

Ansible reads its configuration once per process, so each case runs the library in a fresh Python with
``ANSIBLE_CONFIG`` (and ``HOME``, for ``~/.ssh/config``) pointing at the files written here.  Connection
errors are proven on real sockets of 127.0.0.1 (a closed port, a port that never speaks SSH).
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llamafleet.connection import (Target, config_files, describe_error, parse_hops, settle, ssh_config_lookup,
                                   ssh_flag, ssh_option)
from llamafleet.fleet import Fleet

ROOT = Path(__file__).resolve().parents[3]

RESOLVE = """
import json, sys
from llamafleet.fleet import Fleet
fleet = Fleet.from_inventory(sys.argv[1])
print(json.dumps({n: {"address": h.address, "user": h.user, "port": h.port, "key_file": h.key_file,
                      "more_key_files": list(h.more_key_files), "local": h.local, "timeout": h.timeout,
                      "proxy_command": h.proxy_command,
                      "jumps": [[j.spec, j.address, j.user, j.port, list(j.key_files)] for j in h.jumps]}
                  for n, h in fleet.hosts.items()}))
"""


def resolve(tmp_path: Path, inventory: str, cfg: str = "[defaults]\n", ssh_config: str | None = None,
            **env: str) -> dict[str, dict]:
    """The hosts of ``inventory`` as the library resolves them under ansible.cfg ``cfg`` and ``~/.ssh/config``."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    if ssh_config is not None:
        (home / ".ssh" / "config").write_text(ssh_config)
    (tmp_path / "ansible.cfg").write_text(cfg)
    (tmp_path / "hosts.ini").write_text(inventory)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    environ.update(HOME=str(home), ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"), LOGNAME="zoe", USER="zoe",
                   ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), **env)
    proc = subprocess.run([sys.executable, "-c", RESOLVE, str(tmp_path / "hosts.ini")], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


INVENTORY = """\
[llamafleet_orchestrator]
orch ansible_host=192.0.2.10

[llamafleet_workers]
w1 ansible_host=192.0.2.11 ansible_user=erin ansible_port=2201 ansible_ssh_private_key_file=/keys/w1
w2 ansible_host=192.0.2.12 ansible_ssh_common_args='-J bob@jump1:2022,jump2 -o UserKnownHostsFile=/k'
w3 ansible_host=aliased
w4 ansible_host=192.0.2.14 ansible_ssh_extra_args='-o ProxyJump=jump1'
here ansible_connection=local

[llamafleet:children]
llamafleet_orchestrator
llamafleet_workers
"""

SSH_CONFIG = """\
Host aliased
    HostName 192.0.2.13
    User frank
    Port 2213
    IdentityFile /keys/aliased

Host jump1
    HostName 198.51.100.1
    User jumper
    IdentityFile /keys/jump

Host 192.0.2.1?
    ServerAliveInterval 5
"""


def test_no_user_anywhere_is_the_local_user_never_root(tmp_path):
    hosts = resolve(tmp_path, INVENTORY)
    assert hosts["orch"] == {"address": "192.0.2.10", "user": "zoe", "port": 22, "key_file": None,
                             "more_key_files": [], "local": False, "timeout": 10.0, "proxy_command": None,
                             "jumps": []}
    assert hosts["w1"]["user"] == "erin" and hosts["w1"]["port"] == 2201 and hosts["w1"]["key_file"] == "/keys/w1"
    assert hosts["here"]["local"] is True and hosts["here"]["user"] == "zoe"


def test_remote_user_from_ansible_cfg_then_the_environment_then_the_inventory(tmp_path):
    cfg = "[defaults]\nremote_user = carol\nremote_port = 2022\nprivate_key_file = /keys/cfg\ntimeout = 3\n"
    hosts = resolve(tmp_path, INVENTORY, cfg)
    assert (hosts["orch"]["user"], hosts["orch"]["port"], hosts["orch"]["key_file"]) == ("carol", 2022, "/keys/cfg")
    assert hosts["orch"]["timeout"] == 3.0
    assert (hosts["w1"]["user"], hosts["w1"]["port"], hosts["w1"]["key_file"]) == ("erin", 2201, "/keys/w1")
    hosts = resolve(tmp_path, INVENTORY, cfg, ANSIBLE_REMOTE_USER="dave")
    assert hosts["orch"]["user"] == "dave" and hosts["w1"]["user"] == "erin"


def test_the_users_ssh_config_fills_what_ansible_leaves_open(tmp_path):
    hosts = resolve(tmp_path, INVENTORY, ssh_config=SSH_CONFIG)
    assert {k: hosts["w3"][k] for k in ("address", "user", "port", "key_file")} == {
        "address": "192.0.2.13", "user": "frank", "port": 2213, "key_file": "/keys/aliased"}
    # ansible.cfg's remote_user is passed to ssh as -o User, which wins over the ssh config's User
    hosts = resolve(tmp_path, INVENTORY, "[defaults]\nremote_user = carol\n", ssh_config=SSH_CONFIG)
    assert (hosts["w3"]["user"], hosts["w3"]["port"]) == ("carol", 2213)


def test_proxyjump_from_the_ssh_arguments_and_each_hop_from_the_ssh_config(tmp_path):
    hosts = resolve(tmp_path, INVENTORY, ssh_config=SSH_CONFIG)
    assert hosts["w2"]["jumps"] == [["jump1", "198.51.100.1", "bob", 2022, ["/keys/jump"]],
                                    ["jump2", "jump2", "zoe", 22, []]]
    assert hosts["w4"]["jumps"] == [["jump1", "198.51.100.1", "jumper", 22, ["/keys/jump"]]]
    config_jump = SSH_CONFIG + "\nHost 192.0.2.10\n    ProxyJump admin@jump1:2200\n"
    hosts = resolve(tmp_path, INVENTORY, ssh_config=config_jump)
    assert hosts["orch"]["jumps"] == [["jump1", "198.51.100.1", "admin", 2200, ["/keys/jump"]]]


def test_ssh_args_of_ansible_cfg_count_and_F_picks_the_config_file(tmp_path):
    other = tmp_path / "other_ssh_config"
    other.write_text("Host 192.0.2.10\n    User olga\n    ProxyCommand nc -X connect %h %p\n")
    cfg = f"[defaults]\n[ssh_connection]\nssh_args = -F {other} -o ControlMaster=auto\n"
    hosts = resolve(tmp_path, INVENTORY, cfg, ssh_config=SSH_CONFIG)
    assert hosts["orch"]["user"] == "olga" and hosts["orch"]["proxy_command"] == "nc -X connect 192.0.2.10 22"
    assert hosts["w3"]["address"] == "aliased"  # -F: the user's ~/.ssh/config is not read


def test_ansible_cfg_transport_local(tmp_path):
    hosts = resolve(tmp_path, INVENTORY, "[defaults]\ntransport = local\n")
    assert all(h["local"] for h in hosts.values())


# Pure parts

@pytest.mark.parametrize(
    ("spec", "hops"),
    [("bastion", [(None, "bastion", None)]),
     ("bob@b1:2022,b2", [("bob", "b1", 2022), (None, "b2", None)]),
     ("ssh://ann@[2001:db8::1]:22", [("ann", "2001:db8::1", 22)]),
     ("a@b@c", [("a@b", "c", None)])],
)
def test_parse_hops(spec, hops):
    assert parse_hops(spec) == hops


@pytest.mark.parametrize(
    ("args", "flag", "value"),
    [("-J a,b -o X=y", "-J", "a,b"), ("-Jjump", "-J", "jump"), ("-o ProxyJump=j", "-J", None),
     ("-F /cfg -C", "-F", "/cfg")],
)
def test_ssh_flag(args, flag, value):
    assert ssh_flag(args, flag) == value


def test_ssh_option_forms():
    assert ssh_option("-o ProxyJump=j1", "proxyjump") == "j1"
    assert ssh_option('-o "ProxyJump j2"', "ProxyJump") == "j2"
    assert ssh_option("-oProxyJump = j3", "ProxyJump") is None or ssh_option("-oProxyJump=j3", "ProxyJump") == "j3"
    assert config_files("-F none") == () and config_files("") == ("~/.ssh/config", "/etc/ssh/ssh_config")


def test_the_first_config_file_wins_and_identity_files_add_up(tmp_path):
    (tmp_path / "a").write_text("Host h\n    User first\n    IdentityFile /k/a\n")
    (tmp_path / "b").write_text("Host h\n    User second\n    Port 2\n    IdentityFile /k/b\n")
    found = ssh_config_lookup("h", [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "missing")])
    assert (found["user"], found["port"], found["identityfile"]) == ("first", "2", ["/k/a", "/k/b"])
    assert "hostname" not in found


def test_settle_refuses_a_connection_it_cannot_make():
    with pytest.raises(ValueError, match="ansible_connection=winrm"):
        settle("win", {"transport": "winrm"})
    assert settle("h", {"transport": "smart", "host": "inventory_hostname", "remote_user": "u"}) == Target(
        address="h", user="u", port=22)


@pytest.mark.parametrize(
    ("exc", "words"),
    [(socket.gaierror(-2, "Name or service not known"), "name not known (lab2.invalid): Name or service not known"),
     (socket.timeout("timed out"), "timed out after 10 s (lab2.invalid port 22)"),
     (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "connection refused on port 22 (lab2.invalid)"),
     (OSError(errno.EHOSTUNREACH, "No route to host"), "no route to host (lab2.invalid port 22)")],
)
def test_describe_error(exc, words):
    assert describe_error(exc, "lab2.invalid", 22, "deploy", 10.0) == words


def test_paramiko_errors_in_words():
    from paramiko import AuthenticationException
    from paramiko.ssh_exception import NoValidConnectionsError

    refused = NoValidConnectionsError({("127.0.0.1", 2): ConnectionRefusedError(errno.ECONNREFUSED, "refused")})
    assert describe_error(refused, "127.0.0.1", 2, "u", 10) == "connection refused on port 2 (127.0.0.1)"
    assert describe_error(AuthenticationException("no"), "a", 22, "deploy", 10).startswith(
        "authentication failed for user deploy (a port 22; key files: none given")


# Real sockets, real inventory, the CLI

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_says_why_in_words_and_keeps_the_inventorys_roles(tmp_path):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never speaks SSH
    silent_port = silent.getsockname()[1]
    try:
        inventory = (
            "[llamafleet_orchestrator]\n"
            f"lab1 ansible_host=127.0.0.1 ansible_port={_closed_port()}\n"
            "[llamafleet_workers]\n"
            "lab2 ansible_host=lab2.invalid\n"
            f"lab3 ansible_host=127.0.0.1 ansible_port={silent_port} ansible_ssh_timeout=1\n"
            "[llamafleet:children]\nllamafleet_orchestrator\nllamafleet_workers\n")
        (tmp_path / "hosts.ini").write_text(inventory)
        (tmp_path / "ansible.cfg").write_text("[defaults]\nremote_user = carol\n")
        environ = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        environ.update(ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"), HOME=str(tmp_path),
                       ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-m", "llamafleet", "status", "--json", "-i",
                               str(tmp_path / "hosts.ini")], env=environ, capture_output=True, text=True,
                              timeout=120, check=False)
    finally:
        silent.close()
    assert proc.returncode == 1, proc.stderr
    rows = {r["host"]: r for r in json.loads(proc.stdout)}
    port = inventory.split("ansible_port=")[1].split()[0]
    assert rows["lab1"]["error"] == f"connection refused on port {port} (127.0.0.1)"
    assert rows["lab2"]["error"].startswith("name not known (lab2.invalid)")
    assert rows["lab3"]["error"].startswith(f"no SSH server answered on 127.0.0.1 port {silent_port} "
                                            "within 1 s")
    assert {h: (r["role"], r["state"]) for h, r in rows.items()} == {
        "lab1": ("orchestrator", "unreachable"), "lab2": ("worker", "unreachable"), "lab3": ("worker", "unreachable")}
    assert not re.search(r"\w+(Error|Exception)\b", proc.stdout)  # no exception names


def test_a_local_host_runs_on_this_machine_without_ssh():
    fleet = Fleet.from_inventory_json({"g": {"hosts": ["here"]},
                                       "_meta": {"hostvars": {"here": {"ansible_connection": "local"}}}})
    res = fleet.run("echo $((6 * 7)); echo err >&2; exit 3")["here"]
    assert (res.exit_code, res.stdout, res.stderr) == (3, "42\n", "err\n")
