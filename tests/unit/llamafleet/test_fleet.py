"""Fleet: the inventory as ansible-inventory resolves it, host selection, and commands on all hosts at once."""

from __future__ import annotations

import importlib.util
import shlex
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.fleet import (Fleet, GroupResult, Host, RunResult, _ssh_option, group_members, known_hosts_files,
                              tool)
from tests.unit.needs import needs, require

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fleet_of(groups: dict[str, list[str]], hostvars: dict[str, dict] | None = None, connect=None) -> Fleet:
    """A fleet from a minimal ``ansible-inventory --list`` document."""
    data = {g: {"hosts": hosts} for g, hosts in groups.items()}
    data["_meta"] = {"hostvars": hostvars or {}}
    return Fleet.from_inventory_json(data, connect) if connect else Fleet.from_inventory_json(data)


# Inventory parsing

def test_recorded_lab_inventory_hosts_and_connection_settings(lab_inventory):
    fleet = Fleet.from_inventory_json(lab_inventory)
    assert sorted(fleet.hosts) == ["lab1", "lab2", "lab3"]
    lab2 = fleet.hosts["lab2"]
    assert (lab2.address, lab2.user, lab2.port) == ("10.77.0.12", "root", 22)
    assert lab2.key_file == "/var/cache/llamafleet/lab/id_ed25519"
    assert lab2.known_hosts == ("/var/cache/llamafleet/lab/known_hosts",)
    assert [str(p) for p in known_hosts_files(lab2)][0] == "/var/cache/llamafleet/lab/known_hosts"
    assert not lab2.strict_off
    assert lab2.cluster_address == "10.77.0.12"
    assert fleet.groups[constants.GROUP_FLEET] == ["lab1", "lab2", "lab3"]


def test_recorded_lab_inventory_roles(lab_inventory):
    fleet = Fleet.from_inventory_json(lab_inventory)
    assert fleet.orchestrator.name == "lab1"
    assert [w.name for w in fleet.workers] == ["lab2", "lab3"]
    assert [h.name for h in fleet.members()] == ["lab1", "lab2", "lab3"]
    assert fleet.is_orchestrator(fleet.hosts["lab1"]) and not fleet.is_worker(fleet.hosts["lab1"])
    assert fleet.orchestrator.var("llama_server_port") == 8181


def _has_ansible_inventory() -> bool:
    try:
        return bool(tool("ansible-inventory"))
    except UserError:
        return False


@needs(_has_ansible_inventory(), "ansible-inventory (ansible-core)")
def test_from_inventory_reads_what_ansible_inventory_resolves(lab_inventory):
    """Ansible's API on the recorded inventory's source gives the hosts, groups and values ansible-inventory gave."""
    live = Fleet.from_inventory(FIXTURES / "inventory_lab3" / "hosts.ini")
    recorded = Fleet.from_inventory_json(lab_inventory)
    assert set(live.hosts) == set(recorded.hosts)
    for name, host in recorded.hosts.items():
        assert {k: live.hosts[name].var(k) for k in host.vars} == {k: host.var(k) for k in host.vars}
        assert (live.hosts[name].address, live.hosts[name].port) == (host.address, host.port)
    assert {g: live.groups[g] for g in recorded.groups} == recorded.groups


def test_a_missing_inventory_is_named(tmp_path):
    with pytest.raises(UserError, match=f"inventory not found \\({tmp_path}/hosts.ini\\)"):
        Fleet.from_inventory(tmp_path / "hosts.ini")


