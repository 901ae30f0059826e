#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Measure how long the lab takes: `llamafleet lab up` and `lab down` wall times for N hosts.

Runs the real CLI, as a user would.  If the base image for the current
configuration is not cached yet, the first `lab up` builds it (debootstrap) and
is reported separately as "first ever"; `--first-ever` deletes the cached image
beforehand to measure exactly that (minutes, and network traffic to the Debian
mirror), and `--cache EMPTY_DIR` measures a fresh machine's first run, which also
fetches the llama.cpp source and the model.  The lab is left down afterwards.

    python -m benchmarks.lab_speed [--hosts 3] [--runs 3] [--first-ever] [--cache DIR] [--json FILE]

Targets: 3 hosts up from a cached image <= 60 s, first ever <= 180 s, down <= 15 s.
Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from llamafleet.lab.image import IMAGE_PACKAGES, SUITE, BaseImage, detect_mirror, image_key
from llamafleet.lab.paths import LabPaths
from llamafleet.lab.system import remove_tree

TARGETS = {"first_ever_up_s": 180.0, "cached_up_s": 60.0, "down_s": 15.0}


def timed_cli(*args: str) -> float:
    """Run `llamafleet ARGS` (this Python's), fail loudly if it fails, return its wall time."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llamafleet", *args], capture_output=True, text=True, check=False,
                          cwd=ROOT)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"llamafleet {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="cached up/down cycles to measure (default 3)")
    parser.add_argument("--first-ever", action="store_true", help="delete the cached base image first")
    parser.add_argument("--cache", type=Path,
                        help="use this cache root instead of $LLAMAFLEET_CACHE: with an empty directory, "
                             "the first run is a fresh machine's (artifacts, key, image)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("lab_speed: the lab needs root")
    if args.cache:
        os.environ["LLAMAFLEET_CACHE"] = str(args.cache.resolve())

    paths = LabPaths.default()
    key = image_key(SUITE, IMAGE_PACKAGES, detect_mirror())
    image = BaseImage(key, paths.images_dir / key)
    timed_cli("lab", "down")  # start from nothing
    if args.first_ever and image.directory.exists():
        remove_tree(image.directory)
    results: dict[str, object] = {"hosts": args.hosts, "image": image.key}
    if not image.is_complete():
        results["first_ever_up_s"] = round(timed_cli("lab", "up", "--hosts", str(args.hosts)), 2)
        results["first_ever_down_s"] = round(timed_cli("lab", "down"), 2)
    ups, downs = [], []
    for _ in range(args.runs):
        ups.append(timed_cli("lab", "up", "--hosts", str(args.hosts)))
        downs.append(timed_cli("lab", "down"))
    results |= {
        "cached_up_s": round(statistics.median(ups), 2), "cached_up_runs_s": [round(u, 2) for u in ups],
        "down_s": round(statistics.median(downs), 2), "down_runs_s": [round(d, 2) for d in downs],
    }

    print(f"lab with {args.hosts} hosts (base image {image.key}), wall times, median of {args.runs}:")
    rows = [("first ever lab up (builds the image)", "first_ever_up_s"), ("lab up, cached image", "cached_up_s"),
            ("lab down", "down_s")]
    for label, key in rows:
        if key in results:
            value = float(results[key])  # type: ignore[arg-type]
            verdict = "ok" if value <= TARGETS[key] else "OVER TARGET"
            print(f"  {label:<34} {value:7.2f} s   (target <= {TARGETS[key]:.0f} s: {verdict})")
    if "first_ever_up_s" not in results:
        print("  first ever lab up: not measured (image cached; pass --first-ever to rebuild it)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0 if all(float(results[k]) <= t for k, t in TARGETS.items() if k in results) else 1  # type: ignore[arg-type]


if __name__ == "__main__":
    raise SystemExit(main())
