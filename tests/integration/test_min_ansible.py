"""meta/runtime.yml's requires_ansible, tested on the lowest ansible-core it claims.

The lowest version comes from meta/runtime.yml itself, so raising or lowering the claim changes what
is tested. That ansible-core is installed once into a virtual environment of its own under the
cache ($LLAMAFLEET_CACHE, else /var/cache/llamafleet), keyed by its version; the collection is made
visible to it through a temporary ``ansible_collections/llamafleet/cluster`` link to this checkout and
ANSIBLE_COLLECTIONS_PATH, with a minimal configuration (never the project's ansible.cfg). With it:

- every playbook in playbooks/ passes ``ansible-playbook --syntax-check``;
- every module the roles and playbooks call outside the collection exists there with every option they give
  it, and every filter, test and lookup their Jinja uses exists there (parsed with Jinja, not guessed);
- ``ansible-doc`` lists and renders every module, filter and lookup of the collection;
- a localhost play (connection local, no lab) runs role argument_specs validation (an entry point that
  passes, a missing required variable and a wrong element type that are refused) and the modules
  llamacpp_info (on stand-in binaries that print llama.cpp's real help texts), llamacpp_source_facts
  and rpc_plan (plan, argv and a unit written, then idempotent), a filter and the constants lookup;
  what it returns must equal what the same play returns under the ansible-core this test runs with.

No lab, no network once the environment exists (creating it needs PyPI).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from jinja2 import nodes

from tests.helpers import ansible_venv, lowest_ansible

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "unit" / "fixtures" / "llamacpp"
SERVER_HELP = FIXTURES / "llama-server_0c1e570_help_real.txt"
SERVER_VERSION = FIXTURES / "llama-server_0c1e570_version_real.txt"
RPC_HELP = FIXTURES / "ggml-rpc-server_0c1e570_help_real.txt"
MODEL_FACTS = FIXTURES / "gemma-3-270m-q4_k_m_model_facts.json"
CURRENT_BIN = Path(sys.executable).parent  # the ansible-core this test suite runs with
# what llamacpp_source_facts reads: ggml-rpc.cpp's threshold (a product, as llama.cpp writes it) and the header's version
SOURCE_THRESHOLD = (10, 1024, 1024)
SOURCE_PROTO_MAJOR = 3

PLAY = r"""
- name: The collection on one ansible-core version
  hosts: localhost
  connection: local
  gather_facts: true
  vars:
    ansible_python_interpreter: "{{ ansible_playbook_python }}"
    _workers:
      - {host: lab2, address: 10.77.0.12, port: 50052, devices: [{backend: cpu, index: 0, name: CPU, ggml_name: CPU,
         total_mib: 24105, free_mib: 23000, max_mib: 600}]}
      - {host: lab3, address: 10.77.0.13, port: 50052, devices: [{backend: cpu, index: 0, name: CPU, ggml_name: CPU,
         total_mib: 24105, free_mib: 23000, max_mib: 400}]}
    _plan_args:
      workers: "{{ _workers }}"
      orchestrator: {host: lab1, devices: []}
      model: ["{{ model_path }}"]
      model_facts: "{{ lookup('ansible.builtin.file', model_facts_file) | from_json }}"
      ctx_size: 4096
      n_parallel: 2
      compute_margin_mib: 64
      degrade: true
      features: "{{ __info.features }}"
      binary: "{{ __info.llama_server_path }}"
      unit_path: "{{ unit_path }}"
      unit_header: "# Ansible managed: do not edit"
      server: {host: 10.77.0.11, port: 8080, metrics: true, chat_template: gemma, api_key_file: "", log_verbosity: 4}
      unit: {user: llamafleet, home: /var/lib/llamafleet, build_id: b1-cpu, wait_helper: /usr/local/libexec/llamafleet-rpc-wait}
  tasks:
    - name: Include a task file entry point whose arguments are valid
      ansible.builtin.include_role:
        name: llamafleet.cluster._common
        tasks_from: supported_system
      vars:
        _common_system_group: all

    - name: Leave out a required argument of an entry point
      block:
        - name: Include supported_system without _common_system_group
          ansible.builtin.include_role:
            name: llamafleet.cluster._common
            tasks_from: supported_system
        - name: Record that the include was accepted
          ansible.builtin.set_fact:
            __missing_accepted: true
      rescue:
        - name: Record the refusal
          ansible.builtin.set_fact:
            __missing_refusal: "{{ ansible_failed_result }}"

    - name: Give an entry point a list element of the wrong type
      block:
        - name: Include port_check with a port that is not a number
          ansible.builtin.include_role:
            name: llamafleet.cluster._common
            tasks_from: port_check
          vars:
            _common_ports: [not-a-port]
            _common_port_programs: [nothing]
            _common_port_variable: some_port
        - name: Record that the include was accepted
          ansible.builtin.set_fact:
            __type_accepted: true
      rescue:
        - name: Record the refusal
          ansible.builtin.set_fact:
            __type_refusal: "{{ ansible_failed_result }}"

    - name: Assert argument_specs refused both, naming the variable
      ansible.builtin.assert:
        that:
          - __missing_accepted is not defined and __type_accepted is not defined
          - "'_common_system_group' in (__missing_refusal.argument_errors | join(' '))"
          - "'_common_ports' in (__type_refusal.argument_errors | join(' '))"

    - name: Read the stand-in build
      llamafleet.cluster.llamacpp_info:
        bin_dir: "{{ bin_dir }}"
        require: [llama_server, rpc_server]
      register: __info

    - name: Read the RPC constants of the source tree
      llamafleet.cluster.llamacpp_source_facts:
        src: "{{ source_dir }}"
      register: __source

    - name: Plan the cluster and write llama-server's unit
      llamafleet.cluster.rpc_plan: "{{ _plan_args }}"
      register: __plan

    - name: Plan again
      llamafleet.cluster.rpc_plan: "{{ _plan_args }}"
      register: __plan_again

    - name: Read the unit written
      ansible.builtin.slurp:
        src: "{{ unit_path }}"
      register: __unit

    - name: Assert what the modules returned
      ansible.builtin.assert:
        that:
          - __info.llama_server == 'llama-server' and __info.rpc_server == 'ggml-rpc-server'
          - __info.features.llama_server.rpc and __info.features.rpc_server.cache
          - __source.rpc_hash_threshold == expected_threshold and __source.rpc_protocol == expected_proto_major
          - __plan is changed and __plan_again is not changed
          - __plan.plan.rpc == _workers | map(attribute='address') | zip(_workers | map(attribute='port'))
                               | map('join', ':') | list
          - __plan.plan.tensor_split | sum == __plan.plan.ngl
          - (__unit.content | b64decode) == __plan.unit
          - __info.llama_server_path in __plan.unit

    - name: Write what this version returned
      ansible.builtin.copy:
        content: "{{ __results | to_nice_json }}"
        dest: "{{ result_path }}"
        mode: "0644"
      vars:
        __results:
          info: "{{ __info | dict2items | selectattr('key', 'in', ['features', 'version', 'commit']) | items2dict }}"
          source: "{{ __source | dict2items | selectattr('key', 'in', ['rpc_hash_threshold', 'rpc_protocol'])
                      | items2dict }}"
          plan: "{{ __plan | dict2items | selectattr('key', 'in', ['plan', 'argv', 'unit', 'degraded'])
                    | items2dict }}"
          elected: >-
            {{ {'a': [{'backend': 'cpu', 'total_mib': 64000}], 'b': [{'backend': 'cuda', 'total_mib': 24576}],
                'c': [{'backend': 'cuda', 'total_mib': 24576}]} | llamafleet.cluster.elect_orchestrator }}
          constants: "{{ lookup('llamafleet.cluster.constants') }}"
