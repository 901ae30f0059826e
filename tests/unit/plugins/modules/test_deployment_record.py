"""The deployment record: its pure logic and the module that writes one role's section."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llamafleet.core import constants
from llamafleet.core.deployment_record import (
    SCHEMA,
    RecordError,
    parse,
    render,
    section,
    with_section,
)
from ansible_collections.llamafleet.cluster.plugins.modules import deployment_record
from tests.unit.module_runner import run_four, run_main

REPO = Path(__file__).resolve().parents[4]
RPC = {"user": "llamafleet-rpc", "units": ["llamafleet-rpc-server.service"], "ports": [50052]}


@pytest.mark.parametrize("text, message", [
    ("{", "is not JSON"),
    ("[1, 2]", "not a llamafleet deployment record"),
    ('{"sections": {}}', "no valid schema number"),
    ('{"schema": true, "sections": {}}', "no valid schema number"),
    ('{"schema": 0, "sections": {}}', "no valid schema number"),
    ('{"schema": %d, "collection_version": "7.1.0", "sections": {}}' % (SCHEMA + 1),
     "written by a newer llamafleet .*7.1.0.*upgrade"),
])
def test_bad_records_are_refused_naming_the_file(text, message):
    with pytest.raises(RecordError, match="^/etc/x.json .*" + message if "newer" not in message else message):
        parse(text, "/etc/x.json")


def test_an_absent_record_is_empty_and_sections_merge():
    record = with_section(parse(""), "rpc_server", RPC, "0.1.0")
    record = with_section(record, "llama_server", {"port": 8080}, "0.1.0")
    assert record == {"schema": SCHEMA, "collection_version": "0.1.0",
                      "sections": {"rpc_server": RPC, "llama_server": {"port": 8080}}}
    assert parse(render(record)) == record and render(record).endswith("}\n")
    assert section(with_section(record, "rpc_server", None, "0.1.0"), "rpc_server") == {}
    assert section(None, "rpc_server") == {}
    with pytest.raises(RecordError, match="section 'monitoring' is not one of"):
        with_section(record, "monitoring", {}, "0.1.0")


def test_the_module_is_idempotent_with_check_mode_and_diff(tmp_path, capsys):
    path = tmp_path / "etc" / "deployment.json"

    def after_each(extra, result):
        if extra.get("_ansible_check_mode") and not path.exists():
            assert not path.parent.exists()  # check mode creates nothing
        if extra.get("_ansible_diff"):
            assert json.loads(result["diff"]["after"])["sections"]["rpc_server"] == RPC

    run_four(deployment_record.main, {"section": "rpc_server", "data": RPC, "path": str(path),
                                      "collection_version": "0.1.0"}, capsys, after_each)
    assert json.loads(path.read_text())["sections"] == {"rpc_server": RPC}
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_sections_of_other_roles_are_kept_and_the_last_removal_removes_the_file(tmp_path, capsys):
    path = tmp_path / "deployment.json"
    for name, data in (("rpc_server", RPC), ("llama_server", {"port": 8080})):
        rc, result = run_main(deployment_record.main, {"section": name, "data": data, "path": str(path)}, capsys)
        assert rc == 0 and result["record"]["sections"][name] == data
    rc, result = run_main(deployment_record.main, {"section": "rpc_server", "state": "absent", "path": str(path)},
                          capsys)
    assert rc == 0 and result["changed"] and set(json.loads(path.read_text())["sections"]) == {"llama_server"}
    rc, result = run_main(deployment_record.main, {"section": "llama_server", "state": "absent", "path": str(path)},
                          capsys)
    assert rc == 0 and result["changed"] and not path.exists()


def test_a_newer_record_fails_and_is_left_as_it_was(tmp_path, capsys):
    path = tmp_path / "deployment.json"
    newer = json.dumps({"schema": SCHEMA + 1, "collection_version": "9.9.9", "sections": {"future": {}}})
    path.write_text(newer)
    rc, result = run_main(deployment_record.main, {"section": "rpc_server", "data": RPC, "path": str(path)}, capsys)
    assert rc == 1 and "written by a newer llamafleet" in result["msg"] and str(path) in result["msg"]
    assert path.read_text() == newer


def test_the_versions_agree():
    """constants.COLLECTION_VERSION (what records say) is galaxy.yml's, pyproject's and the library's version."""
    import llamafleet

    galaxy = re.search(r"^version:\s*(\S+)", (REPO / "galaxy.yml").read_text(), re.M).group(1)
    pyproject = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert constants.COLLECTION_VERSION == galaxy == pyproject == llamafleet.__version__
