"""The monitoring role and the workers' textfile metrics: the dashboard asks only for metrics that exist, the
templates render what Prometheus, systemd and the metrics writer expect, and deploy.yml writes the file_sd targets.

The metric names come from real sources: llama-server's /metrics of the llama.cpp build the project deploys
(tests/unit/fixtures/monitoring, recorded after one completion), the textfile writer's own output, and the metric
families a real node_exporter 1.5.0 (Debian 12's) served. The renders run ansible-playbook on localhost (connection
local, no lab).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from llamafleet.core import constants as c
from llamafleet.core import gate_metrics as gm
from llamafleet.core import rpc_metrics as rm
from llamafleet.core.systemd_unit import render_rpc_server_unit
from ansible_collections.llamafleet.cluster.plugins.filter.host_files import host_package_files
from tests.unit.gate_exposition import lab_exposition, parse_exposition

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "roles" / "monitoring"
FIXTURES = REPO / "tests" / "unit" / "fixtures" / "monitoring"
DASHBOARD = ROLE / "files" / "llamafleet-dashboard.json"
BIN = Path(sys.executable).parent

# PromQL words that are not metric names: keywords, and aggregation modifiers whose label lists are removed first.
KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}


def _yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def exposition_names(text: str) -> set[str]:
    """The metric names of Prometheus text: every sample's name and every ``# TYPE`` line's."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (strings, label matchers, ranges, grouping lists and function
    names left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", text):  # not a duration's unit
        if text[match.end():].lstrip().startswith("(") or match.group(0) in KEYWORDS:
            continue
        names.add(match.group(0))
    return names