"""


@pytest.mark.parametrize("spec, lowest", [
    (">=2.17.0", "2.17.0"),
    (">= 2.16.3, <2.21", "2.16.3"),
    ("<2.21,>=2.18.1", "2.18.1"),
])
def test_lowest_ansible_read_from_the_spec(spec: str, lowest: str) -> None:
    assert lowest_ansible("requires_ansible: %r\n" % spec) == lowest


@pytest.mark.parametrize("spec", ["2.17.0", ">=2.17", "<2.21", ">=2.17.0,>=2.18.0"])
def test_spec_without_one_lowest_version_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="requires_ansible"):
        lowest_ansible("requires_ansible: %r\n" % spec)


@pytest.fixture(scope="module")
def lowest() -> str:
    return lowest_ansible((REPO / "meta" / "runtime.yml").read_text())


@pytest.fixture(scope="module")
def lowest_bin(lowest: str) -> Path:
    bin_dir = ansible_venv(lowest)
    out = subprocess.run([str(bin_dir / "ansible"), "--version"], capture_output=True, text=True, check=True).stdout
    assert "[core %s]" % lowest in out.splitlines()[0], out
    return bin_dir


@pytest.fixture(scope="module")
def ansible_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment that finds this checkout as llamafleet.cluster, whatever ansible.cfg or ~/.ansible hold."""
    root = tmp_path_factory.mktemp("min-ansible")
    link = root / "collections" / "ansible_collections" / "llamafleet" / "cluster"
    link.parent.mkdir(parents=True)
    link.symlink_to(REPO, target_is_directory=True)
    config = root / "ansible.cfg"
    config.write_text("[defaults]\nretry_files_enabled = False\nstdout_callback = default\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(config), ANSIBLE_COLLECTIONS_PATH=str(root / "collections"),
               ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false", ANSIBLE_HOME=str(root / "home"),
               ANSIBLE_LOCAL_TEMP=str(root / "tmp"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    return env


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run an ansible command in the folder of ``env``'s own configuration; fails on a non-zero exit."""
    done = subprocess.run(argv, env=env, cwd=Path(env["ANSIBLE_CONFIG"]).parent, capture_output=True, text=True,
                          timeout=300, check=False)
    output = done.stdout[-4000:] + "\n" + done.stderr[-4000:]
    assert done.returncode == 0, "%s exited %d\n%s" % (argv, done.returncode, output)
    return done


PLAYBOOKS = sorted(p.name for p in (REPO / "playbooks").glob("*.yml"))


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbook_syntax(playbook: str, lowest_bin: Path, ansible_env: dict[str, str]) -> None:
    done = run([str(lowest_bin / "ansible-playbook"), "-i", "localhost,", "--syntax-check",
                str(REPO / "playbooks" / playbook)], ansible_env)
    assert "ERROR" not in done.stdout + done.stderr, done.stderr
    assert "playbook: %s" % (REPO / "playbooks" / playbook) in done.stdout


@pytest.mark.parametrize("plugin_type", ["module", "filter", "lookup"])
def test_every_plugin_documented(plugin_type: str, lowest_bin: Path, ansible_env: dict[str, str]) -> None:
    def listing(bin_dir: Path) -> set[str]:
        argv = [str(bin_dir / "ansible-doc"), "-t", plugin_type, "-l", "llamafleet.cluster", "--json"]
        return set(json.loads(run(argv, ansible_env).stdout))

    doc = str(lowest_bin / "ansible-doc")
    expected = listing(CURRENT_BIN)  # what the ansible-core the project is developed on finds
    assert expected and listing(lowest_bin) == expected
    names = sorted(expected)
    docs = json.loads(run([doc, "-t", plugin_type, "--json", *names], ansible_env).stdout)
    for name in names:
        assert docs[name]["doc"]["short_description"], name
    text = run([doc, "-t", plugin_type, *names], ansible_env)
    assert "ERROR" not in text.stderr and "WARNING" not in text.stderr, text.stderr
    for name in names:  # each page's heading: "> NAME (path)" up to 2.16, "> MODULE name (path)" from 2.17
        assert re.search(r"^> (?:[a-z]+ )?%s\s" % re.escape(name), text.stdout, re.M | re.I), name


# Roles and playbooks: the task files, and everything that holds Jinja.
TASK_FILES = ("roles/*/tasks/*.yml", "roles/*/handlers/*.yml", "playbooks/*.yml")
JINJA_FILES = TASK_FILES + ("roles/*/defaults/*.yml", "roles/*/vars/*.yml", "roles/*/meta/argument_specs.yml")
TEMPLATES = "roles/*/templates/*.j2"
TASK_LISTS = ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers")
CONDITIONALS = {"when", "that", "failed_when", "changed_when", "until"}  # bare expressions, no braces
FREE_VARIABLES = {"ansible.builtin.set_fact", "ansible.builtin.add_host"}  # any key is a variable
FQCN = re.compile(r"[a-z0-9_]+\.[a-z0-9_]+\.[a-z0-9_]+")


def content_files(patterns: tuple[str, ...]) -> list[Path]:
    return sorted(p for pattern in patterns for p in REPO.glob(pattern))


def load_yaml(path: Path) -> Any:
    """A content file's YAML; a file that does not parse fails the test naming it."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        pytest.fail("%s: %s" % (path.relative_to(REPO), exc))


def module_calls(items: Any) -> Any:
    """(module FQCN, its arguments) of every task in a task file or playbook, blocks and plays included."""
    for item in items or []:
        if not isinstance(item, dict):
            continue
        for key in TASK_LISTS:
            yield from module_calls(item.get(key))
        for key, value in item.items():
            if FQCN.fullmatch(key):
                yield key, value


def modules_used() -> dict[str, set[str]]:
    """Modules from outside the collection that the content calls, each with the option names given to it."""
    used: dict[str, set[str]] = {}
    for path in content_files(TASK_FILES):
        for module, args in module_calls(load_yaml(path)):
            if not module.startswith("llamafleet.cluster."):
                used.setdefault(module, set()).update(args if isinstance(args, dict) else ())
    return used


def templates_in(data: Any, key: str | None = None) -> Any:
    """The Jinja templates in a YAML document's strings (conditionals wrapped in braces)."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from templates_in(v, k)
    elif isinstance(data, list):
        for v in data:
            yield from templates_in(v, key)
    elif isinstance(data, str) and key in CONDITIONALS:
        yield "{{ (%s) }}" % data
    elif isinstance(data, str) and ("{{" in data or "{%" in data):
        yield data


def jinja_plugins_used() -> dict[str, set[str]]:
    """{"filter": names, "test": names, "lookup": names} the content's Jinja uses, from Jinja's own parser
    (map/select/reject and the *attr forms name a filter or test by a string argument)."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
    used: dict[str, set[str]] = {"filter": set(), "test": set(), "lookup": set()}
    texts = [t for p in content_files(JINJA_FILES) for t in templates_in(load_yaml(p))]
    texts += [p.read_text() for p in content_files((TEMPLATES,))]
    by_argument = {"map": ("filter", 0), "select": ("test", 0), "reject": ("test", 0),
                   "selectattr": ("test", 1), "rejectattr": ("test", 1)}
    for text in texts:
        with warnings.catch_warnings():  # Jinja's lexer warns about regex escapes in string literals ("\\.")
            warnings.simplefilter("ignore", DeprecationWarning)
            tree = env.parse(text)
        for node in tree.find_all(nodes.Filter):
            used["filter"].add(node.name)
            kind, index = by_argument.get(node.name, (None, 0))
            if kind and len(node.args) > index and isinstance(node.args[index], nodes.Const):
                used[kind].add(node.args[index].value)
        used["test"].update(node.name for node in tree.find_all(nodes.Test))
        for call in tree.find_all(nodes.Call):
            if (isinstance(call.node, nodes.Name) and call.node.name in ("lookup", "query", "q") and call.args
                    and isinstance(call.args[0], nodes.Const)):
                used["lookup"].add(call.args[0].value)
    return used


def test_content_scans_find_what_the_roles_use() -> None:
    """The scans see real content: a module with its options, filters, tests and lookups the roles are known to use."""
    modules = modules_used()
    assert {"argv", "stdin"} <= modules["ansible.builtin.command"]
    used = jinja_plugins_used()
    assert {"default", "llamafleet.cluster.rpc_server_argv", "extract"} <= used["filter"]  # extract: as map('extract')
    assert {"defined", "match", "equalto"} <= used["test"]  # equalto: as selectattr(key, 'equalto', ...)
    assert "llamafleet.cluster.constants" in used["lookup"]


def test_modules_and_options_exist(lowest_bin: Path, ansible_env: dict[str, str]) -> None:
    used = modules_used()
    docs = json.loads(run([str(lowest_bin / "ansible-doc"), "-t", "module", "--json", *sorted(used)],
                          ansible_env).stdout)
    missing = sorted(set(used) - set(docs))
    assert not missing, "modules unknown to this ansible-core: %s" % missing
    unknown = {}
    for module, given in used.items():
        options = docs[module]["doc"].get("options") or {}
        known = set(options) | {alias for o in options.values() for alias in o.get("aliases") or []}
        if module not in FREE_VARIABLES and given - known:
            unknown[module] = sorted(given - known)
    assert not unknown, "options unknown to this ansible-core: %s" % unknown


def test_filters_tests_lookups_exist(lowest_bin: Path, ansible_env: dict[str, str]) -> None:
    jinja_builtins = json.loads(run([str(lowest_bin / "python"), "-c",
                                     "import json, jinja2.defaults as d; "
                                     "print(json.dumps({'filter': sorted(d.DEFAULT_FILTERS), "
                                     "'test': sorted(d.DEFAULT_TESTS), 'lookup': []}))"], ansible_env).stdout)
    missing = {}
    for kind, names in jinja_plugins_used().items():
        listed = set(json.loads(run([str(lowest_bin / "ansible-doc"), "-t", kind, "-l", "--json"],
                                    ansible_env).stdout))
        known = listed | set(jinja_builtins[kind]) | {n.split(".", 2)[2] for n in listed
                                                      if n.startswith("ansible.builtin.")}
        if names - known:
            missing[kind] = sorted(names - known)
    assert not missing, "unknown to this ansible-core: %s" % missing


def stand_ins(root: Path) -> dict[str, Any]:
    """A build folder whose llama-server and ggml-rpc-server print llama.cpp's real help and version texts, a
    source tree with the two RPC constants, and the play's other inputs (paths under ``root``)."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, texts in (("llama-server", {"--help": SERVER_HELP, "--version": SERVER_VERSION}),
                        ("ggml-rpc-server", {"--help": RPC_HELP})):
        cases = "".join('  %s) cat "%s" ;;\n' % (flag, path) for flag, path in texts.items())
        script = bin_dir / name
        script.write_text('#!/bin/sh\ncase "$1" in\n%s  *) exit 2 ;;\nesac\n' % cases)
        script.chmod(0o755)
    src = root / "llama.cpp"
    (src / "ggml" / "src" / "ggml-rpc").mkdir(parents=True)
    (src / "ggml" / "include").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    (src / "ggml" / "src" / "ggml-rpc" / "ggml-rpc.cpp").write_text(
        "static const size_t HASH_THRESHOLD = %s;\n" % " * ".join(map(str, SOURCE_THRESHOLD)))
    (src / "ggml" / "include" / "ggml-rpc.h").write_text("#define RPC_PROTO_MAJOR_VERSION    %d\n" % SOURCE_PROTO_MAJOR)
    model = root / "gemma-3-270m-q4_k_m.gguf"  # named only: model_facts stands for its contents
    return {"bin_dir": str(bin_dir), "source_dir": str(src), "model_path": str(model),
            "model_facts_file": str(MODEL_FACTS), "expected_threshold": math.prod(SOURCE_THRESHOLD),
            "expected_proto_major": SOURCE_PROTO_MAJOR}


def run_play(bin_dir: Path, root: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run PLAY with ``bin_dir``'s ansible-playbook; what it wrote of the modules' results."""
    root.mkdir()
    play = root / "play.yml"
    play.write_text(PLAY)
    extra = dict(stand_ins(root), unit_path=str(root / "llamafleet-llama-server.service"),
                 result_path=str(root / "results.json"))
    (root / "vars.json").write_text(json.dumps(extra))
    done = run([str(bin_dir / "ansible-playbook"), "-i", "localhost,", "-e", "@%s" % (root / "vars.json"), str(play)],
               env)
    assert re.search(r"localhost\s+:\s+ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0", done.stdout), done.stdout
    return json.loads((root / "results.json").read_text())


def constants_table() -> dict[str, Any]:
    """plugins/module_utils/constants.py's ``as_dict()``, under the library's one name for it."""
    from llamafleet.core import constants  # noqa: PLC0415

    return json.loads(json.dumps(constants.as_dict()))


def test_localhost_play_same_results(lowest_bin: Path, ansible_env: dict[str, str],
                                     tmp_path: Path) -> None:
    old = run_play(lowest_bin, tmp_path / "lowest", ansible_env)
    if not (CURRENT_BIN / "ansible-playbook").exists():
        pytest.fail("no ansible-playbook beside %s to compare with" % sys.executable)
    new = run_play(CURRENT_BIN, tmp_path / "current", ansible_env)
    assert old["plan"]["unit"] and old["plan"]["argv"] and old["plan"]["degraded"]
    # the same but for the folder each run wrote in (it shows in the plan's paths and the unit)
    assert json.loads(json.dumps(old).replace(str(tmp_path / "lowest"), str(tmp_path / "current"))) == new
    assert old["constants"] == constants_table()
