"""The deployed cluster's endpoint (a real local HTTP server stands in for llama-server) and its plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamafleet.cluster import Endpoint, api_key_of, error_message, read_plan, server_log, server_log_command
from llamafleet.core import constants
from llamafleet.errors import UserError
from llamafleet.fleet import Fleet, Host
from llamafleet.layout import host_layout, orchestrator_layout, record_command

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PLAN_TEXT = (FIXTURES / "plan_lab3_gemma270m_generated.json").read_text(encoding="utf-8")
# What the renamed_record fixture (conftest.py) names, and the defaults a host without a record gets.
RENAMED = {"unit": "lf-llama-b.service", "plan": "/srv/lf-b/plan.json", "key": "/srv/lf-b/api.key"}
DEFAULTS = {"unit": constants.LLAMA_SERVER_UNIT, "plan": constants.PLAN_PATH, "key": constants.API_KEY_PATH}


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
    fleet = Fleet.from_inventory_json(data)
    assert Endpoint.of(fleet, api_key="", layout=host_layout(fleet, fleet.orchestrator, record)).url == url


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


def fleet_answering(connector, answer) -> Fleet:
    data = {constants.GROUP_ORCHESTRATOR: {"hosts": ["lab1"]}, "_meta": {"hostvars": {}}}
    return Fleet.from_inventory_json(data, connector(answer))


def only(command: str, stdout: str):
    """An answer that knows ``command`` alone (any other fails with ``x``)."""
    return lambda host, asked: (0, stdout, "") if asked == command else (1, "", "x")


@pytest.fixture
def record_of(renamed_record):
    """``record_of(renamed)``: the renamed record, or None (a host without a record), and the values it gives."""
    return lambda renamed: (renamed_record, RENAMED) if renamed else (None, DEFAULTS)


@pytest.mark.parametrize("renamed", [True, False])
def test_api_key_read_on_the_orchestrator_from_the_recorded_key_file(monkeypatch, connector, recorded, record_of,
                                                                     renamed):
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    record, want = record_of(renamed)
    fleet = fleet_answering(connector, recorded(record, only(f"cat {want['key']}", "generated-key\n")))
    assert api_key_of(fleet) == "generated-key"
    assert fleet.connect.calls == [("lab1", record_command()), ("lab1", f"cat {want['key']}")]


def test_api_key_errors_name_the_host_and_the_recorded_file(monkeypatch, connector, recorded, renamed_record):
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    fleet = fleet_answering(connector, recorded(renamed_record, only("cat /elsewhere", "")))
    with pytest.raises(UserError, match=f"^lab1: cannot read the API key {RENAMED['key']} .*: x"):
        api_key_of(fleet)


def test_endpoint_of_a_record_reads_the_key_file_it_names_without_reading_it_again(monkeypatch, connector,
                                                                                   renamed_record):
    monkeypatch.delenv("LLAMAFLEET_API_KEY", raising=False)
    fleet = fleet_answering(connector, only(f"cat {RENAMED['key']}", "k3y\n"))
    assert Endpoint.of(fleet, layout=host_layout(fleet, fleet.orchestrator, renamed_record)).api_key == "k3y"
    assert fleet.connect.calls == [("lab1", f"cat {RENAMED['key']}")]


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


@pytest.mark.parametrize("renamed", [True, False])
def test_read_plan_reads_the_plan_the_record_names(connector, recorded, record_of, renamed):
    record, want = record_of(renamed)
    fleet = fleet_answering(connector, recorded(record, only(f"cat {want['plan']}", PLAN_TEXT)))
    plan = read_plan(fleet)
    assert plan["device_names"] == ["RPC0", "RPC1"] and plan["rpc"] == ["10.77.0.12:50052", "10.77.0.13:50052"]
    assert fleet.connect.calls == [("lab1", record_command()), ("lab1", f"cat {want['plan']}")]


def test_read_plan_with_the_layout_reads_no_record(connector, recorded, renamed_record):
    fleet = fleet_answering(connector, recorded(renamed_record, only(f"cat {RENAMED['plan']}", PLAN_TEXT)))
    layout = orchestrator_layout(fleet)
    fleet.connect.calls.clear()
    assert read_plan(fleet, layout)["device_names"] == ["RPC0", "RPC1"]
    assert fleet.connect.calls == [("lab1", f"cat {RENAMED['plan']}")]


@pytest.mark.parametrize(
    ("answer", "message"),
    [((1, "", "cat: /srv/lf-b/plan.json: No such file or directory"),
      "^lab1: cannot read /srv/lf-b/plan.json: cat: .*No such file"),
     ((0, "{not json", ""), "^lab1: /srv/lf-b/plan.json is not JSON")],
)
def test_read_plan_errors_name_the_host_and_the_recorded_path(connector, recorded, renamed_record, answer, message):
    with pytest.raises(UserError, match=message):
        read_plan(fleet_answering(connector, recorded(renamed_record, lambda host, command: answer)))


def test_read_plan_refuses_a_record_it_cannot_use(connector, recorded):
    newer = {"schema": constants.DEPLOYMENT_RECORD_SCHEMA + 1, "sections": {}}
    fleet = fleet_answering(connector, recorded(newer, only(f"cat {constants.PLAN_PATH}", PLAN_TEXT)))
    with pytest.raises(UserError, match="^lab1: cannot read the deployment record .*newer llamafleet"):
        read_plan(fleet)


@pytest.mark.parametrize(
    ("args", "command"),
    [((True,), f"inv=$(systemctl show --property=InvocationID --value -- {constants.LLAMA_SERVER_UNIT}); "
               "journalctl -o cat --no-pager _SYSTEMD_INVOCATION_ID=$inv"),
     ((False, 12), f"journalctl -o cat --no-pager -n 12 -u {constants.LLAMA_SERVER_UNIT}"),
     ((True, 1, "lf-llama-b.service"), "inv=$(systemctl show --property=InvocationID --value -- lf-llama-b.service); "
                                       "journalctl -o cat --no-pager _SYSTEMD_INVOCATION_ID=$inv"),
     ((False, 5, "lf-llama-b.service"), "journalctl -o cat --no-pager -n 5 -u lf-llama-b.service"),
     ((False, 5, "llama b.service"), "journalctl -o cat --no-pager -n 5 -u 'llama b.service'")],
)
def test_server_log_command(args, command):
    assert server_log_command(*args) == command


@pytest.mark.parametrize("renamed", [True, False])
def test_server_log_reads_the_recorded_units_journal(connector, recorded, record_of, renamed):
    record, want = record_of(renamed)
    fleet = fleet_answering(connector, recorded(record, only(server_log_command(False, 5, want["unit"]), "line\n")))
    assert server_log(fleet, since_start=False, lines=5) == "line\n"
    with pytest.raises(UserError, match=f"^lab1: cannot read the journal of {want['unit']}: x"):
        server_log(fleet)
    layout = orchestrator_layout(fleet)
    fleet.connect.calls.clear()
    assert server_log(fleet, since_start=False, lines=5, layout=layout) == "line\n"
    assert fleet.connect.calls == [("lab1", server_log_command(False, 5, want["unit"]))]
