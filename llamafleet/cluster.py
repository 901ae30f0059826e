"""Talk to a deployed cluster: completions, health, and where llama.cpp put the layers."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from .errors import UserError
from .fleet import Fleet, Host

LLAMA_UNIT = "llamafleet-llama-server.service"
RPC_UNIT = "llamafleet-rpc-server.service"
PLAN_PATH = "/etc/llamafleet/plan.json"


@dataclass
class Endpoint:
    host: Host
    address: str
    port: int
    api_key: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @classmethod
    def of(cls, fleet: Fleet) -> Endpoint:
        orch = fleet.orchestrator
        hv = orch.vars
        address = str(hv.get("llama_server_bind_address") or orch.cluster_address)
        return cls(orch, address, int(hv.get("llama_server_port", 8080)), str(hv.get("llama_server_api_key", "")))

    def request(self, path: str, payload: dict[str, Any] | None = None, timeout: float = 300.0) -> dict[str, Any]:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data else "GET")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the fleet's own endpoint
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            raise UserError(f"{self.url}{path}: HTTP {exc.code}: {body[:300]}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise UserError(f"{self.url}{path}: unreachable ({getattr(exc, 'reason', exc)})") from exc

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Seconds until /health answered 200."""
        start = time.monotonic()
        last = ""
        while time.monotonic() - start < timeout:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:  # noqa: S310
                    if resp.status == 200:
                        return time.monotonic() - start
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                last = str(getattr(exc, "reason", exc))
            time.sleep(0.25)
        raise UserError(f"{self.url}/health did not answer 200 within {timeout:.0f} s (last: {last})")

    def complete(self, prompt: str, n_predict: int = 32, **extra: Any) -> dict[str, Any]:
        """Greedy completion through llama-server's native /completion endpoint."""
        payload = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1, "cache_prompt": False}
        payload.update(extra)
        return self.request("/completion", payload)


def read_plan(fleet: Fleet) -> dict[str, Any]:
    """The split plan the deploy wrote on the orchestrator."""
    res = fleet.run(f"cat {PLAN_PATH}", [fleet.orchestrator])[fleet.orchestrator.name]
    if not res.ok:
        raise UserError(f"{fleet.orchestrator.name}: cannot read {PLAN_PATH}: {res.error or res.stderr.strip()}")
    return json.loads(res.stdout)


def server_log(fleet: Fleet, since_start: bool = True, lines: int = 4000) -> str:
    """llama-server's journal on the orchestrator (from its last start when ``since_start``)."""
    orch = fleet.orchestrator
    if since_start:
        cmd = (
            f"inv=$(systemctl show -p InvocationID --value {LLAMA_UNIT}); "
            f"journalctl -o cat --no-pager _SYSTEMD_INVOCATION_ID=$inv"
        )
    else:
        cmd = f"journalctl -o cat --no-pager -n {lines} -u {LLAMA_UNIT}"
    res = fleet.run(cmd, [orch])[orch.name]
    if not res.ok:
        raise UserError(f"{orch.name}: cannot read the journal of {LLAMA_UNIT}: {res.error or res.stderr.strip()}")
    return res.stdout
