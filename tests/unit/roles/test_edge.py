"""The edge role's HAProxy configuration, rendered by a real ansible-playbook run from the role's template and
defaults, run by Debian's haproxy on loopback in front of a stand-in gate that records what reaches it, and attacked
by the hostile suite (llamafleet.bench.hostile): every case answered as expected, no keyless request behind the edge,
one address's 1,000 trickling connections leave another served within 1 s, and the edge's cost on loopback; and
the role's configure.yml run into a temporary root: its two host_files runs and which handler each change calls."""

from __future__ import annotations

import grp
import http.client
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from llamafleet.bench import hostile
from llamafleet.core import constants, http_wire
from tests.unit.needs import require

REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
KEY = "k3y-Of-The-Edge-0123456789"
HEAD_TIMEOUT = 2
MAX_BODY = 65536
RATE = 400

PLAY = """\
- name: Render the edge's configuration
  hosts: localhost
  gather_facts: false
  vars_files: [{defaults}]
  tasks:
    - name: The role's template, checked by haproxy -c as the role installs it
      ansible.builtin.template:
        src: {template}
        dest: {dest}
        mode: "0600"
        validate: haproxy -c -f %s
"""


class Gate(BaseHTTPRequestHandler):
    """A stand-in for the serving gate: records each request's path and Authorization, answers 200; what the real
    gate's parser would refuse in the head HAProxy sent goes to ``refused``."""

    protocol_version = "HTTP/1.1"
    # the head and body in one write, at once (no delayed-ACK stall that would hide the edge's cost)
    wbufsize = 65536
    disable_nagle_algorithm = True
    seen: list[tuple[str, str | None, str | None]] = []
    refused: list[str] = []

    def _answer(self) -> None:
        head = self.raw_requestline + b"".join(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                                               for name, value in self.headers.items()) + b"\r\n"
        try:
            http_wire.request_body(http_wire.parse_request_head(head))
        except http_wire.HeadError as exc:
            Gate.refused.append("%s: %r" % (exc.message, head))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        Gate.seen.append((self.path, self.headers.get("Authorization"), self.headers.get("X-Forwarded-For")))
        body = b'{"data":[]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_POST = do_HEAD = do_OPTIONS = _answer

    def log_message(self, *args: object) -> None:
        pass


class GateServer(ThreadingHTTPServer):
    """The stand-in gate's server: HAProxy closing an idle pooled connection with a reset is not an error here."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("nothing listens on 127.0.0.1:%d" % port)


def run_play(tmp: Path, play: str, values: dict) -> str:
    """``play`` run by ansible-playbook on localhost with ``values`` as extra vars; its output."""
    (tmp / "values.json").write_text(json.dumps(values), encoding="utf-8")
    (tmp / "play.yml").write_text(play, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", "ansible_python_interpreter=" + sys.executable, "-e", "@" + str(tmp / "values.json"),
                           str(tmp / "play.yml")], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def render(tmp: Path, values: dict) -> Path:
    """The role's template rendered with the role's defaults and ``values`` by ansible-playbook."""
    dest = tmp / "haproxy.cfg"
    run_play(tmp, PLAY.format(defaults=REPO / "roles/edge/defaults/main.yml",
                              template=REPO / "roles/edge/templates/haproxy.cfg.j2", dest=dest), values)
    return dest


# What the edge role (edge_kind) and the llama_server role (the gate on loopback behind the edge) decide from the
# inventory's llamafleet_edge, each from its own files, as ansible-playbook templates them: unset, and each value.
KIND_PLAY = """\
- name: What the two roles make of llamafleet_edge
  hosts: localhost
  gather_facts: false
  vars_files: [{edge}, {llama_server}]
  tasks:
{tasks}
"""
KIND_TASK = """\
    - name: {name}
      ansible.builtin.debug:
        msg: "EDGE {name} {{{{ edge_kind }}}} {{{{ _llama_server_edge | bool }}}} {{{{ edge_gate_port }}}} {{{{ edge_port }}}}"
      vars: {values}