def test_nested_groups_and_hosts_without_vars():
    """Children groups count as members; a host with no vars (absent from _meta) is still a host."""
    data = {
        "all": {"children": ["ungrouped", "llamafleet"]},
        "llamafleet": {"children": ["llamafleet_orchestrator", "llamafleet_workers"]},
        "llamafleet_orchestrator": {"hosts": ["a"]},
        "llamafleet_workers": {"hosts": ["b", "c"], "children": ["gpus"]},
        "gpus": {"hosts": ["d", "b"]},
        "_meta": {"hostvars": {"a": {"ansible_host": "10.0.0.1"}}},
    }
    fleet = Fleet.from_inventory_json(data)
    assert group_members(data, "llamafleet") == ["a", "b", "c", "d"]
    assert sorted(fleet.hosts) == ["a", "b", "c", "d"]
    assert fleet.hosts["d"].address == "d"  # ansible_host defaults to the name, as in Ansible
    assert [w.name for w in fleet.workers] == ["b", "c", "d"]


def test_cyclic_groups_terminate():
    data = {"x": {"hosts": ["h"], "children": ["y"]}, "y": {"children": ["x"], "hosts": ["i"]}}
    assert group_members(data, "x") == ["h", "i"]


@pytest.mark.parametrize(
    ("args", "value"),
    [
        ("-o UserKnownHostsFile=/k/hosts -o StrictHostKeyChecking=yes", "/k/hosts"),
        ("-oUserKnownHostsFile=/k/h2", "/k/h2"),
        ("-o userknownhostsfile=/lower", "/lower"),
        ("-o StrictHostKeyChecking=yes", None),
        ("", None),
    ],
)
def test_ssh_option(args, value):
    assert _ssh_option(args, "UserKnownHostsFile") == value


# Host variables

@pytest.mark.parametrize(
    ("vars_", "default", "expected"),
    [({"p": 8181}, 8080, 8181), ({}, 8080, 8080), ({"p": ""}, 8080, 8080), ({"p": None}, 8080, 8080),
     ({"p": 0}, 8080, 0), ({"p": False}, True, False)],
)
def test_host_var_falls_back_to_the_role_default(vars_, default, expected):
    assert Host("h", "h", vars=vars_).var("p", default) == expected


def test_host_var_refuses_an_untemplated_jinja_value():
    host = Host("lab1", "10.0.0.1", vars={"llama_server_bind_address": "{{ llamafleet_cluster_address }}"})
    with pytest.raises(UserError, match="lab1: llama_server_bind_address is a Jinja expression"):
        host.var("llama_server_bind_address")


def test_cluster_address_prefers_the_cluster_variable():
    assert Host("h", "192.168.1.5", vars={"llamafleet_cluster_address": "10.0.0.5"}).cluster_address == "10.0.0.5"
    assert Host("h", "192.168.1.5").cluster_address == "192.168.1.5"


# Host selection

def test_workers_follow_the_orchestrators_workers_group():
    fleet = fleet_of(
        {constants.GROUP_ORCHESTRATOR: ["o"], constants.GROUP_WORKERS: ["w1"], "gpu_boxes": ["g1", "g2"]},
        {"o": {"llama_server_workers_group": "gpu_boxes"}},
    )
    assert fleet.workers_group == "gpu_boxes"
    assert [w.name for w in fleet.workers] == ["g1", "g2"]
    assert [h.name for h in fleet.members()] == ["g1", "g2", "o"]  # w1 is in no group deploy.yml uses here


def test_no_orchestrator_is_a_user_error_naming_the_group():
    fleet = fleet_of({constants.GROUP_WORKERS: ["w1"]})
    with pytest.raises(UserError, match=constants.GROUP_ORCHESTRATOR):
        _ = fleet.orchestrator
    assert fleet.workers_group == constants.GROUP_WORKERS


# Running commands

def test_run_reaches_every_host_at_the_same_time(connector):
    """Four hosts that each wait for all four: only a parallel run gets through the barrier."""
    barrier = threading.Barrier(4, timeout=5)

    def answer(host, command):
        barrier.wait()
        return 0, f"{host.name}:{command}\n", ""

    conn = connector(answer)
    fleet = fleet_of({"g": ["a", "b", "c", "d"]}, connect=conn)
    results = fleet.run("uptime")
    assert isinstance(results, GroupResult)
    assert {n: r.stdout for n, r in results.items()} == {n: f"{n}:uptime\n" for n in "abcd"}
    assert not results.failed and sorted(results.succeeded) == list("abcd")


