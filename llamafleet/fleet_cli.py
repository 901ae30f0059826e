"""``llamafleet status|logs|probe``: what playbooks are clumsy at, over SSH."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from .cluster import LLAMA_UNIT, RPC_UNIT, Endpoint
from .errors import UserError
from .fleet import Fleet, Host

DEFAULT_INVENTORY = Path(__file__).resolve().parents[1] / "inventories" / "lab" / "hosts.ini"

STATUS_SCRIPT = r"""
role="$1"
unit=""; [ "$role" = orchestrator ] && unit=llamafleet-llama-server.service || unit=llamafleet-rpc-server.service
state=$(systemctl is-active "$unit" 2>/dev/null || true)
since=$(systemctl show -p ActiveEnterTimestamp --value "$unit" 2>/dev/null)
restarts=$(systemctl show -p NRestarts --value "$unit" 2>/dev/null)
build=$(readlink /opt/llamafleet/llama.cpp/current 2>/dev/null)
cache=$(du -sb /var/lib/llamafleet-rpc/cache/rpc 2>/dev/null | cut -f1)
files=$(ls /var/lib/llamafleet-rpc/cache/rpc 2>/dev/null | wc -l)
printf '{"unit":"%s","state":"%s","since":"%s","restarts":"%s","build":"%s","cache_bytes":"%s","cache_files":"%s"}\n' \
  "$unit" "$state" "$since" "$restarts" "$build" "${cache:-0}" "$files"
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    def with_inventory(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("-i", "--inventory", default=str(DEFAULT_INVENTORY), help="Ansible inventory (default: the lab's)")
        return p

    p = with_inventory(subparsers.add_parser("status", help="the fleet at a glance: units, builds, caches, health"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=status)

    p = with_inventory(subparsers.add_parser("logs", help="journal of the cluster's unit on a host"))
    p.add_argument("host", help="inventory host name")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.set_defaults(func=logs)

    p = with_inventory(subparsers.add_parser("probe", help="link probes: TCP round trip and throughput orchestrator -> workers"))
    p.add_argument("--megabytes", type=int, default=32, help="bytes to send per link (MB)")
    p.add_argument("--port", type=int, default=50999, help="temporary port on the workers")
    p.set_defaults(func=probe)


def _role(fleet: Fleet, host: Host) -> str:
    return "orchestrator" if host.name in fleet.groups.get("llamafleet_orchestrator", []) else "worker"


def status(args: argparse.Namespace) -> int:
    fleet = Fleet.from_inventory(args.inventory)
    rows = []
    bad = 0
    for host in sorted(fleet.hosts.values(), key=lambda h: h.name):
        role = _role(fleet, host)
        res = fleet.run(f"bash -c {shlex.quote(STATUS_SCRIPT)} _ {role}", [host])[host.name]
        row = {"host": host.name, "address": host.cluster_address, "role": role}
        if res.ok:
            row.update(json.loads(res.stdout.strip().splitlines()[-1]))
        else:
            row.update(state="unreachable", error=res.error or res.stderr.strip())
        if role == "orchestrator" and row.get("state") == "active":
            try:
                endpoint = Endpoint.of(fleet)
                endpoint.wait_healthy(timeout=2)
                row["health"] = "ok"
            except UserError as exc:
                row["health"] = str(exc)
        bad += row.get("state") != "active" or row.get("health", "ok") != "ok"
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 1 if bad else 0
    print(f"{'host':<10} {'role':<12} {'address':<15} {'state':<11} {'restarts':<8} {'build':<28} {'cache':<14} health")
    for r in rows:
        cache = f"{int(r.get('cache_bytes') or 0) / 2**20:.0f} MiB/{r.get('cache_files', 0)}" if r["role"] == "worker" else "-"
        print(f"{r['host']:<10} {r['role']:<12} {r['address']:<15} {r.get('state', '?'):<11} {r.get('restarts', ''):<8} "
              f"{r.get('build') or '-':<28} {cache:<14} {r.get('health', r.get('error', '-'))}")
    return 1 if bad else 0


def logs(args: argparse.Namespace) -> int:
    fleet = Fleet.from_inventory(args.inventory)
    host = fleet.hosts.get(args.host)
    if host is None:
        raise UserError(f"{args.host} is not in {args.inventory} (hosts: {', '.join(sorted(fleet.hosts))})")
    unit = LLAMA_UNIT if _role(fleet, host) == "orchestrator" else RPC_UNIT
    res = fleet.run(f"journalctl -u {unit} -n {int(args.lines)} --no-pager -o short-iso", [host])[host.name]
    if not res.ok:
        raise UserError(f"{host.name}: {res.error or res.stderr.strip()}")
    print(res.stdout, end="")
    return 0


# A tiny sink on the worker (listens once, counts bytes) and a sender on the
# orchestrator (connect time, then throughput); both in the hosts' own python3.
SINK = (
    "import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
    "s.bind((sys.argv[1],int(sys.argv[2])));s.listen(1);s.settimeout(30);c,_=s.accept();n=0\n"
    "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
    "c.sendall(str(n).encode());c.close()"
)
SENDER = (
    "import socket,sys,time,json;a,p,mb=sys.argv[1],int(sys.argv[2]),int(sys.argv[3]);"
    "t=time.perf_counter()\nfor i in range(50):\n try:\n  s=socket.create_connection((a,p),timeout=5);break\n"
    " except OSError: time.sleep(0.1)\nrtt=time.perf_counter()-t;buf=b'x'*(1<<20);t=time.perf_counter()\n"
    "for _ in range(mb): s.sendall(buf)\ns.shutdown(socket.SHUT_WR);n=int(s.recv(64));dt=time.perf_counter()-t\n"
    "print(json.dumps({'connect_ms':rtt*1000,'bytes':n,'seconds':dt}))"
)


def probe(args: argparse.Namespace) -> int:
    """Measure each orchestrator -> worker link with real TCP traffic on the cluster addresses."""
    import threading

    fleet = Fleet.from_inventory(args.inventory)
    orch = fleet.orchestrator
    failures = 0
    print(f"{'link':<24} {'connect ms':>10} {'MB/s':>10}")
    for worker in fleet.workers:
        addr = worker.cluster_address
        sink_result = {}

        def sink(w=worker, a=addr):
            sink_result[w.name] = fleet.run(f"python3 -c {shlex.quote(SINK)} {a} {args.port}", [w], timeout=60)[w.name]

        thread = threading.Thread(target=sink)
        thread.start()
        sent = fleet.run(f"python3 -c {shlex.quote(SENDER)} {addr} {args.port} {args.megabytes}", [orch], timeout=120)[orch.name]
        thread.join()
        link = f"{orch.name} -> {worker.name}"
        if not sent.ok:
            failures += 1
            print(f"{link:<24} failed: {sent.error or sent.stderr.strip()[-200:]}")
            continue
        data = json.loads(sent.stdout.strip().splitlines()[-1])
        print(f"{link:<24} {data['connect_ms']:>10.2f} {data['bytes'] / data['seconds'] / 1e6:>10.1f}")
    return 1 if failures else 0