def dashboard_panels(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' panels included."""
    found = []
    for panel in node.get("panels", []):
        found.append(panel)
        found += dashboard_panels(panel)
    return found


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [target["expr"] for panel in dashboard_panels(dashboard) for target in panel.get("targets", [])]


def textfile_output() -> str:
    """What the workers' writer writes for a served rpc-server with a cache (the recorded ss and journal)."""
    answers = {("ss", "-ltnH"): "ss_ltnH_rpc-server_serving_real.txt",
               ("ss", "-tnH"): "ss_tnH_established_rpc-server_serving_real.txt",
               ("journalctl", "--no-pager"): "journalctl_252_json_rpc-server_connected_reconstructed.txt"}

    def run(argv: list[str]) -> str:
        if argv[0] == "systemctl":
            return "ActiveState=active\nInvocationID=7f3e9a1c5b2d4e6f8a0b1c2d3e4f5a6b\n"
        return (FIXTURES / answers[(argv[0], argv[1])]).read_text(encoding="utf-8")

    server = rm.Server("llamafleet-rpc-server.service", "127.0.0.1", 50391)
    return rm.render(rm.collect([server], "/cache", run, list_dir=lambda _path: [("f42cfb619b3cade9", 1)]))


SOURCES = {
    "llama-server /metrics": exposition_names(
        (FIXTURES / "llama-server_0c1e570_metrics_one_completion_real.txt").read_text(encoding="utf-8")),
    "textfile writer": exposition_names(textfile_output()),
    "node_exporter": exposition_names(
        (FIXTURES / "prometheus-node-exporter_1.5.0_types_and_textfile_real.txt").read_text(encoding="utf-8")),
    # the gate's own metrics and its worker links', rendered from the lab's real ss output (tests/unit/gate_exposition.py)
    "serving gate": exposition_names(lab_exposition()),
    "Prometheus": {"up"},
}


@pytest.mark.parametrize(("expr", "names"), [
    ('up{job="llamafleet-node"}', {"up"}),
    ("rate(llamacpp:tokens_predicted_total{job=\"x\"}[$__rate_interval])", {"llamacpp:tokens_predicted_total"}),
    ('time() - node_textfile_mtime_seconds{file=~".*/a[.]prom"}', {"node_textfile_mtime_seconds"}),
    ("sum by (llamafleet_host) (rate(a_total[5m])) / on (instance) group_left b", {"a_total", "b"}),
    ("max(llamacpp:kv_cache_usage_ratio) offset 5m", {"llamacpp:kv_cache_usage_ratio"}),
])
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_the_sources_know_what_this_build_exports() -> None:
    """The recorded build exports its counters and gauges, but no KV-cache usage (the dashboard cannot show one)."""
    llama = SOURCES["llama-server /metrics"]
    assert {"llamacpp:tokens_predicted_total", "llamacpp:requests_processing", "llamacpp:requests_deferred",
            "llamacpp:n_tokens_max"} <= llama
    assert not {"llamacpp:kv_cache_usage_ratio", "llamacpp:kv_cache_tokens"} & llama
    assert set(rm.METRICS) == SOURCES["textfile writer"]
    assert set(gm.GATE_METRICS) == SOURCES["serving gate"]


def test_every_metric_the_dashboard_asks_for_exists() -> None:
    known = set().union(*SOURCES.values())
    asked = {name: expr for expr in dashboard_exprs() for name in metric_names(expr)}
    assert asked, "the dashboard has no queries"
    missing = {name: expr for name, expr in asked.items() if name not in known}
    assert not missing, "the dashboard queries metrics no source exports: %s" % missing
    # it shows each source: llama-server, the workers' facts, the hosts
    for source in ("llama-server /metrics", "textfile writer", "serving gate", "node_exporter", "Prometheus"):
        assert set(asked) & SOURCES[source], "the dashboard shows nothing from %s" % source


def row_panels(title: str) -> list[dict[str, Any]]:
    """The panels of the dashboard's row whose title begins with ``title``: those after it up to the next row (or,
    collapsed, its own)."""
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    at = next(i for i, panel in enumerate(panels) if panel["type"] == "row" and panel["title"].startswith(title))
    after = panels[at + 1:]
    end = next((i for i, panel in enumerate(after) if panel["type"] == "row"), len(after))
    return panels[at].get("panels", []) + after[:end]


def test_the_worker_link_panels_show_what_the_gate_exports() -> None:
    """Every query of the "Worker links" row names a per-worker metric the gate serves (its exposition parsed, from
    the lab's real ss output), rates its counters and no gauge, selects the gate's job and names the worker; and
    every per-link family the gate serves is shown."""
    families = parse_exposition(lab_exposition())
    panels = row_panels("Worker links")
    shown: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = metric_names(expr)
            assert names and names <= set(families), (panel["title"], expr, names - set(families))
            for name in names:
                assert all(dict(labels).get("worker") for labels in families[name].samples), (name, expr)
                rated = re.search(r"\b(rate|increase)\(\s*%s\b" % re.escape(name), expr) is not None
                assert rated == (families[name].kind == "counter"), (panel["title"], expr)
            assert 'job="%s"' % c.PROMETHEUS_JOB_GATE in expr and "{{worker}}" in target["legendFormat"], expr
            shown |= names
    per_link = {name for name, family in families.items()
                if family.samples and all(dict(labels).get("worker") for labels in family.samples)}
    assert per_link and per_link == shown, sorted(per_link ^ shown)


def test_the_dashboard_selects_the_roles_jobs() -> None:
    jobs = {job for expr in dashboard_exprs() for job in re.findall(r'job="([^"]*)"', expr)}
    assert jobs == {c.PROMETHEUS_JOB_LLAMA_SERVER, c.PROMETHEUS_JOB_GATE, c.PROMETHEUS_JOB_NODE}


def test_the_dashboard_is_provisionable() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = dashboard_panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "llamafleet"
    assert [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    targets = [t for panel in panels for t in panel.get("targets", [])]
    assert targets and all(t["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for t in targets)


def _render(text: Any, variables: dict[str, Any] | None = None) -> Any:
    """A role's Jinja expression evaluated with the collection's own constants and host_package_files filter (the
    other variables undefined, but for ``variables``, as the role's vars/main.yml has them), as Ansible would: how
    the tests below read what a host_files task installs."""
    env = jinja2.Environment()
    env.filters["llamafleet.cluster.host_package_files"] = host_package_files
    table = c.as_dict()

    def lookup(name: str, key: str) -> Any:
        assert name == "llamafleet.cluster.constants", name
        value = table[key]
        return list(value) if isinstance(value, tuple) else value

    if not isinstance(text, str):
        return text
    if text.strip().startswith("{{") and text.strip().endswith("}}") and text.count("{{") == 1:
        return env.compile_expression(text.strip()[2:-2])(lookup=lookup, role_path="ROLE", **(variables or {}))
    return env.from_string(text).render(lookup=lookup, role_path="ROLE", **(variables or {}))


def _copies(path: Path) -> dict[str, str]:
    """dest -> src of the files the host_files tasks of a task file install (blocks included), their expressions
    evaluated; a task file must not copy the host scripts any other way."""
    tasks = _yaml(path)
    tasks = tasks + [t for block in tasks for t in block.get("block", [])]
    assert not [t for t in tasks if "ansible.builtin.copy" in t and "module_utils" in str(t)], path
    role_vars = path.parent.parent / "vars" / "main.yml"
    variables = _yaml(role_vars) if role_vars.exists() else {}
    copies = {}
    for task in (t for t in tasks if "llamafleet.cluster.host_files" in t):
        # the task's own vars as written (expressions over registered results are not evaluated here)
        files = _render(task["llamafleet.cluster.host_files"]["files"], {**variables, **task.get("vars", {})})
        for item in files:
            dest = _render(item["dest"])
            if isinstance(dest, str):  # not a role variable, left undefined here
                copies[dest] = _render(item["src"]) if "src" in item else ""
    return copies


@pytest.mark.parametrize("tasks, scripts", [
    ("rpc_server/tasks/install.yml", sorted(["__init__.py", *c.GATE_SCRIPTS, "systemd_show.py"])),
    ("rpc_server/tasks/textfile_metrics.yml", ["rpc_metrics.py"]),
    ("llama_server/tasks/install.yml", sorted(["__init__.py", "rpc_proto.py", *c.GATE_SCRIPTS, "systemd_show.py"])),
])
def test_the_roles_install_the_host_scripts_in_the_host_package(tasks: str, scripts: list[str]) -> None:
    """rpc_metrics.py imports the gate's modules relatively, and they systemd_show: all go to the host package
    (HOST_PACKAGE_DIR)."""
    package = c.HOST_PACKAGE_DIR + "/"
    copies = {dest[len(package):]: src for dest, src in _copies(REPO / "roles" / tasks).items() if dest.startswith(package)}
    assert sorted(copies) == scripts
    assert set(scripts) - {"__init__.py"} <= set(c.HOST_SCRIPTS)
    assert all(src.endswith("plugins/module_utils/" + name) for name, src in copies.items() if name != "__init__.py")


def _relative_imports(name: str) -> set[str]:
    """The module_utils files ``name`` imports relatively (``from .X import``), and theirs, ``name`` included."""
    found, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        tree = ast.parse((REPO / "plugins" / "module_utils" / current).read_text(encoding="utf-8"))
        todo += ["%s.py" % node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1]
    return found


def test_the_host_scripts_are_what_the_host_code_imports() -> None:
    """GATE_SCRIPTS is the gate's entry point and every module it imports (systemd_show.py, shared with the library,
    apart), so the roles' loop ships a new module of the gate; each host script's imports are host scripts. Nothing
    imports the entry point: run with ``-m`` it is ``__main__``, and an import would load it again under its name."""
    assert _relative_imports("serving_gate.py") - {"systemd_show.py"} == set(c.GATE_SCRIPTS)
    for name in c.HOST_SCRIPTS:
        assert _relative_imports(name) <= set(c.HOST_SCRIPTS), name
    everything = sorted(path.name for path in (REPO / "plugins" / "module_utils").glob("*.py"))
    assert not [name for name in everything if name != "serving_gate.py" and "serving_gate.py" in _relative_imports(name)]
    assert len(set(c.HOST_SCRIPTS)) == len(c.HOST_SCRIPTS)


def test_the_host_package_runs_without_the_library(tmp_path: Path) -> None:
    """HOST_SCRIPTS copied alone into a package, as the roles do, run as modules with HOST_PYTHON's Python path."""
    package = tmp_path / c.HOST_PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in c.HOST_SCRIPTS:
        shutil.copy(REPO / "plugins" / "module_utils" / name, package / name)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)}
    for module, args, rc, says in [(c.RPC_METRICS_MODULE, ["--help"], 0, "usage"), (c.GATE_MODULE, ["--help"], 0, "usage"),
                                   (c.RPC_PROBE_MODULE, ["--timeout", "1", "127.0.0.1:9"], 1, "did not answer HELLO")]:
        done = subprocess.run([sys.executable, "-s", "-m", module, *args], env=env,
                              capture_output=True, text=True, check=False, cwd=tmp_path.parent)
        assert done.returncode == rc and says in (done.stdout + done.stderr), (module, done.stdout, done.stderr)
    assert c.HOST_PYTHON[-1] == "-m" and "PYTHONPATH=%s" % c.LIBEXEC_DIR in c.HOST_PYTHON
    assert c.HOST_PACKAGE_DIR == "%s/%s" % (c.LIBEXEC_DIR, c.HOST_PACKAGE)


# ---------------------------------------------------------------------------------------------------------------------
# Renders with ansible-playbook on localhost

INVENTORY = """\
[llamafleet_orchestrator]
lab1 ansible_host=10.77.0.11 llamafleet_cluster_address=10.77.0.11

[llamafleet_workers]
lab2 ansible_host=10.77.0.12 llamafleet_cluster_address=10.77.0.12
lab3 ansible_host=fd00::13

[llamafleet:children]
llamafleet_orchestrator
llamafleet_workers

[all:vars]
ansible_connection=local
ansible_python_interpreter={python}
"""

# The templates with the roles' own defaults and vars, as the roles render them.
RENDER = """
- name: Render the monitoring and metrics templates
  hosts: lab2
  gather_facts: false
  vars_files:
    - {repo}/roles/monitoring/defaults/main.yml
    - {repo}/roles/monitoring/vars/main.yml
    - {repo}/roles/rpc_server/defaults/main.yml
    - {repo}/roles/rpc_server/vars/main.yml
  vars:
    rpc_server_bind_address: 10.77.0.12
  tasks:
    - name: Render prometheus.yml with and without the API key, and over https with a CA
      ansible.builtin.template:
        src: {repo}/roles/monitoring/templates/prometheus.yml.j2
        dest: "{out}/prometheus-{{{{ item.name }}}}.yml"
        mode: "0644"
      vars:
        __monitoring_key_stat: {{stat: {{exists: "{{{{ item.key }}}}"}}}}
        monitoring_llama_server_scheme: "{{{{ item.scheme }}}}"
        monitoring_llama_server_ca_file: "{{{{ item.ca }}}}"
      loop:
        - {{name: key, key: true, scheme: http, ca: ""}}
        - {{name: nokey, key: false, scheme: https, ca: /some/ca.pem}}

    - name: Render the metrics writer's units
      ansible.builtin.template:
        src: {repo}/roles/rpc_server/templates/rpc-metrics.{{{{ item }}}}.j2
        dest: "{out}/rpc-metrics.{{{{ item }}}}"
        mode: "0644"
      loop: [service, timer]
"""


def ansible_playbook(tmp_path: Path, playbook: Path, *args: str) -> subprocess.CompletedProcess:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(INVENTORY.format(python=sys.executable))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_GATHERING="explicit", ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), str(playbook), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("render")
    out = tmp_path / "out"
    out.mkdir()
    playbook = tmp_path / "render.yml"
    playbook.write_text(RENDER.format(repo=REPO, out=out))
    ansible_playbook(tmp_path, playbook)
    return out


def _jobs(path: Path) -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in _yaml(path)["scrape_configs"]}