def test_run_collects_failures_per_host(connector):
    def answer(host, command):
        if host.name == "down":
            raise TimeoutError("timed out")
        if host.name == "bad":
            return 3, "", "no such unit\n"
        return 0, "ok\n", ""

    fleet = fleet_of({"g": ["up", "down", "bad"]}, connect=connector(answer))
    results = fleet.run("true")
    assert results["up"].ok and results["up"].stdout == "ok\n"
    assert results["down"] == RunResult("down", False, error="timed out after 10 s (down port 22)")
    assert (results["bad"].ok, results["bad"].exit_code) == (False, 3)
    assert results["bad"].reason == "no such unit"
    assert sorted(results.failed) == ["bad", "down"]


def test_run_writes_a_command_per_host(connector):
    conn = connector(lambda host, command: (0, command, ""))
    fleet = fleet_of({"g": ["a", "b"]}, {"a": {"x": "1"}, "b": {"x": "2"}}, connect=conn)
    results = fleet.run(lambda h: f"echo {h.var('x')}")
    assert {n: r.stdout for n, r in results.items()} == {"a": "echo 1", "b": "echo 2"}


def test_a_command_that_cannot_be_written_fails_only_its_host(connector):
    conn = connector(lambda host, command: (0, command, ""))
    fleet = fleet_of({"g": ["a", "b"]}, {"b": {"x": "{{ nope }}"}}, connect=conn)
    results = fleet.run(lambda h: f"echo {h.var('x', 'default')}")
    assert results["a"].stdout == "echo default"
    assert not results["b"].ok and "Jinja" in results["b"].error
    assert [c[0] for c in conn.calls] == ["a"]  # nothing was run on b


def test_run_on_no_host_is_empty(connector):
    assert fleet_of({}, connect=connector(lambda h, c: (0, "", ""))).run("true", []) == {}


def test_run_one_returns_stdout_or_names_the_host(connector):
    fleet = fleet_of({"g": ["a"]}, connect=connector(lambda h, c: (0, "42\n", "") if c == "ok" else (1, "", "boom")))
    assert fleet.run_one("ok", fleet.hosts["a"]) == "42\n"
    with pytest.raises(UserError, match=r"^a: reading the answer: boom$"):
        fleet.run_one("fail", fleet.hosts["a"], what="reading the answer")



# SSH against a real server: host keys and become

