"""The llamacpp_build role on a host that already runs its build, through a real ansible-playbook run on this
machine (connection local, a build root under a temporary directory, stand-in binaries that print llama.cpp's
recorded help texts, a loopback HTTP server as the source archive): one module run reads the host
(llamacpp_build_facts), the archive is asked once, nothing changes, and llamacpp_build_info is what the build has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "unit" / "fixtures" / "llamacpp"
BIN = Path(sys.executable).parent
# Tasks that run on the controller alone (no module run on the host).
CONTROLLER = {"set_fact", "assert", "debug", "fail", "include_tasks", "include_role", "include_vars", "meta",
              "validate_argument_spec"}

# llama-server and the rpc-server as stand-ins that print llama.cpp's recorded texts (to stderr where it does).
STUBS = {
    "llama-server": '#!/bin/sh\ncase "$1" in\n  --help) cat {fixtures}/llama-server_0c1e570_help_real.txt ;;\n'
                    '  --version) cat {fixtures}/llama-server_0c1e570_version_real.txt >&2 ;;\nesac\n',
    "ggml-rpc-server": "#!/bin/sh\ncat {fixtures}/ggml-rpc-server_0c1e570_help_real.txt >&2\n",
}

COUNTER = '''
import json, os
from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_runs"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.runs, self.play = [], ""

    def v2_playbook_on_play_start(self, play):
        self.play = play.get_name()

    def _add(self, result, status):
        self.runs.append({"play": self.play, "task": result._task.name, "status": status,
                          "action": result._task.action.rsplit(".", 1)[-1]})

    def v2_runner_on_ok(self, result):
        self._add(result, "changed" if result._result.get("changed") else "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._add(result, "failed")

    def v2_runner_on_skipped(self, result):
        self._add(result, "skipped")

    def v2_playbook_on_stats(self, stats):
        with open(os.environ["TASK_RUNS"], "w") as out:
            json.dump(self.runs, out)
'''

PLAYBOOK = """\
- name: Install a build as the role would have
  hosts: box
  gather_facts: true
  gather_subset: [min]
  vars: &settings
    llamacpp_build_root: {tmp}/root
    llamacpp_build_artifact_cache: {tmp}/cache
    llamacpp_build_source_type: archive
    llamacpp_build_archive_url: http://127.0.0.1:{port}/src.tar.gz
    llamacpp_build_archive_sha256: "{sha}"
    llamacpp_build_native: false
    llamacpp_build_install_packages: false
    llamacpp_build_keep_versions: 3
  tasks:
    - name: Work out the build id
      ansible.builtin.include_role:
        name: llamafleet.cluster.llamacpp_build
        tasks_from: identity

    - name: Write the build, the current link and two older versions
      ansible.builtin.shell: |
        set -e
        b={tmp}/root/{{{{ _llamacpp_build_id }}}}
        mkdir -p $b/bin {tmp}/root/old-a {tmp}/root/old-b
        touch -d '2026-01-01' {tmp}/root/old-a
        touch -d '2026-02-01' {tmp}/root/old-b
        cp -a {tmp}/stubs/. $b/bin/
        echo '{{"version": "b-test", "rpc_server": "ggml-rpc-server", "rpc_hash_threshold": 10485760, "rpc_protocol": 3}}' > $b/BUILDINFO.json
        ln -sfn {{{{ _llamacpp_build_id }}}} {tmp}/root/current
      changed_when: true

- name: Deploy again
  hosts: box
  gather_facts: false
  vars: *settings
  roles:
    - role: llamafleet.cluster.llamacpp_build
  post_tasks:
    - name: Save what the role published
      ansible.builtin.copy:
        content: "{{{{ {{'info': llamacpp_build_info, 'switch': _llamacpp_build_switch,
                      'running': _llamacpp_build_running, 'id': _llamacpp_build_id}} | to_json }}}}"
        dest: {tmp}/results.json
        mode: "0644"

- name: Deploy with a wrong archive URL
  hosts: box
  gather_facts: false
  vars:
    <<: *settings
    llamacpp_build_archive_url: http://127.0.0.1:{port}/missing.tar.gz
  tasks:
    - name: Run the role's preflight
      block:
        - name: Check the host
          ansible.builtin.include_role:
            name: llamafleet.cluster.llamacpp_build
            tasks_from: preflight
      rescue:
        - name: Save the refusal
          ansible.builtin.copy:
            content: "{{{{ ansible_failed_result.msg }}}}"
            dest: {tmp}/refused.txt
            mode: "0644"
