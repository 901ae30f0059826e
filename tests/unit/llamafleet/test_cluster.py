"""The deployed cluster's endpoint (a real local HTTP server stands in for llama-server) and its plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamafleet.cluster import Endpoint, api_key_of, error_message, read_plan, server_log, server_log_command
from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.fleet import Fleet, Host

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_endpoint_of_the_recorded_lab_inventory(lab_inventory):
    endpoint = Endpoint.of(Fleet.from_inventory_json(lab_inventory))
    assert (endpoint.host.name, endpoint.url, endpoint.api_key) == ("lab1", "http://10.77.0.11:8181", "s3cret")


@pytest.mark.parametrize(
    ("vars_", "url"),
    [({}, f"http://10.0.0.1:{constants.LLAMA_SERVER_PORT}"),
     ({"llama_server_bind_address": "127.0.0.1", "llama_server_port": "9000"}, "http://127.0.0.1:9000"),
     ({"llama_server_tls_cert": "/etc/ssl/gate.pem"}, f"https://10.0.0.1:{constants.LLAMA_SERVER_PORT}")],
)
def test_endpoint_address_and_port(vars_, url):
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["o"]},
            "_meta": {"hostvars": {"o": {"llamafleet_cluster_address": "10.0.0.1", **vars_}}}}
    assert Endpoint.of(Fleet.from_inventory_json(data), api_key="").url == url


@pytest.mark.parametrize(("llama", "url"), [
    # the record wins over the inventory: the role ran with other values (a play's vars, -e)
    ({"api_endpoint": "https://192.0.2.5:8443", "bind_address": "192.0.2.5", "port": 8443}, "https://192.0.2.5:8443"),
    ({"api_endpoint": "http://192.0.2.5:9000", "bind_address": "192.0.2.5", "port": 9000}, "http://192.0.2.5:9000"),
    # a record without the llama_server section: the inventory (TLS from its certificate)
    (None, f"https://10.0.0.1:{constants.LLAMA_SERVER_PORT}"),
])
def test_endpoint_follows_the_deployment_record(llama, url):
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["o"]},
            "_meta": {"hostvars": {"o": {"llamafleet_cluster_address": "10.0.0.1",
                                         "llama_server_tls_cert": "/etc/ssl/gate.pem"}}}}
    record = {"schema": constants.DEPLOYMENT_RECORD_SCHEMA, "sections": {"llama_server": llama} if llama else {}}
    assert Endpoint.of(Fleet.from_inventory_json(data), api_key="", record=record).url == url


def _orchestrator_fleet(**hostvars: object) -> Fleet:
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["o"]},
            "_meta": {"hostvars": {"o": {"llamafleet_cluster_address": "10.0.0.1", **hostvars}}}}
    return Fleet.from_inventory_json(data)


@pytest.mark.parametrize(
    ("env", "vars_", "key"),
    [({"LLAMAFLEET_API_KEY": "from-env"}, {"llama_server_api_key": "from-var"}, "from-env"),
     ({}, {"llama_server_api_auth": "false", "llama_server_api_key": "from-var"}, ""),
     ({}, {"llama_server_api_auth": False}, ""),
     ({}, {"llama_server_api_key": " from-var\n"}, "from-var")],
)
def test_api_key_from_the_environment_or_the_inventory(monkeypatch, env, vars_, key):
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert api_key_of(_orchestrator_fleet(**vars_)) == key


def test_api_key_from_a_controller_file(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    (tmp_path / "key").write_text("file-key-0123456789\n")
    assert api_key_of(_orchestrator_fleet(llama_server_api_key_file=str(tmp_path / "key"))) == "file-key-0123456789"
    with pytest.raises(UserError, match="o: llama_server_api_key_file=.*missing: No such file"):
        api_key_of(_orchestrator_fleet(llama_server_api_key_file=str(tmp_path / "missing")))


def test_api_key_read_on_the_orchestrator_when_the_inventory_has_none(monkeypatch):
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    fleet = _orchestrator_fleet()
    asked = []

    def run_one(command, host, timeout=60.0, what=""):
        asked.append((command, host.name))
        return "generated-key\n"

    monkeypatch.setattr(fleet, "run_one", run_one)
    assert api_key_of(fleet) == "generated-key"
    assert asked == [(f"cat {constants.API_KEY_PATH}", "o")]


def test_health_is_public_and_the_rest_needs_the_key(server):
    srv = server(api_key="k3y")
    assert srv.endpoint().health() == "ok"
    assert srv.seen[-1][:3] == ("GET", "/health", None)
    assert srv.endpoint("k3y").complete("abc")["content"] == "cba"
    with pytest.raises(UserError, match="HTTP 401: Invalid API Key"):
        srv.endpoint().complete("abc")


def test_health_while_loading_and_when_nothing_listens(server):
    srv = server(loading_requests=1)
    assert srv.endpoint().health() == "HTTP 503: Loading model"
    assert srv.endpoint().health() == "ok"
    port = srv.port
    srv.close()
    assert Endpoint(Host("o", "127.0.0.1"), "127.0.0.1", port).health(timeout=1).startswith("unreachable (")


def test_wait_healthy_waits_for_the_load(server):
    srv = server(loading_requests=3)
    assert srv.endpoint().wait_healthy(timeout=10, interval=0.01) >= 0
    assert [p for _, p, _, _ in srv.seen] == ["/health"] * 4


def test_wait_healthy_gives_up_with_the_last_answer(server):
    srv = server(loading_requests=10_000)
    with pytest.raises(UserError, match=r"/health did not answer 200 within 0 s \(last: HTTP 503: Loading model\)"):
        srv.endpoint().wait_healthy(timeout=0.3, interval=0.05)


def test_complete_posts_a_greedy_request(server):
    srv = server(api_key="k")
    assert srv.endpoint("k").complete("abc", n_predict=3)["content"] == "cba"
    method, path, auth, body = srv.seen[-1]
    assert (method, path, auth) == ("POST", "/completion", "Bearer k")
    assert json.loads(body) == {"prompt": "abc", "n_predict": 3, "temperature": 0, "top_k": 1, "cache_prompt": False}


def test_request_errors_say_what_the_server_said(server):
    srv = server()
    with pytest.raises(UserError, match=r"/nowhere: HTTP 404: File Not Found"):
        srv.endpoint().request("/nowhere")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}', "Invalid API Key"),
        (b"plain text\n", "plain text"),
        (b'{"status":"ok"}', '{"status":"ok"}'),
        ('{"error": {"message": "x"}}', "x"),
        (b"", ""),
    ],
)
def test_error_message(body, message):
    assert error_message(body) == message


def fleet_answering(connector, answer) -> Fleet:
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["lab1"]}, "_meta": {"hostvars": {}}}
    return Fleet.from_inventory_json(data, connector(answer))


def test_read_plan_reads_the_recorded_plan(connector):
    text = (FIXTURES / "plan_lab3_gemma270m_generated.json").read_text(encoding="utf-8")
    fleet = fleet_answering(
        connector, lambda host, command: (0, text, "") if command == f"cat {constants.PLAN_PATH}" else (1, "", "?"))
    plan = read_plan(fleet)
    assert plan["device_names"] == ["RPC0", "RPC1"] and plan["rpc"] == ["10.77.0.12:50052", "10.77.0.13:50052"]


@pytest.mark.parametrize(
    ("answer", "message"),
    [((1, "", "cat: /etc/llamafleet/plan.json: No such file or directory"), "lab1: cannot read .*No such file"),
     ((0, "{not json", ""), "lab1: /etc/llamafleet/plan.json is not JSON")],
)
def test_read_plan_errors_name_the_host(connector, answer, message):
    with pytest.raises(UserError, match=message):
        read_plan(fleet_answering(connector, lambda host, command: answer))


def test_server_log_commands_and_errors(connector):
    assert server_log_command(True).endswith("_SYSTEMD_INVOCATION_ID=$inv")
    assert constants.LLAMA_SERVER_UNIT in server_log_command(True)
    assert server_log_command(False, 12) == f"journalctl -o cat --no-pager -n 12 -u {constants.LLAMA_SERVER_UNIT}"
    fleet = fleet_answering(connector, lambda host, command: (0, "line\n", "") if "-n 5" in command else (1, "", "x"))
    assert server_log(fleet, since_start=False, lines=5) == "line\n"
    with pytest.raises(UserError, match=f"lab1: cannot read the journal of {constants.LLAMA_SERVER_UNIT}: x"):
        server_log(fleet)