"""


def test_the_edge_is_on_by_default_in_both_roles_and_none_turns_it_off(tmp_path: Path) -> None:
    """With no llamafleet_edge in the inventory, HAProxy serves the clients' port and the gate sits behind it on
    loopback (the constant edge_kind, which both roles read); ``none`` is the opt-out of both. Fails if the
    default goes back to none, or if the two roles stop agreeing."""
    cases = {"unset": {}, "haproxy": {"llamafleet_edge": "haproxy"}, "none": {"llamafleet_edge": "none"}}
    tasks = "".join(KIND_TASK.format(name=name, values=json.dumps(values)) for name, values in cases.items())
    out = run_play(tmp_path, KIND_PLAY.format(edge=REPO / "roles/edge/defaults/main.yml",
                                              llama_server=REPO / "roles/llama_server/vars/main.yml", tasks=tasks), {})
    seen = dict(match.groups() for match in re.finditer(r"EDGE (\w+) ([^\"\n]+)", out))
    # the ports the edge takes from the llama_server role's defaults (the constants) when the inventory sets none
    assert (constants.LLAMA_SERVER_GATE_PORT, constants.LLAMA_SERVER_PORT) == (18081, 8080)
    assert seen == {"unset": "haproxy True 18081 8080", "haproxy": "haproxy True 18081 8080",
                    "none": "none False 18081 8080"}, out
    assert constants.EDGE_KIND == "haproxy" and constants.EDGE_KINDS == ("haproxy", "none")


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory):
    require(shutil.which("haproxy"), "Debian's haproxy package (apt-get install haproxy)")
    tmp = tmp_path_factory.mktemp("edge")
    (tmp / "api-key").write_text(KEY + "\n", encoding="utf-8")
    gate = GateServer(("127.0.0.1", 0), Gate)
    threading.Thread(target=gate.serve_forever, daemon=True).start()
    port = free_port()
    values = {"edge_bind_address": "127.0.0.1", "edge_port": port, "edge_gate_port": gate.server_address[1],
              "_edge_tls_pem": "", "_edge_key_pattern_file": str(tmp / "api-key"),
              "edge_max_body_bytes": MAX_BODY, "edge_timeout_head": "%ds" % HEAD_TIMEOUT,
              "edge_max_requests_per_address": RATE, "edge_maxconn": 4000,
              "edge_log_target": "stderr format raw", "edge_drop_privileges": False}
    config = render(tmp, values)
    log = (tmp / "haproxy.log").open("w")
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        yield {"port": port, "gate": gate, "log": tmp / "haproxy.log", "config": config}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        gate.shutdown()


def keyed_get(port: int, path: str = "/v1/models", source: str = "") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0) if source else None)
    try:
        conn.request("GET", path, headers={"Authorization": "Bearer " + KEY})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_config_keeps_secrets_out(edge) -> None:
    text = edge["config"].read_text(encoding="utf-8")
    assert KEY not in text
    assert "timeout http-request %ds" % HEAD_TIMEOUT in text and "option forwardfor" in text


def test_hostile_suite(edge) -> None:
    Gate.seen.clear()
    Gate.refused.clear()
    endpoint = hostile.Endpoint("127.0.0.1", edge["port"])
    # four at a time, as the lab's e2e test sends them (the slow senders wait together)
    results = hostile.run_suite(endpoint, KEY, "127.0.0.1:%d" % edge["port"], MAX_BODY, HEAD_TIMEOUT + 2, workers=4)
    print(hostile.table(results))
    assert len(results) >= 100
    assert [r.case.name for r in results if not r.ok] == []
    # behind the edge: only the control cases, each with the key but keyless /health, and the edge's X-Forwarded-For
    controls = [r.case for r in results if r.case.backend]
    assert len(Gate.seen) == len(controls), Gate.seen
    for path, auth, forwarded in Gate.seen:
        # in the form llama-server matches ("Bearer " as written), whatever case the client sent
        assert path == "/health" or auth == "Bearer " + KEY, (path, auth)
        assert forwarded == "127.0.0.1"
    assert keyed_get(edge["port"]) == 200
    # what the edge lets through, the gate's own parser takes (one Host, ASCII Content-Length)
    assert Gate.refused == []


@pytest.mark.parametrize(("raw", "status"), [
    (b"GET /health HTTP/1.0\r\n\r\n", 200), (b"GET /health HTTP/1.0\r\nUser-Agent: probe\r\n\r\n", 200),
    (b"GET /health HTTP/1.1\r\nHost: gate\r\nConnection: close\r\n\r\n", 200),
    (b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n", 400),
    (b"POST /health HTTP/1.1\r\nHost: gate\r\nContent-Length: \xb2\r\nConnection: close\r\n\r\nx", 400),
])
def test_host_and_length_at_the_edge_and_the_gate(edge, raw: bytes, status: int) -> None:
    """HTTP/1.0 probes without Host are served by the edge and the gate alike; HTTP/1.1 without one Host, or a
    Content-Length other than digits, gets 400 at the edge and never reaches the gate."""
    Gate.seen.clear()
    Gate.refused.clear()
    with socket.create_connection(("127.0.0.1", edge["port"]), timeout=5) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.split(b" ", 2)[1] == str(status).encode(), data
    assert (len(Gate.seen), Gate.refused) == ((1, []) if status == 200 else (0, []))


def test_forwarded_for_is_the_edges(edge) -> None:
    Gate.seen.clear()
    conn = http.client.HTTPConnection("127.0.0.1", edge["port"], timeout=5, source_address=("127.0.0.9", 0))
    conn.request("GET", "/v1/models", headers={"Authorization": "Bearer " + KEY, "X-Forwarded-For": "10.6.6.6"})
    assert conn.getresponse().status == 200
    conn.close()
    assert Gate.seen[-1][2] == "127.0.0.9"


def test_flood_from_one_address_leaves_another_served(edge) -> None:
    attacker = hostile.Endpoint("127.0.0.1", edge["port"], source="127.0.0.2")
    client = hostile.Endpoint("127.0.0.1", edge["port"], source="127.0.0.3")
    report = hostile.flood(attacker, client, KEY, connections=1000, probes=10, deadline=1.0, hold=5.0)
    print("flood:", report)
    assert report["ok"], report
    assert keyed_get(edge["port"], source="127.0.0.2") in (200, 429)


def test_probes_only_prints_the_other_addresses_report(edge, tmp_path: Path, capsys) -> None:
    """The lab's flood test runs the probes on another host with --probes-only: their report as JSON, exit 0 when
    each keyed probe was served within 1 s, 1 with a wrong key."""
    (tmp_path / "key").write_text(KEY + "\n", encoding="utf-8")
    url = "http://127.0.0.1:%d" % edge["port"]
    assert hostile.main([url, "--key-file", str(tmp_path / "key"), "--probes-only", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["probes"], report["served_in_time"], report["statuses"], report["ok"]) == (2, 2, [200, 200], True)
    (tmp_path / "key").write_text("not-the-key-0123456789\n", encoding="utf-8")
    assert hostile.main([url, "--key-file", str(tmp_path / "key"), "--probes-only", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["statuses"] == [401]


def test_request_rate_per_address(edge) -> None:
    statuses = [keyed_get(edge["port"], source="127.0.0.4") for _index in range(RATE + 20)]
    assert statuses[:RATE] == [200] * RATE
    assert 429 in statuses[RATE:]
    assert keyed_get(edge["port"], source="127.0.0.5") == 200


def test_access_log_has_the_address_and_no_key(edge) -> None:
    keyed_get(edge["port"], "/v1/models?probe=1", source="127.0.0.6")
    time.sleep(0.2)
    text = edge["log"].read_text(encoding="utf-8", errors="replace")
    assert "127.0.0.6:" in text and '"/v1/models"' in text
    assert KEY not in text and "probe=1" not in text


def requests_per_second(port: int, count: int = 400) -> tuple[float, float]:
    """Sequential keyed GETs on one keep-alive connection: requests/s and the median latency (ms)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=("127.0.0.7", 0))
    times = []
    for _index in range(count):
        started = time.perf_counter()
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer " + KEY})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        times.append(time.perf_counter() - started)
    conn.close()
    times.sort()
    return count / sum(times), times[len(times) // 2] * 1000


def test_edge_cost(edge) -> None:
    direct = requests_per_second(edge["gate"].server_address[1], RATE // 2)
    through = requests_per_second(edge["port"], RATE // 2)
    print("loopback, one keep-alive connection: gate alone %.0f req/s (median %.2f ms), through haproxy %.0f req/s "
          "(median %.2f ms): +%.2f ms a request" % (direct + through + (through[1] - direct[1],)))
    assert through[1] - direct[1] < 5.0


def test_gate_not_answering_gets_a_json_503(tmp_path: Path) -> None:
    require(shutil.which("haproxy"), "Debian's haproxy package (apt-get install haproxy)")
    port = free_port()
    config = render(tmp_path, {"edge_bind_address": "127.0.0.1", "edge_port": port, "edge_gate_port": free_port(),
                               "_edge_tls_pem": "", "_edge_key_pattern_file": "", "edge_maxconn": 1000,
                               "edge_log_target": "stderr format raw", "edge_drop_privileges": False})
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert (resp.status, body["error"]["code"], resp.getheader("Retry-After")) == (503, 503, "5")
        assert "gate does not answer" in body["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_tls_h2_and_keepalive(tmp_path: Path) -> None:
    require(shutil.which("haproxy") and shutil.which("openssl") and shutil.which("curl"), "Debian's haproxy, openssl, curl")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=edge",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")], check=True,
                   capture_output=True)
    pem = tmp_path / "edge.pem"
    pem.write_bytes((tmp_path / "cert.pem").read_bytes() + (tmp_path / "key.pem").read_bytes())
    (tmp_path / "api-key").write_text(KEY + "\n", encoding="utf-8")
    Gate.refused.clear()
    gate = GateServer(("127.0.0.1", 0), Gate)
    threading.Thread(target=gate.serve_forever, daemon=True).start()
    port = free_port()
    config = render(tmp_path, {"edge_bind_address": "127.0.0.1", "edge_port": port,
                               "edge_gate_port": gate.server_address[1], "_edge_tls_pem": str(pem),
                               "_edge_key_pattern_file": str(tmp_path / "api-key"), "edge_maxconn": 1000,
                               "edge_log_target": "stderr format raw", "edge_drop_privileges": False})
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        context.check_hostname = False
        context.set_alpn_protocols(["h2", "http/1.1"])
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="edge") as sock:
            assert sock.selected_alpn_protocol() == "h2"
        context.set_alpn_protocols(["http/1.1"])
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
        first = None
        for path, status in [("/v1/models", 200), ("/health", 200), ("/llamafleet/metrics", 401), ("/v1/models", 200)]:
            conn.request("GET", path, headers={"Authorization": "Bearer " + KEY} if status == 200 and path != "/health"
                         else {})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == status, path
            first = first or conn.sock
        assert conn.sock is first  # one connection served them all (keep-alive)
        conn.close()
        # 1,000 connections stuck in their TLS handshake from one address; another is served within 1 s
        report = hostile.flood(hostile.Endpoint("127.0.0.1", port, True, source="127.0.0.2"),
                               hostile.Endpoint("127.0.0.1", port, True, source="127.0.0.3"),
                               KEY, connections=1000, probes=5, deadline=1.0, hold=3.0, host="edge")
        print("TLS flood:", report)
        assert report["ok"], report
        # a request over HTTP/2 (curl with nghttp2), with and without the key
        (tmp_path / "auth").write_text("Authorization: Bearer %s\n" % KEY, encoding="utf-8")
        url = "https://127.0.0.1:%d/v1/models" % port
        for extra, expected in [(["-H", "@" + str(tmp_path / "auth")], "2 200"), ([], "2 401")]:
            out = subprocess.run(["curl", "-sS", "--http2", "--cacert", str(tmp_path / "cert.pem"), "--resolve",
                                  "edge:%d:127.0.0.1" % port, "-o", "/dev/null", "-w", "%{http_version} %{http_code}",
                                  *extra, url.replace("127.0.0.1", "edge")], capture_output=True, text=True,
                                 check=True, timeout=10)
            assert out.stdout == expected, out
        # HTTP/2 turned into HTTP/1.1 by the edge: a head the gate's parser takes (Host from :authority)
        assert Gate.refused == []
    finally:
        proc.terminate()
        proc.wait(10)
        gate.shutdown()


