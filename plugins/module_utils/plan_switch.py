# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The plan switch (root; ``python3 -m llamafleet_host.serving_gate switch ...``, started by its path unit): puts
the plan the gate asks for in place as llama-server's runtime drop-in, and restarts llama-server.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .atomic_file import write_text_atomic
from .gate_config import FULL_PLAN, PLAN_NAME
from .host_observation import command_output


def switch_plan(request: Any, plans_dir: str, current: str | None) -> tuple[str | None, str]:
    """The drop-in text for ``request`` ({"plan": "full" | NAME}; NAME a file NAME.conf in ``plans_dir``, which
    only the deploy writes) and what it does; None removes the drop-in. ``current``: the drop-in now.
    Raises ValueError for a request that names no plan of ``plans_dir``."""
    if not isinstance(request, dict) or not isinstance(request.get("plan"), str):
        raise ValueError("the request must be {\"plan\": NAME}, got %r" % (request,))
    name = request["plan"]
    if name == FULL_PLAN:
        return None, "the full plan" + (" (no degraded plan in place)" if current is None else "")
    if not PLAN_NAME.match(name):
        raise ValueError("%r is not a plan name" % name)
    path = os.path.join(plans_dir, name + ".conf")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read(), "plan %s (%s)" % (name, path)
    except OSError as exc:
        raise ValueError("no plan %s: %s" % (name, exc)) from None


def switch_main(argv: list[str]) -> int:
    """``python3 -m llamafleet_host.serving_gate switch --request FILE --plans DIR --dropin FILE --unit UNIT``
    (root)."""
    import argparse

    parser = argparse.ArgumentParser(prog="llamafleet-plan-switch")
    for option in ("--request", "--plans", "--dropin", "--unit"):
        parser.add_argument(option, required=True)
    args = parser.parse_args(argv)
    say = "llamafleet-plan-switch: "
    try:
        with open(args.request, encoding="utf-8") as handle:
            request = json.load(handle)
    except FileNotFoundError:
        sys.stdout.write(say + "no request (the gate stopped): nothing to do\n")
        return 0
    except (OSError, ValueError) as exc:
        sys.stderr.write(say + "cannot read %s: %s\n" % (args.request, exc))
        return 1
    try:
        with open(args.dropin, encoding="utf-8") as handle:
            current: str | None = handle.read()
    except FileNotFoundError:
        current = None
    try:
        text, what = switch_plan(request, args.plans, current)
    except ValueError as exc:
        sys.stderr.write(say + "refused: %s\n" % exc)
        return 1
    if text == current:
        sys.stdout.write(say + "%s is already in place\n" % what)
        return 0
    if text is None:
        os.unlink(args.dropin)
    else:
        os.makedirs(os.path.dirname(args.dropin), exist_ok=True)
        write_text_atomic(args.dropin, text)
    sys.stdout.write(say + "switching llama-server to %s (%s)\n" % (what, request.get("reason", "")))
    for command in (["systemctl", "daemon-reload"], ["systemctl", "restart", "--no-block", args.unit]):
        if command_output(command) is None:
            sys.stderr.write(say + "%s failed\n" % " ".join(command))
            return 1
    return 0
