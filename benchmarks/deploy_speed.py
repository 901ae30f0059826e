"""Benchmark: cold deploy of a fresh lab, how many times llama.cpp was compiled, and the idempotent re-runs.

    python -m benchmarks.deploy_speed [--hosts 3] [--compile]

The re-runs: one with every task (``llamafleet_skip_when_in_sync=false``: the roles' own idempotence), then two
that take the stamps' way (every host in sync with the stamp the last whole deploy left: the roles are left out).

``--compile`` points the build role at an empty artifact cache, so the cold
deploy compiles llama.cpp as on a fleet's first day; without it the controller's
artifact cache supplies the build (as on every later lab).  Prints the figures.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TASK = re.compile(r"^TASK \[(?P<name>[^\]]+)\]")
CHANGED = re.compile(r"^changed: \[(?P<host>[^\]]+)\]")
IN_SYNC = "Every host is as the last deploy left it"


def compiled_on(output: str) -> list[str]:
    """Hosts on which the role's compile task ran (reported changed)."""
    hosts, in_compile = [], False
    for line in output.splitlines():
        task = TASK.match(line)
        if task:
            in_compile = task.group("name").endswith("Compile llama.cpp, the log is build-<build id>.log in llamacpp_build_work_dir")
            continue
        changed = CHANGED.match(line)
        if in_compile and changed:
            hosts.append(changed.group("host"))
    return hosts


def deploy(*extra: str) -> tuple[float, str, int]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    started = time.monotonic()
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(REPO / "inventories/lab/hosts.ini"),
                           str(REPO / "playbooks/deploy.yml"), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"deploy failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-2000:]}")
    changed = sum(int(m) for m in re.findall(r"changed=(\d+)", proc.stdout.split("PLAY RECAP")[-1]))
    return seconds, proc.stdout, changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="start from an empty artifact cache")
    args = parser.parse_args()
    subprocess.run([str(BIN / "llamafleet"), "lab", "down"], check=True, capture_output=True)
    subprocess.run([str(BIN / "llamafleet"), "lab", "up", "--hosts", str(args.hosts)], check=True, capture_output=True)
    with tempfile.TemporaryDirectory(prefix="llamafleet-artifacts-") as empty:
        extra = ["-e", f"llamacpp_build_artifact_cache={empty}"] if args.compile else []
        cold_s, cold_out, _ = deploy(*extra)
    builders = compiled_on(cold_out)
    rerun_s, _, rerun_changed = deploy("-e", "llamafleet_skip_when_in_sync=false")
    stamped = [deploy() for _ in range(2)]
    in_sync = all(IN_SYNC in out for _, out, _ in stamped)
    print(f"| cold deploy of {args.hosts} bare lab hosts ({'compiling' if args.compile else 'artifact cache'}) "
          f"| {cold_s:.1f} s |")
    print(f"| llama.cpp compiled | {len(builders)} time(s) ({', '.join(builders) or 'none: from the artifact cache'}) |")
    print(f"| idempotent re-run, every task | {rerun_s:.1f} s, changed={rerun_changed} |")
    print(f"| idempotent re-run, every host in sync with its stamp | "
          f"{' and '.join(f'{seconds:.1f} s' for seconds, _, _ in stamped)}, "
          f"changed={sum(changed for _, _, changed in stamped)}{'' if in_sync else ', NOT in sync'} |")
    ok = rerun_changed == 0 and len(builders) <= 1 and in_sync and not any(changed for _, _, changed in stamped)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
