# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The work of the ``rpc_plan`` module: plan the split, render llama-server's argv and unit, write the unit.

The module's ``main()`` only builds the AnsibleModule and hands it to
:func:`run_rpc_plan`, which returns the result to exit with (as the
community.crypto modules hand off to their module_utils). This file uses the
AnsibleModule it is given (fail_json, warn, check mode, atomic_move) and is not
part of the library's ``llamafleet.core`` API.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

from .backends import BACKENDS
from .gguf import GGUFError
from .gguf_facts import model_facts
from .llama_flags import FlagError, render_llama_server_argv
from .constants import PLAN_SWITCH_UNIT
from .gate_config import degrade_plans, plan_workers
from .split_plan import PlanError, plan_split
from .systemd_unit import render_exec_dropin, render_systemd_unit

UNIT_MODE = 0o644


def server_features(features: Any) -> dict:
    """llama-server's part of ``llamacpp_info``'s features (or the features as given)."""
    return features.get("llama_server", features) if isinstance(features, dict) else {}


_UNREAD = object()


def write_text_file(module: Any, path: str, text: str, result: dict, before: Any = _UNREAD) -> None:
    """Write ``text`` to ``path`` (mode 0644) when it differs, atomically; record ``changed`` and ``diff``.

    ``before``: the file's text as the caller already read it (None: absent), else it is read here.
    """
    if before is _UNREAD:
        before = None
        if os.path.exists(path):
            with open(path, "rb") as handle:
                before = handle.read().decode("utf-8", errors="replace")
    if before != text:
        result["changed"] = True
        result["diff"] = {"before": before or "", "after": text,
                          "before_header": path if before is not None else "%s (absent)" % path,
                          "after_header": path}
        if not module.check_mode:
            directory = os.path.dirname(path) or "."
            if not os.path.isdir(directory):
                module.fail_json(msg="unit_path directory %s does not exist" % directory)
            fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(path), dir=directory)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(text.encode("utf-8"))
                os.chmod(tmp, UNIT_MODE)
                module.atomic_move(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    if not os.path.exists(path):
        return
    if module.check_mode:
        if (os.stat(path).st_mode & 0o7777) != UNIT_MODE:
            result["changed"] = True
    else:
        result["changed"] = module.set_mode_if_different(path, "0644", result["changed"])


def _facts(module: Any) -> dict:
    params = module.params
    if params["model_facts"] is not None:
        return params["model_facts"]
    try:
        return model_facts(params["model"])
    except (GGUFError, OSError) as exc:
        module.fail_json(msg="cannot read model %s: %s" % (", ".join(params["model"]), exc))
    raise AssertionError("fail_json returned")  # pragma: no cover


def read_recorded(module: Any) -> dict:
    """``identity`` and ``keep`` of the plan recorded at ``recorded_plan`` (empty when there is none or it is
    unreadable: then the split is planned afresh, with a warning for a file that cannot be read); the role compares
    them with the new plan's to decide whether to record it again, without reading the file a second time."""
    path = module.params.get("recorded_plan")
    if not path or not os.path.exists(path):
        return {"identity": "", "keep": {}}
    try:
        with open(path, "rb") as handle:
            recorded = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        module.warn("recorded_plan %s cannot be read (%s): the split is planned afresh" % (path, exc))
        return {"identity": "", "keep": {}}
    recorded = recorded if isinstance(recorded, dict) else {}
    keep = recorded.get("keep")
    return {"identity": recorded.get("identity") or "", "keep": keep if isinstance(keep, dict) else {}}


def _plan_over(params: dict, facts: dict, workers: list, keep: dict | None = None) -> dict:
    """plan_split over ``workers`` with the module's settings (raises PlanError)."""
    return plan_split(
        workers, params["orchestrator"] or None, facts,
        ctx_size=params["ctx_size"], n_parallel=params["n_parallel"],
        cache_type_k=params["cache_type_k"], cache_type_v=params["cache_type_v"],
        compute_mib=params["compute_mib"], tensor_split=params["tensor_split"] or None,
        kv_unified=params["kv_unified"], policy=params["policy"], link_rtt_ms=params["link_rtt_ms"],
        cpu_layers=params["cpu_layers"], keep=keep, max_tokens=params["max_tokens"],
    )


def _plan(module: Any, facts: dict, keep: dict) -> dict:
    params = module.params
    try:
        return _plan_over(params, facts, params["workers"], keep)
    except PlanError as exc:
        host = (params["orchestrator"] or {}).get("host")
        module.fail_json(msg="%s: %s" % (host, exc) if host else str(exc))
    raise AssertionError("fail_json returned")  # pragma: no cover


def degraded_plan_name(host: str) -> str:
    """The name of the plan without worker ``host`` (its drop-in is DEGRADED_PLANS_DIR/NAME.conf)."""
    return "without-" + re.sub(r"[^A-Za-z0-9_.-]", "_", host)


def _degraded(module: Any, facts: dict, keep: dict) -> list[dict]:
    """For each worker host, the plan over the other workers: ``{without, name, fits, reason, rpc,
    tensor_split, dropin}`` (``dropin``: llama-server's ExecStartPre and ExecStart for it; a fixed
    ``tensor_split`` is dropped, the planner splits over what is left; ``keep``: the deployed plans' splits by name,
    kept as the main plan's is)."""
    params = dict(module.params, tensor_split=None)
    hosts = list(dict.fromkeys(str(worker.get("host")) for worker in module.params["workers"]))
    out = []
    for host in hosts:
        rest = [worker for worker in module.params["workers"] if str(worker.get("host")) != host]
        entry = {"without": host, "name": degraded_plan_name(host), "fits": False, "reason": "", "rpc": [],
                 "tensor_split": None, "dropin": ""}
        try:
            plan = _plan_over(params, facts, rest, keep.get(entry["name"]))
        except PlanError as exc:
            entry["reason"] = "the model does not fit without %s: %s" % (host, exc)
            out.append(entry)
            continue
        argv, pre, comments = _render_parts(module, plan)
        comments.insert(0, "degraded plan %s: llama-server without worker %s (llama_server_degrade), put in place "
                           "by %s at the serving gate's request" % (entry["name"], host, PLAN_SWITCH_UNIT))
        entry.update(fits=True, reason="fits on the other workers: %s" % _split_comment(plan), rpc=plan["rpc"],
                     tensor_split=plan["tensor_split"], keep=plan["keep"],
                     dropin=render_exec_dropin(argv, pre, header=module.params["unit_header"], comments=comments))
        out.append(entry)
    return out


def _split_comment(plan: dict) -> str:
    rpc = ",".join(plan["rpc"]) or "-"
    if plan["tensor_split"] is None:
        return "split: --rpc %s, policy fit (llama.cpp fits -ngl and -ts at load)" % rpc
    cpu = ", layers 0-%d on the CPU (-ngl %d)" % (plan["cpu_layers"] - 1, plan["ngl"]) if plan.get("cpu_layers") else ""
    return "split: --rpc %s -ts %s (policy %s%s)" % (rpc, plan["tensor_split_arg"], plan["policy"], cpu)


def _render_parts(module: Any, plan: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """llama-server's argv for ``plan``, its ExecStartPre (the wait for the plan's workers) and the unit's
    comment lines (fails the module on a flag error)."""
    params = module.params
    server = params["server"]
    unit_opts = params["unit"]
    pre = [[unit_opts["wait_helper"]] + plan["rpc"]] if unit_opts["wait_helper"] and plan["rpc"] else []
    comments = ["llama.cpp build %s" % unit_opts["build_id"]] if unit_opts["build_id"] else []
    comments.append(_split_comment(plan))
    try:
        argv = render_llama_server_argv(
            params["binary"], plan, server_features(params["features"]), params["model"],
            host=server["host"], port=server["port"], metrics=server["metrics"],
            api_key_file=server["api_key_file"] or None, chat_template=server["chat_template"] or None,
            load_mode=server["load_mode"], pin_devices=server["pin_devices"],
            log_verbosity=server["log_verbosity"], extra_args=server["extra_args"],
            alias=server.get("alias") or None, jinja=server.get("jinja"),
            chat_template_file=server.get("chat_template_file") or None,
        )
    except FlagError as exc:
        module.fail_json(msg=str(exc), plan=plan)
    return argv, pre, comments


def unit_environment(devices: list, given: dict) -> dict:
    """llama-server's environment: ``given``, and what the backend of each local device in the plan sets
    (module_utils/backends.py, such as cuda's CUDA_DEVICE_ORDER) where ``given`` does not."""
    environment = dict(given)
    for backend in sorted({d["backend"] for d in devices if d["local"]} & set(BACKENDS)):
        for name, value in BACKENDS[backend].unit_environment.items():
            environment.setdefault(name, value)
    return environment


def _render(module: Any, plan: dict) -> tuple[list[str], str]:
    params = module.params
    server = params["server"]
    unit_opts = params["unit"]
    home = unit_opts["home"]
    read_write = list(unit_opts["read_write_paths"])
    if home and home not in read_write:
        read_write.insert(0, home)
    argv, pre, comments = _render_parts(module, plan)
    environment = unit_environment(plan["devices"], unit_opts["environment"])
    try:
        unit = render_systemd_unit(
            argv, header=params["unit_header"], description=unit_opts["description"],
            user=unit_opts["user"], group=unit_opts["group"],
            working_directory=unit_opts["working_directory"] or home,
            read_write_paths=read_write, read_only_paths=unit_opts["read_only_paths"],
            environment=environment,
            limit_memlock_infinity=server["load_mode"] in ("mlock", "mmap+mlock"),
            protect_home=unit_opts["protect_home"], exec_start_pre=pre, comments=comments,
            timeout_start_sec=unit_opts["timeout_start_sec"],
        )
    except FlagError as exc:
        module.fail_json(msg=str(exc), plan=plan)
    return argv, unit


def run_rpc_plan(module: Any) -> dict:
    """Plan, render and write as the module's parameters ask; the result to exit with (fails through ``module``)."""
    params = module.params
    facts = _facts(module)
    recorded = read_recorded(module)
    keep = json.loads(json.dumps(recorded["keep"]))
    plan = _plan(module, facts, keep)
    result = {"changed": False, "plan": plan, "recorded": recorded, "explain": plan["explanation"], "argv": [], "unit": "",
              "gate_workers": plan_workers(plan["devices"]), "degraded": [], "gate_degrade": degrade_plans([])}
    for warning in plan["warnings"]:
        module.warn(warning)
    if not params["binary"]:
        if params["unit_path"]:
            module.fail_json(msg="unit_path needs binary (the llama-server path) and features", plan=plan)
        return result
    if params["features"] is None:
        module.fail_json(msg="features is required to render llama-server (register llamacpp_info and pass its "
                             "features)", plan=plan)
    if not params["model"]:
        module.fail_json(msg="model (the GGUF path on this host) is required to render llama-server", plan=plan)
    result["argv"], result["unit"] = _render(module, plan)
    if params["degrade"]:
        result["degraded"] = _degraded(module, facts, keep.get("degraded") or {})
        result["gate_degrade"] = degrade_plans(result["degraded"])
        plan["keep"]["degraded"] = {entry["name"]: entry.pop("keep") for entry in result["degraded"] if entry["fits"]}
    if params["unit_path"]:
        write_text_file(module, params["unit_path"], result["unit"], result)
    if not module._diff:
        result.pop("diff", None)
    return result
