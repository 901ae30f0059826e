"""``llamafleet bench fleet|split|cache``: benchmarks on a deployed fleet that print their figures."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ..fleet_cli import fleet_of, with_inventory
from ..inventory import collection_playbook, default_sources
from ..lab.paths import cache_root
from .runner import write_results

# Results go beside the user, not into the installed package.
DEFAULT_OUT = Path("bench-results")
# The collection's playbook, by name: from this checkout (ansible.cfg) or wherever the collection is installed.
PLAYBOOK = "llamafleet.cluster.bench"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure a deployed fleet (prints tables, writes bench-results/)")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True

    about = ("planner's split vs even split vs llama.cpp's --fit: load time and tok/s "
             "(stops the deployed llama-server while it runs, starts it again at the end)")
    p = sub.add_parser("split", help=about, description=about)
    p.add_argument("--runs", type=int, default=3, help="completions per variant (median reported)")
    p.set_defaults(func=_split)

    about = ("weight bytes and load time, unseeded vs seeded worker caches, shaped links "
             "(stops the deployed llama-server while it runs, starts it again at the end)")
    p = sub.add_parser("cache", help=about, description=about)
    p.add_argument("--rate", default="240mbit", help="tbf rate of each worker link (240mbit = 30 MB/s)")
    p.set_defaults(func=_cache)

    about = ("playbooks/bench.yml: workers x injected latency x split policy, with a report and plots "
             "(takes the cluster out of service while it runs, restores the deployed plan at the end)")
    p = sub.add_parser("fleet", help=about, description=about)
    p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                   help="passed to ansible-playbook -e (bench_latencies_ms, bench_policies, ...: "
                        "roles/bench/defaults/main.yml)")
    p.set_defaults(func=_fleet)

    for p in sub.choices.values():
        with_inventory(p)
        p.add_argument("--out", default=str(DEFAULT_OUT), help="directory for the JSON and Markdown results")


def _split(args: argparse.Namespace) -> int:
    from . import split

    fleet = fleet_of(args)
    rows = split.run(fleet, runs=args.runs)
    text = split.table(rows)
    print(text)
    print(f"results: {write_results(Path(args.out), 'split', rows, text)}")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from . import cache

    fleet = fleet_of(args)
    rows = cache.run(fleet, Path(args.inventory or default_sources()[0]), cache_root(), rate=args.rate)
    text = cache.table(rows)
    print(text)
    print(f"results: {write_results(Path(args.out), 'cache', rows, text)}")
    return 0


def fleet_command(inventory: str | None, out: str, extra_vars: list[str], vault_files: list[str] = ()) -> list[str]:
    """The ansible-playbook command line of ``llamafleet bench fleet``."""
    cmd = [str(Path(sys.executable).with_name("ansible-playbook")), *(["-i", inventory] if inventory else []),
           *(f"--vault-password-file={f}" for f in vault_files), PLAYBOOK,
           "-e", json.dumps({"bench_results_dir": str(Path(out).resolve())})]
    for extra in extra_vars:
        cmd += ["-e", extra]
    return cmd


def _fleet(args: argparse.Namespace) -> int:
    collection_playbook(PLAYBOOK)  # a clear error before ansible-playbook's own
    return subprocess.call(fleet_command(args.inventory, args.out, args.extra_vars, args.vault_password_file))