"""


class _Archive(BaseHTTPRequestHandler):
    heads: list[str] = []

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        self.heads.append(self.path)
        self.send_response(200 if self.path == "/src.tar.gz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        del args


@pytest.fixture(scope="module")
def converged(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("build")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Archive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp / "stubs").mkdir()
    for name, body in STUBS.items():
        (tmp / "stubs" / name).write_text(body.format(fixtures=FIXTURES))
        (tmp / "stubs" / name).chmod(0o755)
    (tmp / "callbacks").mkdir()
    (tmp / "callbacks" / "task_runs.py").write_text(COUNTER)
    (tmp / "hosts.ini").write_text("[llamafleet]\nbox ansible_connection=local ansible_python_interpreter=%s\n"
                                   % sys.executable)
    (tmp / "play.yml").write_text(PLAYBOOK.format(tmp=tmp, port=server.server_address[1], sha="ab" * 32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1", TASK_RUNS=str(tmp / "runs.json"),
               ANSIBLE_CALLBACK_PLUGINS=str(tmp / "callbacks"), ANSIBLE_CALLBACKS_ENABLED="task_runs",
               PATH="%s:%s" % (BIN, env.get("PATH", "")))
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp / "hosts.ini"), str(tmp / "play.yml")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    runs = [r for r in json.loads((tmp / "runs.json").read_text()) if r["play"] == "Deploy again"]
    yield {"tmp": tmp, "runs": runs, "res": json.loads((tmp / "results.json").read_text()), "heads": _Archive.heads}
    server.shutdown()
    server.server_close()


def test_one_read_and_one_archive_question(converged) -> None:
    runs, heads = converged["runs"], converged["heads"]
    remote = [(r["task"], r["action"]) for r in runs
              if r["status"] != "skipped" and r["action"] not in CONTROLLER and r["task"] != "Save what the role published"]
    assert remote == [("Read this host's llama.cpp builds, backend and packages", "llamacpp_build_facts"),
                      ("Check the source archive is reachable", "uri")], remote
    assert heads == ["/src.tar.gz", "/missing.tar.gz"]
    assert not [r for r in runs if r["status"] in ("changed", "failed") and r["task"] != "Save what the role published"]


def test_the_link_and_the_versions_stay(converged) -> None:
    tmp, runs, res = converged["tmp"], converged["runs"], converged["res"]
    skipped = {r["task"] for r in runs if r["status"] == "skipped"}
    assert {"Point current at the new build", "Compile llama.cpp", "Remove versions beyond llamacpp_build_keep_versions",
            "Read the host again after the install"} <= skipped, skipped
    assert os.readlink(tmp / "root" / "current") == res["id"]
    assert sorted(p.name for p in (tmp / "root").iterdir()) == sorted(["current", "old-a", "old-b", res["id"]])
    assert res["switch"] is False and res["running"] == res["id"]


def test_the_published_build(converged) -> None:
    tmp, res = converged["tmp"], converged["res"]
    info = res["info"]
    assert info["build_id"] == res["id"] and info["prefix"] == "%s/root/%s" % (tmp, res["id"])
    assert info["version"] == "b-test" and info["rpc_server"] == "ggml-rpc-server"
    assert info["rpc_hash_threshold"] == 10485760 and info["rpc_protocol"] == 3 and info["pending"] is False
    assert info["features"]["llama_server"]["rpc"] is True and info["features"]["rpc_server"]["cache"] is True
    assert info["features"]["version"]["version"], info["features"]["version"]
    assert info["backend"] == "cpu" and info["bin_dir"].endswith("/bin")


def test_a_wrong_archive_url_is_refused_where_the_build_is_installed(converged) -> None:
    tmp, res = converged["tmp"], converged["res"]
    refused = (tmp / "refused.txt").read_text()
    assert refused.startswith("box: llamacpp_build_archive_url=http://127.0.0.1:"), refused
    assert "/missing.tar.gz is unreachable (" in refused and "status 404" in refused, refused
    assert os.readlink(tmp / "root" / "current") == res["id"]