# The role's own configure.yml (a copy of the role whose handlers print instead of touching haproxy.service) run by
# ansible-playbook on this machine into a temporary root, through three deploys: the first, a converged one, and a new
# key with TLS turned off.
CONFIGURE_PLAY = """\
- name: The edge role's configure.yml
  hosts: localhost
  gather_facts: false
  tasks:
{steps}
    - name: Save what changed
      ansible.builtin.copy:
        content: "{{{{ changed_by_step | to_json }}}}"
        dest: {report}
        mode: "0600"
"""
CONFIGURE_STEP = """\
    - name: Step {name}
      ansible.builtin.debug:
        msg: "STEP {name}"

    - name: Change a file by hand before step {name}
      ansible.builtin.copy:
        content: "{{{{ item.content }}}}"
        dest: "{{{{ item.dest }}}}"
        mode: "0600"
      loop: {edits}
      loop_control:
        label: "{{{{ item.dest }}}}"

    - name: Configure ({name})
      ansible.builtin.include_role:
        name: edge
        tasks_from: configure
      vars: {values}

    - name: Apply ({name})
      ansible.builtin.meta: flush_handlers

    - name: Note what changed ({name})
      ansible.builtin.set_fact:
        changed_by_step: >-
          {{{{ changed_by_step | default({{}})
             | combine({{'{name}': __edge_secret_files.changed_paths + __edge_files.changed_paths}}) }}}}
"""


