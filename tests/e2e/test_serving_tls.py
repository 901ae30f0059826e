"""TLS on the lab, held by the edge (Debian's HAProxy, on by default) in front of the gate: a certificate made here,
deployed, served over https on the clients' port (ALPN h2), plain HTTP no longer spoken there, the gate behind the
edge on loopback in plain HTTP; a second deploy changes nothing; a mismatched pair refused before any change.

TLS at the gate itself (``llamafleet_edge=none``, the opt-out, whose gate still holds TLS) is served and checked by
test_edge_lab.py's last test, on the deploy that turns the edge off there (no deploy of its own).
Runs after test_deploy.py on its converged lab and restores the plain-HTTP deploy at the end.
"""

from __future__ import annotations

import json
import socket
import ssl
import urllib.error
import urllib.request

import pytest

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from llamafleet.layout import orchestrator_layout
from tests.e2e.test_deploy import assert_fails_before_any_change
from tests.helpers import TLS_DIR, listeners, playbook, put_tls_file, self_signed_pair

pytest.importorskip("cryptography")

@pytest.fixture(scope="module")
def tls_files(deployed, fleet, tmp_path_factory):
    orch = fleet.orchestrator
    cert, key = self_signed_pair(orch.cluster_address)
    _other_cert, other_key = self_signed_pair(orch.cluster_address)
    put_tls_file(fleet, orch, f"{TLS_DIR}/gate.pem", cert, "0644")
    put_tls_file(fleet, orch, f"{TLS_DIR}/gate.key", key, "0640")
    put_tls_file(fleet, orch, f"{TLS_DIR}/other.key", other_key, "0640")
    cafile = tmp_path_factory.mktemp("tls") / "gate.pem"
    cafile.write_bytes(cert)
    yield {"cert": f"{TLS_DIR}/gate.pem", "key": f"{TLS_DIR}/gate.key", "other_key": f"{TLS_DIR}/other.key",
           "cafile": cafile}
    fleet.run(f"rm -rf {TLS_DIR}", [orch])


def test_a_key_that_does_not_match_the_certificate_is_refused(fleet, tls_files):
    assert_fails_before_any_change(
        fleet, ["-e", f"llama_server_tls_cert={tls_files['cert']}", "-e", f"llama_server_tls_key={tls_files['other_key']}"],
        ["lab1", f"llama_server_tls_cert={tls_files['cert']}", "do not load as a PEM certificate and its key"])


def test_the_edge_serves_https_with_the_given_certificate(fleet, tls_files):
    tls = ["-e", f"llama_server_tls_cert={tls_files['cert']}", "-e", f"llama_server_tls_key={tls_files['key']}"]
    try:
        run = playbook("deploy.yml", *tls)
        assert run.rc == 0, run.output[-6000:]
        # the deployment record names the clients' https endpoint (the inventory alone does not: -e gave the pair)
        endpoint = Endpoint.of(fleet, layout=orchestrator_layout(fleet))
        url = endpoint.url
        assert url.startswith("https://"), url
        # the edge holds the clients' port and the TLS; the gate is behind it on loopback, in plain HTTP
        assert [line.split()[0] for line in listeners(fleet, endpoint.port)] == ["haproxy"]
        gate = json.loads(fleet.run_one(f"cat {constants.GATE_CONFIG_PATH}", fleet.orchestrator))
        assert gate["listen_host"] == "127.0.0.1" and gate.get("tls_cert", "") == "", gate
        context = ssl.create_default_context(cafile=str(tls_files["cafile"]))
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection((endpoint.address, endpoint.port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=endpoint.address) as tls_socket:
            assert tls_socket.selected_alpn_protocol() == "h2"
        context = ssl.create_default_context(cafile=str(tls_files["cafile"]))
        req = urllib.request.Request(url + "/completion", method="POST", data=json.dumps(
            {"prompt": "The capital of France is", "n_predict": 4}).encode())
        req.add_header("Authorization", f"Bearer {endpoint.api_key}")
        with urllib.request.urlopen(req, timeout=60, context=context) as resp:  # noqa: S310 - the lab's edge
            assert resp.status == 200 and json.loads(resp.read())["content"].strip()
        # the certificate is verified, and plain HTTP is not spoken any more
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(url + "/health", timeout=10, context=ssl.create_default_context())  # noqa: S310
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https://", "http://") + "/health", timeout=10)  # noqa: S310
        again = playbook("deploy.yml", *tls)
        assert again.rc == 0 and again.changed == 0, again.output[-4000:]
    finally:
        restore = playbook("deploy.yml")
        assert restore.rc == 0, restore.output[-6000:]
    Endpoint.of(fleet).wait_healthy(timeout=120)
