"""Test doubles for the library's SSH and HTTP sides.

``Fleet`` takes ``connect(host, timeout)``; a ``Connector`` stands in for fabric so that
fleets, facts and status are tested without SSH: it answers each command from a function,
which may run it with this machine's ``sh`` (``local``).  ``server`` starts a real HTTP
server on 127.0.0.1 that answers /health and /completion as llama-server does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from llamafleet.fleet import Fleet, Host
from llamafleet.layout import record_command

FIXTURES = Path(__file__).resolve().parent / "fixtures"

Answer = Callable[[Any, str], "tuple[int, str, str]"]


class Connection:
    """A context manager with fabric's ``run`` signature that delegates to ``answer(host, command)``."""

    def __init__(self, host: Any, answer: Answer, calls: list[tuple[str, str]], lock: threading.Lock):
        self.host, self.answer, self.calls, self.lock = host, answer, calls, lock

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(self, command: str, hide: bool, warn: bool, timeout: float, in_stream: bool) -> SimpleNamespace:
        assert hide and warn and in_stream is False  # what Fleet.run must ask of fabric
        with self.lock:
            self.calls.append((self.host.name, command))
        rc, out, err = self.answer(self.host, command)
        return SimpleNamespace(exited=rc, stdout=out, stderr=err)


class Connector:
    """``connect(host, timeout)`` for Fleet; ``calls`` lists (host, command) in the order they ran."""

    def __init__(self, answer: Answer):
        self.answer = answer
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, host: Any, timeout: float) -> Connection:
        return Connection(host, self.answer, self.calls, self.lock)


def run_locally(env: dict[str, str] | None = None) -> Answer:
    """An answer that runs the command with this machine's ``sh``."""

    def answer(host: Any, command: str) -> tuple[int, str, str]:
        proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, timeout=60, check=False)
        return proc.returncode, proc.stdout, proc.stderr

    return answer


@pytest.fixture
def fixture_text() -> Callable[[str], str]:
    return lambda name: (FIXTURES / name).read_text(encoding="utf-8")


@pytest.fixture
def lab_inventory() -> dict[str, Any]:
    """``ansible-inventory --list`` of the three-host lab with an operator's overrides (recorded)."""
    return json.loads((FIXTURES / "ansible-inventory_2.19_lab3_list_real.json").read_text(encoding="utf-8"))


@pytest.fixture
def connector() -> type[Connector]:
    return Connector


# A llama_server section that renames what a user may rename in a play or with -e (the roles record it).
RENAMED_LLAMA_SERVER = {"units": ["lf-llama-b.service"], "gate_unit": "lf-gate-b.service",
                        "plan_path": "/srv/lf-b/plan.json", "api_key_file": "/srv/lf-b/api.key"}


@pytest.fixture
def renamed_record() -> dict[str, Any]:
    """A deployment record whose llama-server unit, gate unit, plan and API key file are not the defaults."""
    return {"schema": constants.DEPLOYMENT_RECORD_SCHEMA, "collection_version": "0.1.0",
            "sections": {"llama_server": dict(RENAMED_LLAMA_SERVER)}}


def answering_record(record: dict[str, Any] | None, answer: Answer) -> Answer:
    """``answer``, but the command that prints the deployment record prints ``record`` (None: no record)."""

    def reply(host: Any, command: str) -> tuple[int, str, str]:
        if command == record_command():
            return 0, "" if record is None else json.dumps(record), ""
        return answer(host, command)

    return reply


@pytest.fixture
def recorded() -> Callable[[dict[str, Any] | None, Answer], Answer]:
    """``recorded(record, answer)``: ``answer`` with the deployment record command answered by ``record``."""
    return answering_record


@pytest.fixture
def local() -> Callable[..., Answer]:
    return run_locally


LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