def test_prometheus_scrapes_llama_server_through_the_gate_with_the_key(rendered: Path) -> None:
    jobs = _jobs(rendered / "prometheus-key.yml")
    assert set(jobs) == {"prometheus", c.PROMETHEUS_JOB_LLAMA_SERVER, c.PROMETHEUS_JOB_GATE, c.PROMETHEUS_JOB_NODE}
    assert jobs["prometheus"]["static_configs"] == [{"targets": ["127.0.0.1:%d" % c.PROMETHEUS_PORT]}]
    # llama-server's /metrics and the gate's own: the same targets (the gate's port), key and scheme
    for job, path in ((c.PROMETHEUS_JOB_LLAMA_SERVER, "/metrics"), (c.PROMETHEUS_JOB_GATE, c.GATE_METRICS_PATH)):
        scrape = jobs[job]
        assert (scrape["scheme"], scrape["metrics_path"]) == ("http", path) and "tls_config" not in scrape
        assert scrape["authorization"] == {"type": "Bearer",
                                           "credentials_file": "/etc/prometheus/llamafleet-llama-server.key"}
        assert scrape["file_sd_configs"] == [
            {"files": ["/etc/prometheus/file_sd/%s.json" % c.PROMETHEUS_JOB_LLAMA_SERVER]}]
    assert jobs[c.PROMETHEUS_JOB_NODE]["file_sd_configs"] == [
        {"files": ["/etc/prometheus/file_sd/%s.json" % c.PROMETHEUS_JOB_NODE]}]
    assert "authorization" not in jobs[c.PROMETHEUS_JOB_NODE]  # the key goes to llama-server only


