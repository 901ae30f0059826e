"""What the roles hand each other is explicit, and the private _common role is used as documented.

- A role reads another role's output fact (llamacpp_build_info, model_info, rpc_server_endpoints) only as
  the default of one of its own documented inputs, so it can run alone given those inputs.
- _common refuses to run on its own; each of its entry points documents exactly the _common_* variables its
  tasks read, and every include of it passes exactly the required ones.
- The preflight of every role with one is skipped once deploy.yml's preflight play has run
  (_llamafleet_preflight_done), and deploy.yml sets that fact only after every role's preflight.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ROLES = REPO / "roles"
PUBLIC = sorted(p.name for p in ROLES.iterdir() if (p / "tasks" / "main.yml").is_file() and not p.name.startswith("_"))
# The roles deploy.yml applies (bench drives llama_server from playbooks/bench.yml and checks its own input;
# monitoring runs from playbooks/monitoring.yml, after a deploy).
DEPLOY = [r for r in PUBLIC if r not in ("bench", "monitoring")]
# Each role's output fact.
OUTPUTS = {"llamacpp_build": "llamacpp_build_info", "model": "model_info", "rpc_server": "rpc_server_endpoints"}
# Cross-role reads outside defaults: llama_server collects the workers' endpoints from its workers group;
# bench saves them, points them at its latency proxies for llama_server, and gives them back.
ALLOWED = {("llama_server", "rpc_server_endpoints"), ("bench", "rpc_server_endpoints")}


def _load(path: Path):
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _role_files(role: str) -> list[Path]:
    """The role's logic: everything but its user-facing defaults and their documentation."""
    root = ROLES / role
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".yml", ".j2")
                  and p.relative_to(root).as_posix() not in ("defaults/main.yml", "meta/argument_specs.yml"))


def test_the_public_roles() -> None:
    assert PUBLIC == ["bench", "edge", "llama_server", "llamacpp_build", "model", "monitoring", "rpc_server"]


# Task keywords whose values are bare Jinja expressions.
CONDITIONALS = ("when", "that", "failed_when", "changed_when", "until")


def _walk_conditionals(node) -> list[str]:
    if isinstance(node, list):
        return [e for item in node for e in _walk_conditionals(item)]
    if not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        if key in CONDITIONALS:
            found.extend(str(v) for v in (value if isinstance(value, list) else [value]))
        else:
            found.extend(_walk_conditionals(value))
    return found


def _expressions(path: Path) -> list[str]:
    """The Jinja a file evaluates ({{ }}, {% %} and bare conditionals), names of constants removed."""
    text = path.read_text(encoding="utf-8")
    found = re.findall(r"\{\{(.*?)\}\}|\{%(.*?)%\}", text, re.DOTALL)
    exprs = [a or b for a, b in found]
    if path.suffix == ".yml":
        exprs += _walk_conditionals(yaml.safe_load(text))
    return [re.sub(r"lookup\(\s*'llamafleet\.cluster\.constants'\s*,\s*'\w+'\s*\)", "lookup()", e) for e in exprs]


@pytest.mark.parametrize("role", PUBLIC)
def test_roles_read_other_roles_only_through_their_inputs(role: str) -> None:
    others = "|".join(r for r in PUBLIC if r != role)
    foreign = re.compile(r"(?<![\w.])(%s)_[a-z0-9_]+\b" % others)
    found = {(path.relative_to(ROLES).as_posix(), m.group(0))
             for path in _role_files(role) for e in _expressions(path) for m in foreign.finditer(e)}
    assert {name for _path, name in found if (role, name) not in ALLOWED} == set(), sorted(found)


def test_the_interface_check_sees_reads() -> None:
    """The check above finds what it looks for (llama_server reads the workers' endpoints)."""
    assert any("rpc_server_endpoints" in e for e in _expressions(ROLES / "llama_server" / "tasks" / "configure.yml"))


@pytest.mark.parametrize(("role", "source"), [(r, s) for r in PUBLIC for s in OUTPUTS if s != r])
def test_other_roles_outputs_are_input_defaults(role: str, source: str) -> None:
    """Where a role uses another's output, a documented input of its own defaults to it."""
    fact = OUTPUTS[source]
    defaults = _load(ROLES / role / "defaults" / "main.yml")
    using = [k for k, v in defaults.items() if isinstance(v, str) and re.search(r"\b%s\b" % fact, v)]
    specs = _load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"]["main"]["options"]
    for name in using:
        assert name.startswith(role + "_") and name in specs, name
        assert fact in " ".join(specs[name]["description"] if isinstance(specs[name]["description"], list)
                                else [specs[name]["description"]]) or fact in str(specs[name]["default"])


@pytest.mark.parametrize(("role", "fact"), [("rpc_server", "llamacpp_build_info"), ("rpc_server", "model_info"),
                                            ("llama_server", "llamacpp_build_info"), ("llama_server", "model_info")])
def test_inputs_that_default_to_another_roles_output(role: str, fact: str) -> None:
    defaults = _load(ROLES / role / "defaults" / "main.yml")
    assert any(re.search(r"\b%s\b" % fact, str(v)) for v in defaults.values()), (role, fact)


def test_common_refuses_to_run_alone() -> None:
    tasks = _load(ROLES / "_common" / "tasks" / "main.yml")
    assert [next(k for k in t if k.startswith("ansible.builtin.")) for t in tasks] == ["ansible.builtin.fail"]