class SSHServer:
    """An SSH server on 127.0.0.1 (paramiko) that runs each exec request with this machine's ``sh``.

    It accepts the client key ``client_key`` only.  A ``sudo -n ... -- sh -c LINE`` request runs LINE;
    a fabric ``sudo -S -p PROMPT ... sh -c LINE`` request prints PROMPT (stderr) and runs LINE only when the line
    read back is ``sudo_password`` (else says ``Sorry, try again.``).  ``commands`` records what came.
    """

    def __init__(self, host_key, client_key, sudo_password: str = ""):
        import paramiko

        self.host_key, self.client_key, self.sudo_password = host_key, client_key, sudo_password
        self.commands: list[str] = []
        self.forwarded: list[tuple[str, int]] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.paramiko = paramiko
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self.session, args=(client,), daemon=True).start()

    def session(self, client: socket.socket) -> None:
        paramiko, server = self.paramiko, self
        exec_event, requested, forwards = threading.Event(), [], {}

        class Interface(paramiko.ServerInterface):
            def get_allowed_auths(self, username):
                return "publickey"

            def check_auth_publickey(self, username, key):
                return paramiko.AUTH_SUCCESSFUL if key == server.client_key else paramiko.AUTH_FAILED

            def check_channel_request(self, kind, chanid):
                return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

            def check_channel_direct_tcpip_request(self, chanid, origin, destination):
                forwards[chanid] = destination  # a jump host's forward (ssh -J)
                server.forwarded.append(destination)
                return paramiko.OPEN_SUCCEEDED

            def check_channel_exec_request(self, channel, command):
                requested.append(command.decode())
                exec_event.set()
                return True

        transport = paramiko.Transport(client)
        transport.add_server_key(self.host_key)
        try:
            transport.start_server(server=Interface())
            channel = transport.accept(5)
            if channel is not None and channel.get_id() in forwards:
                self.relay(channel, forwards[channel.get_id()])
                return
            if channel is None or not exec_event.wait(5):
                return
            self.commands.append(requested[0])
            rc, out, err = self.answer(channel, requested[0])
            channel.sendall(out.encode())
            channel.sendall_stderr(err.encode())
            channel.send_exit_status(rc)
            channel.close()
        except (EOFError, OSError, paramiko.SSHException):
            pass
        finally:
            time.sleep(0.05)
            transport.close()

    @staticmethod
    def relay(channel, destination) -> None:
        """Copy bytes both ways between a direct-tcpip channel and a TCP connection to ``destination``."""
        upstream = socket.create_connection(destination, timeout=5)

        def pump(read, write):
            try:
                while True:
                    data = read(65536)
                    if not data:
                        break
                    write(data)
            except OSError:
                pass

        back = threading.Thread(target=pump, args=(upstream.recv, channel.sendall), daemon=True)
        back.start()
        pump(channel.recv, upstream.sendall)
        back.join(5)
        upstream.close()

    def answer(self, channel, command: str) -> tuple[int, str, str]:
        argv = shlex.split(command)
        if argv[:1] == ["sudo"]:
            if "-S" in argv:
                channel.sendall_stderr(argv[argv.index("-p") + 1].encode())  # sudo -S prompts on stderr
                typed = b""
                while not typed.endswith(b"\n"):
                    typed += channel.recv(1)
                if typed.decode().rstrip("\n") != self.sudo_password:
                    return 1, "", "Sorry, try again.\n"
            argv = argv[argv.index("sh"):]
        proc = subprocess.run(argv if argv[0] == "sh" else ["sh", "-c", command], capture_output=True, text=True,
                              timeout=10, check=False)
        return proc.returncode, proc.stdout, proc.stderr

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(2)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two host keys (the server's and another of the same type) and a client key with its file."""
    require(importlib.util.find_spec("paramiko"), "the Python package paramiko")
    import paramiko

    client = paramiko.ECDSAKey.generate()
    key_file = tmp_path_factory.mktemp("ssh") / "id_ecdsa"
    client.write_private_key_file(str(key_file))
    return SimpleNamespace(host=paramiko.ECDSAKey.generate(), other=paramiko.ECDSAKey.generate(),
                           client=client, client_file=str(key_file))


@pytest.fixture
def ssh(keys, closing, tmp_path, monkeypatch):
    """``ssh(known_hosts_lines, **host_vars)``: a Fleet of one host, ``h``, served by an SSHServer.

    The known_hosts lines are written to a file the inventory names; HOME points at an empty
    directory so that the user's own known_hosts files play no part.
    """
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLAMAFLEET_SSH_INSECURE", raising=False)

    def make(lines, sudo_password="", user="root", **hostvars):
        server = closing(SSHServer(keys.host, keys.client, sudo_password))
        known = tmp_path / "known_hosts"
        known.write_text("".join(f"{line}\n" for line in lines(server.port)), encoding="utf-8")
        hostvars = {"ansible_host": "127.0.0.1", "ansible_port": server.port, "ansible_user": user,
                    "ansible_ssh_private_key_file": keys.client_file,
                    "ansible_ssh_common_args": f"-o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes",
                    **hostvars}
        return SimpleNamespace(fleet=fleet_of({"g": ["h"]}, {"h": hostvars}), server=server, known=known)

    return make


def entry(name: str, key) -> str:
    return f"{name} {key.get_name()} {key.get_base64()}"


def test_a_known_host_key_is_accepted(ssh, keys):
    s = ssh(lambda port: [entry("[127.0.0.2]:1", keys.other), entry(f"[127.0.0.1]:{port}", keys.host)])
    res = s.fleet.run("echo $((6 * 7))", timeout=10)["h"]
    assert (res.ok, res.stdout, res.error) == (True, "42\n", None)
    assert s.server.commands == ["echo $((6 * 7))"]


def test_a_hashed_known_hosts_entry_is_accepted(ssh, keys):
    from paramiko import HostKeys

    s = ssh(lambda port: [entry(HostKeys.hash_host(f"[127.0.0.1]:{port}"), keys.host)])
    assert s.known.read_text().startswith("|1|")
    assert s.fleet.run("echo ok", timeout=10)["h"].stdout == "ok\n"


def test_an_unknown_host_key_is_refused_and_the_message_says_what_to_do(ssh, keys):
    s = ssh(lambda port: [entry("127.0.0.1", keys.host), entry(f"[127.0.0.1]:{port + 1}", keys.host)])
    res = s.fleet.run("echo ok", timeout=10)["h"]
    port = s.server.port
    assert not res.ok and res.error.startswith(f"h (127.0.0.1 port {port}): unknown SSH host key "
                                               f"{keys.host.get_name()} {keys.host.fingerprint}; ")
    assert f"known_hosts files read: {s.known}, /etc/ssh/ssh_known_hosts" in res.error
    assert f"ssh-keyscan -p {port} 127.0.0.1 >> ~/.ssh/known_hosts" in res.error
    assert "UserKnownHostsFile" in res.error and "StrictHostKeyChecking" not in res.error
    assert s.server.commands == []  # nothing ran
    assert s.known.read_text().count("\n") == 2  # and nothing was added


def test_a_changed_host_key_is_refused(ssh, keys):
    s = ssh(lambda port: [entry(f"[127.0.0.1]:{port}", keys.other)])
    res = s.fleet.run("echo ok", timeout=10)["h"]
    assert not res.ok and "the SSH host key has CHANGED" in res.error
    assert f"presents {keys.host.get_name()} {keys.host.fingerprint}, known_hosts has " \
           f"{keys.other.get_name()} {keys.other.fingerprint}" in res.error
    assert f"ssh-keygen -R '[127.0.0.1]:{s.server.port}'" in res.error
    assert s.server.commands == []


def test_the_inventory_cannot_turn_checking_off_but_the_environment_can(ssh, keys, monkeypatch, capsys):
    s = ssh(lambda port: [], ansible_ssh_common_args="-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null")
    res = s.fleet.run("echo ok", timeout=10)["h"]
    assert not res.ok and "unknown SSH host key" in res.error
    assert "StrictHostKeyChecking=no is not honoured" in res.error and "/dev/null" in res.error
    monkeypatch.setenv("LLAMAFLEET_SSH_INSECURE", "1")
    assert s.fleet.run("echo ok", timeout=10)["h"].stdout == "ok\n"
    assert f"host key {keys.host.get_name()} {keys.host.fingerprint} NOT checked" in capsys.readouterr().err


def test_the_users_known_hosts_serves_when_the_inventory_names_none(ssh, keys, tmp_path):
    s = ssh(lambda port: [], ansible_ssh_common_args="")
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / ".ssh" / "known_hosts").write_text(entry(f"[127.0.0.1]:{s.server.port}", keys.host) + "\n")
    assert s.fleet.run("echo ok", timeout=10)["h"].stdout == "ok\n"