def test_prometheus_without_a_key_over_https(rendered: Path) -> None:
    jobs = _jobs(rendered / "prometheus-nokey.yml")
    for job in (c.PROMETHEUS_JOB_LLAMA_SERVER, c.PROMETHEUS_JOB_GATE):
        assert "authorization" not in jobs[job] and jobs[job]["scheme"] == "https"
        assert jobs[job]["tls_config"] == {"ca_file": "/etc/prometheus/llamafleet-llama-server-ca.pem"}


def _service(text: str) -> tuple[list[str], list[str]]:
    """(ExecStart argv, the other lines of [Service]) of a unit's text."""
    service = text.split("[Service]", 1)[1].split("\n[", 1)[0].replace("\\\n", " ")
    lines = [line.strip() for line in service.splitlines() if line.strip() and not line.startswith("#")]
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    return exec_start[len("ExecStart="):].split(), [line for line in lines if line is not exec_start]


def test_the_metrics_writer_runs_for_every_rpc_server(rendered: Path) -> None:
    argv, _lines = _service((rendered / "rpc-metrics.service").read_text())
    start = len(c.HOST_PYTHON) + 1
    assert argv[:start] == [*c.HOST_PYTHON, c.RPC_METRICS_MODULE]
    options = dict(zip(argv[start::2], argv[start + 1::2]))
    assert options["--output"] == "%s/%s" % (c.NODE_EXPORTER_TEXTFILE_DIR, c.RPC_METRICS_FILE)
    assert options["--cache-dir"] == c.rpc_cache_dir()
    assert [rm.parse_server(a) for a in argv[start + 4:]] == [rm.Server(c.RPC_SERVER_UNIT, "10.77.0.12", c.RPC_SERVER_PORT)]


