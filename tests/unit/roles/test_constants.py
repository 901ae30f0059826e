"""The roles read llamafleet's fixed names and defaults from plugins/module_utils/constants.py.

User-facing defaults (ports, users, homes, paths, the workers group, the backends) are repeated in
defaults/main.yml and argument_specs so that ansible-doc shows them: they must equal the constants.
Everywhere else in the roles and the playbooks the values come from the lookup
llamafleet.cluster.constants, and must not be typed again.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from llamafleet.core import constants as c

REPO = Path(__file__).resolve().parents[3]
ROLES = REPO / "roles"


def _defaults(role: str) -> dict:
    with (ROLES / role / "defaults" / "main.yml").open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _spec(role: str) -> dict:
    with (ROLES / role / "meta" / "argument_specs.yml").open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)["argument_specs"]["main"]["options"]


@pytest.mark.parametrize(("role", "variable", "constant"), [
    ("rpc_server", "rpc_server_port", c.RPC_SERVER_PORT),
    ("rpc_server", "rpc_server_user", c.RPC_SERVER_USER),
    ("rpc_server", "rpc_server_home", c.RPC_SERVER_HOME),
    ("llama_server", "llama_server_port", c.LLAMA_SERVER_PORT),
    ("llama_server", "llama_server_gate_port", c.LLAMA_SERVER_GATE_PORT),
    ("llama_server", "llama_server_user", c.LLAMA_SERVER_USER),
    ("llama_server", "llama_server_home", c.LLAMA_SERVER_HOME),
    ("llama_server", "llama_server_workers_group", c.GROUP_WORKERS),
    ("llamacpp_build", "llamacpp_build_root", c.LLAMACPP_ROOT),
    ("model", "model_dir", c.MODEL_DIR),
    ("rpc_server", "rpc_server_textfile_dir", c.NODE_EXPORTER_TEXTFILE_DIR),
    ("monitoring", "monitoring_llama_server_port", c.LLAMA_SERVER_PORT),
    ("monitoring", "monitoring_prometheus_port", c.PROMETHEUS_PORT),
    ("monitoring", "monitoring_node_exporter_port", c.NODE_EXPORTER_PORT),
    ("monitoring", "monitoring_node_exporter_textfile_dir", c.NODE_EXPORTER_TEXTFILE_DIR),
])
def test_role_defaults_equal_the_constants(role: str, variable: str, constant: object) -> None:
    assert _defaults(role)[variable] == constant
    assert _spec(role)[variable]["default"] == constant


def test_backends_equal_the_constants() -> None:
    spec = _spec("llamacpp_build")["llamacpp_build_backend"]
    assert tuple(spec["choices"]) == c.LLAMACPP_BACKENDS
    assert _defaults("llamacpp_build")["llamacpp_build_backend"] in c.LLAMACPP_BACKENDS


def _documented_default(module: str, option: str) -> object:
    tree = ast.parse((REPO / "plugins" / "modules" / (module + ".py")).read_text(encoding="utf-8"))
    doc = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", "") == "DOCUMENTATION")
    return yaml.safe_load(doc)["options"][option]["default"]


@pytest.mark.parametrize(("module", "option", "constant"), [
    ("rpc_hello", "port", c.RPC_SERVER_PORT),
    ("rpc_cache_seed", "threshold", c.RPC_HASH_THRESHOLD),
])
def test_module_documentation_equals_the_constants(module: str, option: str, constant: object) -> None:
    assert _documented_default(module, option) == constant


# Values that roles and playbooks must read from the lookup rather than type.
TYPED = [
    re.escape(c.LLAMA_SERVER_UNIT), re.escape(c.RPC_SERVER_UNIT), re.escape(c.RPC_FIREWALL_UNIT),
    re.escape(c.RPC_SERVER_DEVICE_UNIT.partition("%s")[0]),
    r"\b%d\b" % c.RPC_SERVER_PORT, r"\b%d\b" % c.RPC_HASH_THRESHOLD, r"10\s*\*\s*1024\s*\*\s*1024",
    r"\b%s\b" % c.GROUP_ORCHESTRATOR, r"\b%s\b" % c.GROUP_WORKERS,
    *(re.escape('"%s"' % b) for b in c.RPC_SERVER_BINARIES), *(r"\b%s\b" % re.escape(b) for b in c.RPC_SERVER_BINARIES[::2]),
    re.escape(c.CONFIG_DIR), re.escape(c.LIBEXEC_DIR), re.escape(c.SYSTEMD_DIR), re.escape(c.LLAMACPP_ROOT),
    re.escape(c.MODEL_DIR),
]
USER_FACING = {"defaults/main.yml", "meta/argument_specs.yml"}
FILES = sorted(p for p in [*ROLES.rglob("*.yml"), *ROLES.rglob("*.j2"), *(REPO / "playbooks").rglob("*.yml")]
               if p.relative_to(p.parents[1]).as_posix() not in USER_FACING)


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines that are not comments (YAML comments and the comment lines of templates)."""
    return [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if not line.lstrip().startswith("#")]


def test_there_are_files_to_check() -> None:
    names = {p.relative_to(REPO).as_posix() for p in FILES}
    assert {"playbooks/deploy.yml", "roles/rpc_server/tasks/run.yml", "roles/llama_server/handlers/main.yml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_roles_and_playbooks_do_not_type_the_constants(path: Path) -> None:
    typed = [(n, line.strip()) for n, line in _code_lines(path) for pattern in TYPED if re.search(pattern, line)]
    assert not typed, "use lookup('llamafleet.cluster.constants', ...) instead: %s" % typed


def test_the_lookup_warms_every_filter_plugin() -> None:
    """The constants lookup imports every filter plugin of the collection, so the workers Ansible forks from the
    controller's main process inherit them compiled: its list is the filter folder's files, a new one included."""
    import sys

    from ansible_collections.llamafleet.cluster.plugins.lookup import constants as lookup

    files = {path.stem for path in (Path(__file__).resolve().parents[3] / "plugins" / "filter").glob("*.py")}
    assert set(lookup.FILTER_MODULES) == files
    for name in files:
        assert "ansible_collections.llamafleet.cluster.plugins.filter." + name in sys.modules, name