@pytest.mark.parametrize(
    ("hostvars", "password", "ran", "outcome"),
    [
        ({}, "", "id -u", "ok"),
        ({"ansible_become": True}, "", "id -u", "ok"),  # root needs no sudo to become root
        ({"ansible_become": "yes"}, "", "sudo -n -H -u root -- sh -c 'id -u'", "ok"),
        ({"ansible_become": "true", "ansible_become_password": "pw"}, "pw",
         "sudo -S -p '[sudo] password: ' -H -u root sh -c 'id -u'", "ok"),
        ({"ansible_become": True, "ansible_become_pass": "wrong"}, "pw",
         "sudo -S -p '[sudo] password: ' -H -u root sh -c 'id -u'", "AuthFailure"),
        ({"ansible_become": True, "ansible_become_user": "deploy"}, "", "id -u", "ok"),  # already that user
        ({"ansible_become": False, "ansible_become_password": "pw"}, "", "id -u", "ok"),
        ({"ansible_become": True, "ansible_become_method": "su"}, "", None, "ansible_become_method=su"),
    ],
)
def test_become_from_the_inventory_runs_commands_through_sudo(ssh, keys, hostvars, password, ran, outcome):
    s = ssh(lambda port: [entry(f"[127.0.0.1]:{port}", keys.host)], sudo_password=password,
            user="root" if hostvars.get("ansible_become") is True and len(hostvars) == 1 else "deploy", **hostvars)
    res = s.fleet.run("id -u", timeout=10)["h"]
    assert s.server.commands == ([ran] if ran else [])
    if outcome == "ok":
        assert res.ok and res.stdout.strip().isdigit()
    else:
        assert not res.ok and outcome in res.error