def test_the_metrics_writer_is_hardened_like_rpc_server(rendered: Path) -> None:
    """Every protection of the rpc-server unit, but for the capabilities (it keeps CAP_DAC_READ_SEARCH for the
    private cache), the address families (no IP at all) and the umask (node_exporter reads the file)."""
    _argv, lines = _service((rendered / "rpc-metrics.service").read_text())
    _rpc_argv, rpc_lines = _service(render_rpc_server_unit(["/opt/rpc-server"], "cpu", c.RPC_SERVER_PORT))
    differ = ("CapabilityBoundingSet=", "RestrictAddressFamilies=", "UMask=", "ReadWritePaths=", "User=", "Group=",
              "Type=", "Restart", "Environment=")
    wanted = {line for line in rpc_lines if not line.startswith(differ)}
    assert wanted and wanted <= set(lines), sorted(wanted - set(lines))
    assert {"Type=oneshot", "User=root", "CapabilityBoundingSet=CAP_DAC_READ_SEARCH", "AmbientCapabilities=",
            "RestrictAddressFamilies=AF_UNIX AF_NETLINK", "ReadWritePaths=" + c.NODE_EXPORTER_TEXTFILE_DIR} <= set(lines)


# The metrics writer's hardening as deployed hosts have it: the template reads the one list (unit_hardening),
# and a change of these lines would change the unit on every worker.
METRICS_HARDENING_DEPLOYED = """\
User=root
NoNewPrivileges=yes
ProtectSystem=strict
ReadWritePaths=%s
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectClock=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectHostname=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictNamespaces=yes
LockPersonality=yes
SystemCallArchitectures=native
CapabilityBoundingSet=CAP_DAC_READ_SEARCH
AmbientCapabilities=
RestrictAddressFamilies=AF_UNIX AF_NETLINK
UMask=0022
""" % c.NODE_EXPORTER_TEXTFILE_DIR