COMMON_SPECS = _load(ROLES / "_common" / "meta" / "argument_specs.yml")["argument_specs"]
ENTRY_POINTS = sorted(name for name in COMMON_SPECS if name != "main")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_common_entry_points_document_what_they_read(entry: str) -> None:
    path = ROLES / "_common" / "tasks" / ("%s.yml" % entry)
    local = {name for task in _load(path) for name in task.get("vars", {})}
    read = set(re.findall(r"(?<![\w])_common_\w+", path.read_text(encoding="utf-8"))) - local
    assert read == set(COMMON_SPECS[entry]["options"])
    assert all(spec.get("required") for spec in COMMON_SPECS[entry]["options"].values())


def _common_includes() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(ROLES.glob("*/tasks/*.yml")):
        for task in _load(path) or []:
            include = task.get("ansible.builtin.include_role") or {}
            if include.get("name") == "llamafleet.cluster._common":
                found.append(("%s %s" % (path.relative_to(ROLES), include["tasks_from"]), task))
    return found


def test_both_service_roles_use_common() -> None:
    assert sorted(where.split("/")[0] + " " + where.rsplit(" ", 1)[1] for where, _task in _common_includes()) == [
        # llama_server checks three ports: the clients' (the edge's or the gate's), the gate's loopback one behind the
        # edge and llama-server's loopback one
        "bench port_check", "llama_server port_check", "llama_server port_check", "llama_server port_check",
        "llama_server supported_system",
        "llama_server user", "llama_server user_absent",
        "llamacpp_build prune", "llamacpp_build supported_system", "model prune",
        "rpc_server port_check", "rpc_server supported_system", "rpc_server user", "rpc_server user_absent"]


@pytest.mark.parametrize(("where", "task"), _common_includes(), ids=lambda v: v if isinstance(v, str) else "")
def test_common_includes_pass_exactly_the_entry_points_options(where: str, task: dict) -> None:
    entry = task["ansible.builtin.include_role"]["tasks_from"]
    assert set(task.get("vars", {})) == set(COMMON_SPECS[entry]["options"]), where


@pytest.mark.parametrize("role", DEPLOY)
def test_role_preflight_is_skipped_after_the_playbooks(role: str) -> None:
    main = _load(ROLES / role / "tasks" / "main.yml")
    preflight = [t for t in main if (t.get("ansible.builtin.include_tasks") or {}).get("file") == "preflight.yml"]
    assert len(preflight) == 1 and "_llamafleet_preflight_done" in preflight[0]["when"], role


def test_deploy_runs_every_preflight_then_records_it() -> None:
    plays = _load(REPO / "playbooks" / "_preflight.yml")
    play = next(p for p in plays if any("_llamafleet_preflight_done" in (t.get("ansible.builtin.set_fact") or {})
                                        for t in p.get("tasks", [])))
    tasks = play["tasks"]
    # last, the stamps go (test_the_preflight_forgets_the_stamps_under_every_tag_that_changes_hosts)
    assert tasks[-1]["llamafleet.cluster.deploy_stamp"] == {"state": "absent"}
    tasks = tasks[:-1]
    includes = [t for t in tasks if (t.get("ansible.builtin.include_role") or {}).get("tasks_from") == "preflight"]
    roles = [t["ansible.builtin.include_role"]["name"].rsplit(".", 1)[1] for t in includes]
    assert sorted(roles) == DEPLOY
    # first the checks of the inventory's groups (run once), then every role's preflight, then the checks
    # across hosts (run once, on what every host's preflight computed), then the orchestrator's fit check (from what
    # the preflights read: the model's header, the workers' devices), then the record
    first = tasks.index(includes[0])
    assert first > 0 and all(t.get("run_once") for t in tasks[:first])
    across = tasks[first + len(includes):-2]
    assert tasks[first:first + len(includes)] == includes and across and all(t.get("run_once") for t in across)
    assert tasks[-2]["ansible.builtin.include_role"] == {"name": "llamafleet.cluster.llama_server",
                                                         "tasks_from": "fit_check"}
    assert tasks[-2]["when"] == "inventory_hostname in _llamafleet_orchestrators"
    # ...which also drops the listeners its port checks shared (roles/_common/tasks/port_check.yml), so a later
    # check reads them again
    assert tasks[-1]["ansible.builtin.set_fact"] == {"_llamafleet_preflight_done": True, "__common_tcp_listeners": None}
    # ...imported by deploy.yml and upgrade.yml before any play that applies a role
    for name in ("deploy.yml", "upgrade.yml"):
        entries = _load(REPO / "playbooks" / name)
        first_role = min(i for i, p in enumerate(entries) if p.get("roles"))
        imports = [i for i, p in enumerate(entries) if p.get("ansible.builtin.import_playbook") == "_preflight.yml"]
        assert len(imports) == 1 and imports[0] < first_role, name


def test_the_preflight_forgets_the_stamps_under_every_tag_that_changes_hosts() -> None:
    """A run with any tag of a deploy role (not its preflight's) forgets the stamps; --tags election_only or preflight
    keeps them."""
    changing = set()
    for role in DEPLOY:
        for path in sorted((ROLES / role / "tasks").glob("*.yml")):
            for tags in re.findall(r"tags: \[([^\]]*)\]", path.read_text(encoding="utf-8")):
                changing |= {tag.strip() for tag in tags.split(",")}
    changing = {tag for tag in changing if tag != "always" and not tag.endswith("_preflight")}
    assert {"llamacpp_build", "model", "rpc_server", "llama_server", "edge", "llama_server_share"} <= changing
    plays = _load(REPO / "playbooks" / "_preflight.yml")
    forget = [t for p in plays for t in p.get("tasks", []) if "llamafleet.cluster.deploy_stamp" in t]
    assert len(forget) == 1 and forget[0]["llamafleet.cluster.deploy_stamp"] == {"state": "absent"}
    assert set(forget[0]["tags"]) == changing