# Reached as ansible would: through a jump host, and in words when it cannot be

def test_a_host_behind_a_jump_host_from_the_ssh_arguments_and_the_ssh_config(ssh, keys, closing, tmp_path):
    """-J jumpbox: ``jumpbox`` is an ssh config alias (its address, port, user and key); the jump host forwards."""
    jump = closing(SSHServer(keys.host, keys.client))
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / ".ssh" / "config").write_text(
        f"Host jumpbox\n    HostName 127.0.0.1\n    Port {jump.port}\n    User root\n"
        f"    IdentityFile {keys.client_file}\n")
    s = ssh(lambda port: [entry(f"[127.0.0.1]:{port}", keys.host), entry(f"[127.0.0.1]:{jump.port}", keys.host)],
            ansible_ssh_common_args=f"-o UserKnownHostsFile={tmp_path / 'known_hosts'} -J jumpbox")
    host = s.fleet.hosts["h"]
    assert [(j.spec, j.address, j.port, j.user) for j in host.jumps] == [("jumpbox", "127.0.0.1", jump.port, "root")]
    res = s.fleet.run("echo via", timeout=10)["h"]
    assert (res.ok, res.stdout) == (True, "via\n"), res.error
    assert jump.forwarded == [("127.0.0.1", s.server.port)] and jump.commands == []
    assert s.server.commands == ["echo via"]


def test_a_jump_host_that_is_down_is_named(ssh, keys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    s = ssh(lambda port: [entry(f"[127.0.0.1]:{port}", keys.host)],
            ansible_ssh_common_args=f"-J root@127.0.0.1:{closed}")
    res = s.fleet.run("echo ok", timeout=10)["h"]
    assert res.error == f"jump host 127.0.0.1: connection refused on port {closed} (127.0.0.1)"
    assert s.server.commands == []


def test_a_refused_key_is_an_authentication_failure_for_the_user(ssh, keys, tmp_path):
    import paramiko

    other = tmp_path / "id_other"
    paramiko.ECDSAKey.generate().write_private_key_file(str(other))
    s = ssh(lambda port: [entry(f"[127.0.0.1]:{port}", keys.host)], user="deploy",
            ansible_ssh_private_key_file=str(other))
    res = s.fleet.run("echo ok", timeout=10)["h"]
    assert res.error == f"authentication failed for user deploy (127.0.0.1 port {s.server.port}; key files: {other})"
