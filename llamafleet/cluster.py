"""Talk to a deployed cluster: completions, health, and where llama.cpp put the layers."""

from __future__ import annotations

import json
import os
import shlex
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from .core import constants
from .core.http_wire import error_message
from .core.systemd_show import show_argv
from .errors import UserError
from .fleet import Fleet, Host
from .layout import HostLayout, as_bool, host_layout, orchestrator_layout


@dataclass
class Endpoint:
    host: Host
    address: str
    port: int
    api_key: str = ""
    tls: bool = False

    @property
    def url(self) -> str:
        """The clients' URL (the edge's, Debian's HAProxy, by default; the gate's with ``llamafleet_edge: none``):
        https when the inventory gives a certificate (``llama_server_tls_cert``; the certificate is verified as
        usual, so a private CA goes in ``SSL_CERT_FILE``)."""
        return f"{'https' if self.tls else 'http'}://{self.address}:{self.port}"

    @classmethod
    def of(cls, fleet: Fleet, api_key: str | None = None, layout: HostLayout | None = None) -> Endpoint:
        """The orchestrator's llama-server, where its deployment record says it listens (``layout``, the
        orchestrator's :class:`HostLayout`; else where the inventory says), with its API key (``api_key`` when
        given, else :func:`api_key_of`, which reads the record itself when given no layout and it needs the key
        file's path)."""
        orch = fleet.orchestrator
        if layout is not None and layout.endpoint:
            address, port, tls = layout.endpoint
        else:
            address = str(orch.var("llama_server_bind_address", orch.cluster_address))
            port = int(orch.var("llama_server_port", constants.LLAMA_SERVER_PORT))
            tls = bool(str(orch.var("llama_server_tls_cert", "") or "").strip())
        if api_key is None:
            api_key = api_key_of(fleet, layout)
        return cls(orch, address, port, api_key, tls)

    def _open(self, path: str, payload: dict[str, Any] | None, timeout: float):
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data else "GET")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - the fleet's own endpoint

    def request(self, path: str, payload: dict[str, Any] | None = None, timeout: float = 300.0) -> dict[str, Any]:
        try:
            with self._open(path, payload, timeout) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as exc:
            raise UserError(f"{self.url}{path}: HTTP {exc.code}: {error_message(exc.read())}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise UserError(f"{self.url}{path}: unreachable ({getattr(exc, 'reason', exc)})") from exc

    def health(self, timeout: float = 5.0) -> str:
        """``ok`` when /health answers 200, else why not (``HTTP 503: Loading model``, ``unreachable (...)``)."""
        try:
            with self._open("/health", None, timeout) as resp:
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}: {error_message(exc.read())}"
        except (urllib.error.URLError, OSError) as exc:
            return f"unreachable ({getattr(exc, 'reason', exc)})"

    def wait_healthy(self, timeout: float = 300.0, interval: float = 0.25) -> float:
        """Seconds until /health answered 200."""
        start = time.monotonic()
        last = "not asked"
        while time.monotonic() - start < timeout:
            last = self.health(timeout=min(5.0, max(timeout, 0.5)))
            if last == "ok":
                return time.monotonic() - start
            time.sleep(interval)
        raise UserError(f"{self.url}/health did not answer 200 within {timeout:.0f} s (last: {last})")

    def complete(self, prompt: str, n_predict: int = 32, **extra: Any) -> dict[str, Any]:
        """Greedy completion through llama-server's native /completion endpoint."""
        payload = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1, "cache_prompt": False}
        payload.update(extra)
        return self.request("/completion", payload)


def api_key_of(fleet: Fleet, layout: HostLayout | None = None) -> str:
    """The key clients send, found where the deploy put it: ``$LLAMAFLEET_API_KEY``; nothing when the
    inventory sets ``llama_server_api_auth`` false; the inventory's ``llama_server_api_key``; the controller
    file ``llama_server_api_key_file``; else the key file on the orchestrator that its deployment record
    names (read over SSH, as root; ``layout``: the orchestrator's, else :func:`orchestrator_layout`)."""
    if os.environ.get("LLAMAFLEET_API_KEY"):
        return os.environ["LLAMAFLEET_API_KEY"]
    orch = fleet.orchestrator
    if not as_bool(orch.var("llama_server_api_auth", True), orch.name, "llama_server_api_auth"):
        return ""
    if orch.var("llama_server_api_key"):
        return str(orch.var("llama_server_api_key")).strip()
    if orch.var("llama_server_api_key_file"):
        path = str(orch.var("llama_server_api_key_file"))
        try:
            return open(path, encoding="utf-8").read().strip()  # noqa: SIM115 - a small file read once
        except OSError as exc:
            raise UserError(f"{orch.name}: llama_server_api_key_file={path}: {exc.strerror}") from exc
    path = (layout or orchestrator_layout(fleet)).api_key_file
    text = fleet.run_one(f"cat {shlex.quote(path)}", orch,
                         what=f"cannot read the API key {path} (deploy first, or set LLAMAFLEET_API_KEY)")
    return text.strip()


def read_plan(fleet: Fleet, layout: HostLayout | None = None) -> dict[str, Any]:
    """The split plan the deploy wrote on the orchestrator, where its deployment record says (``layout``:
    the orchestrator's, else :func:`orchestrator_layout`)."""
    orch = fleet.orchestrator
    path = (layout or orchestrator_layout(fleet)).plan_path
    text = fleet.run_one(f"cat {shlex.quote(path)}", orch, what=f"cannot read {path}")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UserError(f"{orch.name}: {path} is not JSON ({exc})") from exc


def server_log_command(since_start: bool = True, lines: int = 4000, unit: str = constants.LLAMA_SERVER_UNIT) -> str:
    """The journal of llama-server's ``unit``: from its last start (its invocation) or the last ``lines`` lines."""
    if since_start:
        return (f"inv=$({shlex.join(show_argv(unit, ['InvocationID'], value=True))}); "
                f"journalctl -o cat --no-pager _SYSTEMD_INVOCATION_ID=$inv")
    return f"journalctl -o cat --no-pager -n {int(lines)} -u {shlex.quote(unit)}"


def server_log(fleet: Fleet, since_start: bool = True, lines: int = 4000, layout: HostLayout | None = None) -> str:
    """llama-server's journal on the orchestrator (from its last start when ``since_start``), of the unit its
    deployment record names (``layout``: the orchestrator's, else :func:`orchestrator_layout`)."""
    unit = (layout or orchestrator_layout(fleet)).llama_unit
    return fleet.run_one(server_log_command(since_start, lines, unit), fleet.orchestrator,
                         what=f"cannot read the journal of {unit}")