def test_the_metrics_writers_hardening_is_the_deployed_one(rendered: Path) -> None:
    text = (rendered / "rpc-metrics.service").read_text()
    assert text.endswith("\n" + METRICS_HARDENING_DEPLOYED), text[-1200:]


def test_the_timer_runs_at_once_then_every_interval(rendered: Path) -> None:
    text = (rendered / "rpc-metrics.timer").read_text()
    assert {"OnActiveSec=0", "OnUnitActiveSec=15s", "WantedBy=timers.target"} <= set(text.splitlines())


def test_deploy_writes_the_file_sd_targets_on_the_controller(tmp_path: Path) -> None:
    """deploy.yml's last play (tag monitoring) with llamafleet_prometheus_file_sd_dir: one file per job, every host
    at its cluster address (else ansible_host, an IPv6 one in brackets); a second run changes nothing."""
    out = tmp_path / "file_sd"
    args = ("--tags", "monitoring", "-e", "llamafleet_prometheus_file_sd_dir=%s" % out)
    first = ansible_playbook(tmp_path, REPO / "playbooks" / "deploy.yml", *args)
    assert re.search(r"lab1\s+: ok=\d+\s+changed=2 ", first.stdout), first.stdout[-2000:]
    llama = json.loads((out / ("%s.json" % c.PROMETHEUS_JOB_LLAMA_SERVER)).read_text())
    node = json.loads((out / ("%s.json" % c.PROMETHEUS_JOB_NODE)).read_text())
    assert llama == [{"targets": ["10.77.0.11:%d" % c.LLAMA_SERVER_PORT],
                      "labels": {"llamafleet_host": "lab1", "llamafleet_role": "orchestrator"}}]
    assert node == [
        {"targets": ["10.77.0.11:%d" % c.NODE_EXPORTER_PORT], "labels": {"llamafleet_host": "lab1", "llamafleet_role": "orchestrator"}},
        {"targets": ["10.77.0.12:%d" % c.NODE_EXPORTER_PORT], "labels": {"llamafleet_host": "lab2", "llamafleet_role": "worker"}},
        {"targets": ["[fd00::13]:%d" % c.NODE_EXPORTER_PORT], "labels": {"llamafleet_host": "lab3", "llamafleet_role": "worker"}},
    ]
    again = ansible_playbook(tmp_path, REPO / "playbooks" / "deploy.yml", *args)
    assert re.search(r"lab1\s+: ok=\d+\s+changed=0 ", again.stdout), again.stdout[-2000:]