class FakeServer:
    """llama-server's /health and /completion: 503 while 'loading', an API key when one is set."""

    def __init__(self, api_key: str = "", loading_requests: int = 0):
        self.api_key = api_key
        self.loading_left = loading_requests
        self.seen: list[tuple[str, str, str | None, bytes]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def handle_one(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.seen.append((method, self.path, self.headers.get("Authorization"), body))
                # as llama-server: /health is public, everything else needs the key when one is set
                if (server.api_key and self.path not in ("/health", "/v1/health")
                        and self.headers.get("Authorization") != f"Bearer {server.api_key}"):
                    return self.reply(401, b'{"error":{"code":401,"message":"Invalid API Key"}}')
                if server.loading_left > 0:
                    server.loading_left -= 1
                    return self.reply(503, LOADING)
                if self.path == "/health":
                    return self.reply(200, b'{"status":"ok"}')
                if self.path == "/completion":
                    prompt = json.loads(body)["prompt"]
                    return self.reply(200, json.dumps({"content": prompt[::-1], "timings": {}}).encode())
                return self.reply(404, b'{"error":{"code":404,"message":"File Not Found"}}')

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.handle_one("GET")

            def do_POST(self) -> None:  # noqa: N802
                self.handle_one("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def endpoint(self, api_key: str = "") -> Endpoint:
        return Endpoint(Host("orch", "127.0.0.1"), "127.0.0.1", self.port, api_key)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """``closing(thing)`` returns ``thing`` and calls its ``close()`` after the test."""
    things: list[Any] = []

    def keep(thing: Any) -> Any:
        things.append(thing)
        return thing

    yield keep
    for thing in things:
        thing.close()


@pytest.fixture
def server(closing: Callable[[Any], Any]) -> Callable[..., FakeServer]:
    """``server(api_key=..., loading_requests=...)``: a FakeServer, closed after the test."""
    return lambda **kw: closing(FakeServer(**kw))


FAKE_SYSTEMCTL = """#!/usr/bin/env python3
# systemctl show for a machine without systemd: the recorded blocks of the units asked for.
import os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SYSTEMCTL_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
blocks = open(os.environ["FAKE_SYSTEMCTL_SHOW"]).read().strip().split("\\n\\n")
by_id = {line[3:]: block for block in blocks for line in block.splitlines() if line.startswith("Id=")}
missing = "NRestarts=0\\nId=%s\\nLoadState=not-found\\nActiveState=inactive\\nSubState=dead\\nActiveEnterTimestamp="
print("\\n\\n".join(by_id.get(u, missing % u) for u in args[args.index("--") + 1:]))
"""


def gate_state_doc(name: str, age: float = 0.0, **changes: Any) -> dict[str, Any]:
    """The recorded gate state ``gate-state_NAME_generated.json`` as if written ``age`` seconds ago (by this
    machine's clock), its other times moved along, with ``changes`` applied."""
    doc = json.loads((FIXTURES / f"gate-state_{name}_generated.json").read_text(encoding="utf-8"))
    shift = int(time.time() - age) - doc["updated"]  # date +%s truncates too
    doc.update(updated=doc["updated"] + shift, since=doc["since"] + shift)
    doc.update(changes)
    return doc


@pytest.fixture
def machine_fleet(tmp_path: Path, server: Callable[..., FakeServer], connector: type[Connector],
                  monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A four-host fleet whose hosts are this machine: each its own build link and cache under tmp_path.

    lab1 orchestrates (its llama-server is ``server``, with an API key; its gate's state file,
    ``gate_state_file``, is the recorded serving one, written now: ``write_gate_state(name, age, **changes)``
    replaces it); lab2 is a worker with one rpc-server, lab3 one per device (CUDA0 active, CUDA1
    restarting); lab4 cannot be reached. ``systemctl`` answers from the recorded ``systemctl show``
    output (the gate and the guards active).
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL, encoding="utf-8")
    (bin_dir / "systemctl").chmod(0o755)
    log = tmp_path / "systemctl.log"
    show = tmp_path / "systemctl-show.txt"
    show.write_text("\n\n".join((FIXTURES / name).read_text(encoding="utf-8").strip() for name in (
        "systemctl-252_show_units_reconstructed.txt", "systemctl-252_show_gate_units_reconstructed.txt")) + "\n",
        encoding="utf-8")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_SYSTEMCTL_LOG": str(log), "FAKE_SYSTEMCTL_SHOW": str(show)}
    gate_state_file = tmp_path / "lab1" / "run" / constants.GATE_RUNTIME_DIR / "state.json"
    gate_state_file.parent.mkdir(parents=True)
    monkeypatch.setattr(constants, "GATE_STATE_PATH", str(gate_state_file))
    # every host's deployment record (one file: the hosts share this machine); absent unless a test writes it
    monkeypatch.setattr(constants, "DEPLOYMENT_RECORD_PATH", str(tmp_path / "deployment.json"))

    def write_gate_state(name: str, age: float = 0.0, **changes: Any) -> dict[str, Any]:
        doc = gate_state_doc(name, age, **changes)
        gate_state_file.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return doc

    write_gate_state("serving")
    srv = server(api_key="s3cret")
    hostvars: dict[str, dict[str, Any]] = {}
    for name, cache_files in (("lab1", 0), ("lab2", 3), ("lab3", 1), ("lab4", 0)):
        root = tmp_path / name
        (root / "llama.cpp" / "b4321-cpu").mkdir(parents=True)
        (root / "llama.cpp" / "current").symlink_to("b4321-cpu")
        (root / "rpc" / "cache" / "rpc").mkdir(parents=True)
        for i in range(cache_files):
            (root / "rpc" / "cache" / "rpc" / f"{i:016x}").write_bytes(bytes(1000 * (i + 1)))
        hostvars[name] = {"llamafleet_cluster_address": "127.0.0.1", "llamacpp_build_root": str(root / "llama.cpp"),
                          "rpc_server_home": str(root / "rpc")}
    hostvars["lab1"].update(llama_server_port=srv.port, llama_server_api_key="s3cret")
    hostvars["lab3"].update(rpc_server_unit_per_device=True, rpc_server_devices=["CUDA0", "CUDA1"])
    data = {"llamafleet": {"children": ["llamafleet_orchestrator", "llamafleet_workers"]},
            "llamafleet_orchestrator": {"hosts": ["lab1"]}, "llamafleet_workers": {"hosts": ["lab2", "lab3", "lab4"]},
            "_meta": {"hostvars": hostvars}}

    def answer(host: Any, command: str) -> tuple[int, str, str]:
        if host.name == "lab4":
            raise TimeoutError("timed out")
        return run_locally(env)(host, command)

    conn = connector(answer)
    return SimpleNamespace(fleet=Fleet.from_inventory_json(data, conn), server=srv, connector=conn, log=log,
                           record_file=tmp_path / "deployment.json",
                           inventory=data, gate_state_file=gate_state_file, write_gate_state=write_gate_state)


@pytest.fixture
def running() -> Iterator[Callable[..., tuple[subprocess.Popen, list[str]]]]:
    """Start a Python process with extra arguments and wait until it runs them: (process, its argv)."""
    procs: list[subprocess.Popen] = []

    def start(*extra: str) -> tuple[subprocess.Popen, list[str]]:
        argv = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)", *extra]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline() == "ready\n"  # exec'd: /proc/PID/cmdline is its own now
        return proc, argv

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
