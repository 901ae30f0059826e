#!/usr/bin/env python3
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Measure FNV-1a 64 hashing speed: the C helper against the pure-Python fallback.

Compiles roles/llamacpp_build/files/llamafleet-fnv1a64.c with ``gcc -O2`` into a
temporary directory and hashes a GGUF file (default: the gemma-3-270m test
model) with both, after reading it once so the page cache serves every pass.
The Python fallback only hashes the first --python-mb megabytes: at its speed
the whole file would take minutes. Both must agree on that prefix.

    python -m benchmarks.fnv_speed [FILE] [--python-mb 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from llamafleet.core import fnv

DEFAULT_FILE = "/var/cache/llamafleet/models/gemma-3-270m-q4_k_m.gguf"
SOURCE = os.path.join(ROOT, "roles", "llamacpp_build", "files", "llamafleet-fnv1a64.c")


def best_of(repeat: int, func) -> tuple[float, object]:
    """Smallest wall time of ``repeat`` calls, and the last result."""
    best = float("inf")
    result = None
    for dummy in range(repeat):
        start = time.perf_counter()
        result = func()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("file", nargs="?", default=DEFAULT_FILE)
    parser.add_argument("--python-mb", type=float, default=8.0, help="megabytes hashed by the Python fallback")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    size = os.path.getsize(args.file)
    with open(args.file, "rb") as handle:  # warm the page cache
        while handle.read(16 << 20):
            pass

    with tempfile.TemporaryDirectory() as tmp:
        helper = os.path.join(tmp, fnv.HELPER_NAME)
        subprocess.run(["gcc", "-O2", "-pthread", "-o", helper, SOURCE], check=True)
        seconds, names = best_of(args.repeat, lambda: fnv.hash_ranges(args.file, [(0, size)], helper=helper))
        print("C helper (gcc -O2), 1 thread: %8.1f MB/s  (%d MB in %.3f s, hash %s)"
              % (size / seconds / 1e6, size // 1000000, seconds, names[0]))
        half = size // 2
        seconds2, dummy = best_of(args.repeat, lambda: fnv.hash_ranges(
            args.file, [(0, half), (half, size - half)], helper=helper, jobs=2))
        print("C helper, 2 ranges, -j 2:     %8.1f MB/s" % (size / seconds2 / 1e6))

        prefix = min(size, int(args.python_mb * 1e6))
        py_seconds, py_names = best_of(1, lambda: fnv.hash_ranges_python(args.file, [(0, prefix)]))
        c_prefix = fnv.hash_ranges(args.file, [(0, prefix)], helper=helper)
        print("Python fallback:              %8.1f MB/s  (%.1f MB in %.2f s)"
              % (prefix / py_seconds / 1e6, prefix / 1e6, py_seconds))
        if py_names != c_prefix:
            print("MISMATCH on the first %d bytes: helper %s, Python %s" % (prefix, c_prefix[0], py_names[0]))
            return 1
        speedup = (size / seconds) / (prefix / py_seconds)
        print("helper is %.0fx faster; both give %s for the first %d bytes" % (speedup, c_prefix[0], prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