def _role_with_printing_handlers(tmp: Path) -> None:
    """roles/edge copied under ``tmp``, its handlers' reload and restart calls replaced by a debug line naming the handler (their
    ``when`` kept as written)."""
    shutil.copytree(REPO / "roles/edge", tmp / "roles/edge")
    handlers = yaml.safe_load((REPO / "roles/edge/handlers/main.yml").read_text(encoding="utf-8"))
    for handler in handlers:
        call = handler.pop("llamafleet.cluster.edge_reload", None) or handler.pop("ansible.builtin.systemd_service")
        assert call.get("unit", call.get("name")) == "haproxy.service"
        handler["ansible.builtin.debug"] = {"msg": "HANDLER-RUN " + handler["name"]}
    (tmp / "roles/edge/handlers/main.yml").write_text(yaml.safe_dump(handlers), encoding="utf-8")


def test_configure_installs_in_two_runs_and_notifies_by_path(tmp_path: Path) -> None:
    """Key and certificate in place before haproxy -c checks the configuration (a first run would fail otherwise),
    owners and modes as the role's README says, a new drop-in restarting HAProxy without a reload as well, a converged
    run changing nothing and calling no handler, a new key reloading alone, TLS turned off removing the certificate's
    copy."""
    require(shutil.which("haproxy") and shutil.which("openssl"), "Debian's haproxy and openssl")
    if os.geteuid() != 0:
        pytest.skip("installs files owned by root and the haproxy group")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=edge",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")], check=True,
                   capture_output=True)
    (tmp_path / "api-key").write_text(" " + KEY + "\n\n", encoding="utf-8")
    _role_with_printing_handlers(tmp_path)
    root = tmp_path / "root"
    config_dir, dropin_dir = root / "llamafleet", root / "haproxy.service.d"
    tls = {"edge_tls_cert": str(tmp_path / "cert.pem"), "edge_tls_key": str(tmp_path / "key.pem")}
    no_tls = {"edge_tls_cert": "", "edge_tls_key": ""}
    steps = [("first", [], tls), ("converged", [], tls),
             ("key-and-tls-off", [{"dest": str(tmp_path / "api-key"), "content": KEY + "2\n"}], no_tls)]
    play = CONFIGURE_PLAY.format(report=tmp_path / "changed.json", steps="\n".join(
        CONFIGURE_STEP.format(name=name, edits=json.dumps(edits), values=json.dumps(values))
        for name, edits, values in steps))
    out = run_play(tmp_path, play, {
        "_edge_config_dir": str(config_dir), "_edge_config": str(root / "haproxy.cfg"),
        "_edge_dropin_dir": str(dropin_dir), "edge_api_key_file": str(tmp_path / "api-key"),
        "edge_bind_address": "127.0.0.1", "edge_port": free_port(), "edge_gate_port": free_port(),
        "edge_maxconn": 1000, "edge_log_target": "stderr format raw", "edge_drop_privileges": False})
    changed = json.loads((tmp_path / "changed.json").read_text(encoding="utf-8"))
    seen = {}
    for part in re.split(r"msg: STEP ", out)[1:]:
        name = part.split(None, 1)[0]
        seen[name] = (sorted(Path(path).name for path in changed[name]), re.findall(r"msg: HANDLER-RUN (.+)", part))
    assert seen == {
        "first": (sorted(["llamafleet", "api-key", "edge.pem", "haproxy.service.d", "llamafleet.conf", "haproxy.cfg"]),
                  ["Restart the edge"]),
        "converged": ([], []),
        "key-and-tls-off": (["api-key", "edge.pem", "haproxy.cfg"], ["Reload the edge"]),
    }, out[-6000:]
    assert not (config_dir / "edge.pem").exists()
    assert (config_dir / "api-key").read_text(encoding="utf-8") == KEY + "2\n"
    config = (root / "haproxy.cfg").read_text(encoding="utf-8")
    assert str(config_dir / "api-key") in config and "edge.pem" not in config
    modes = {path.name: (path.stat().st_mode & 0o7777, path.stat().st_uid, grp.getgrgid(path.stat().st_gid).gr_name)
             for path in (config_dir, config_dir / "api-key", root / "haproxy.cfg", dropin_dir / "llamafleet.conf")}
    assert modes == {"llamafleet": (0o700, 0, "root"), "api-key": (0o600, 0, "root"),
                     "haproxy.cfg": (0o640, 0, "haproxy"), "llamafleet.conf": (0o644, 0, "root")}
    assert "LimitNOFILE=3024" in (dropin_dir / "llamafleet.conf").read_text(encoding="utf-8")
    assert KEY not in out
