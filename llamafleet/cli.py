"""The ``llamafleet`` command line: a thin layer over the library.

Each command group lives in its own module and exposes ``register(subparsers)``;
the module's handlers receive the parsed ``argparse.Namespace`` and return an
exit status.  Errors meant for the user are raised as ``llamafleet.errors.UserError``
and printed without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import UserError

# Command groups, in the order ``--help`` lists them.  A module is imported
# only when the CLI starts, so a missing optional dependency of one group
# (matplotlib for plots, say) never breaks the others.
COMMAND_MODULES = (
    "llamafleet.lab.cli",
    "llamafleet.demo",
    "llamafleet.fleet_cli",
    "llamafleet.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamafleet",
        description="Distributed llama.cpp RPC fleets: lab, status, probes, logs, benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"llamafleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # that command group is not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"llamafleet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llamafleet: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
