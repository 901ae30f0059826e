"""The deploy stamp: fingerprints, the facts, the differences in words, the inputs' digest, and the module's main()
writing a stamp and checking a real folder against it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.llamafleet.cluster.plugins.module_utils import deploy_stamp as ds
from ansible_collections.llamafleet.cluster.plugins.modules import deploy_stamp as module
from tests.unit.module_runner import run_main

REPO = Path(__file__).resolve().parents[4]

IP_ADDR = json.dumps([
    {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host"}]},
    {"ifname": "host0", "addr_info": [
        {"family": "inet", "local": "10.77.0.12", "prefixlen": 24, "scope": "global"},
        {"family": "inet6", "local": "fe80::1", "prefixlen": 64, "scope": "link"}]},
])
ROUTES = json.dumps([{"dst": "default", "gateway": "10.77.0.1", "dev": "host0"}])
OS_RELEASE = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\nVERSION_CODENAME=bookworm\n'


def facts(**change: Any) -> dict[str, Any]:
    devices = change.pop("devices", [{"backend": "cpu", "name": "CPU", "total_mib": 4096, "free_mib": 3000}])
    values = dict(os_release=OS_RELEASE, machine="x86_64", cpus=2, addresses=IP_ADDR, routes=[ROUTES, "[]"],
                  devices=devices, ping_group_range="0\t2147483647\n")
    values.update(change)
    return ds.host_facts(**values)


def test_host_facts_keep_what_the_roles_plan_from() -> None:
    found = facts()
    assert found == {"ping_group_range": "0 2147483647",
                     "os": {"ID": "debian", "VERSION_ID": "12", "VERSION_CODENAME": "bookworm"}, "machine": "x86_64",
                     "cpus": 2, "addresses": [["host0", "10.77.0.12", 24]], "routes": [["host0", "10.77.0.1"]],
                     "devices": [["cpu", "CPU", 4096]]}


def test_free_memory_is_no_fact_but_total_memory_is() -> None:
    less_free = facts(devices=[{"backend": "cpu", "name": "CPU", "total_mib": 4096, "free_mib": 100}])
    assert less_free == facts()
    assert facts(devices=[{"backend": "cpu", "name": "CPU", "total_mib": 8192}]) != facts()


def test_fingerprints_follow_content_mode_links_and_big_files_by_stat(tmp_path: Path) -> None:
    (tmp_path / "a.conf").write_text("one\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big.bin").write_bytes(b"x" * 64)
    (tmp_path / "link").symlink_to("a.conf")
    roots = [(str(tmp_path), None)]
    before = ds.tree_fingerprints(roots, hash_limit=16)
    assert set(before) == {str(tmp_path), str(tmp_path / "a.conf"), str(tmp_path / "sub"),
                           str(tmp_path / "sub" / "big.bin"), str(tmp_path / "link")}
    assert before[str(tmp_path / "link")] == "link:a.conf"
    assert ds.tree_fingerprints(roots, hash_limit=16) == before

    (tmp_path / "a.conf").write_text("two\n")
    assert ds.tree_fingerprints(roots, hash_limit=16)[str(tmp_path / "a.conf")] != before[str(tmp_path / "a.conf")]
    (tmp_path / "a.conf").write_text("one\n")
    os.chmod(tmp_path / "a.conf", 0o600)
    assert ds.tree_fingerprints(roots, hash_limit=16)[str(tmp_path / "a.conf")] != before[str(tmp_path / "a.conf")]
    # above the limit: a file replaced with the same size is a new inode
    (tmp_path / "sub" / "big.bin").unlink()
    (tmp_path / "sub" / "big.bin").write_bytes(b"y" * 64)
    assert ds.tree_fingerprints(roots, hash_limit=16)[str(tmp_path / "sub" / "big.bin")] != \
        before[str(tmp_path / "sub" / "big.bin")]


def test_a_filtered_root_lists_llamafleet_names_at_any_depth_and_skip_leaves_out(tmp_path: Path) -> None:
    (tmp_path / "other.service").write_text("x")
    (tmp_path / "llamafleet-gate.service").write_text("x")
    (tmp_path / "multi-user.target.wants").mkdir()
    (tmp_path / "multi-user.target.wants" / "llamafleet-gate.service").symlink_to("../llamafleet-gate.service")
    (tmp_path / "multi-user.target.wants" / "ssh.service").symlink_to("/lib/systemd/system/ssh.service")
    (tmp_path / "haproxy.service.d").mkdir()
    (tmp_path / "haproxy.service.d" / "override.conf").write_text("x")
    found = ds.tree_fingerprints([(str(tmp_path), ("llamafleet", "haproxy"))],
                                 skip=[str(tmp_path / "llamafleet-gate.service")])
    assert sorted(os.path.relpath(path, tmp_path) for path in found) == [
        "haproxy.service.d", "haproxy.service.d/override.conf", "multi-user.target.wants/llamafleet-gate.service"]


def test_a_missing_root_is_no_entry_and_appears_as_a_difference_later(tmp_path: Path) -> None:
    roots = [(str(tmp_path / "absent"), None)]
    assert ds.tree_fingerprints(roots) == {}
    stamp = ds.build_stamp("in", facts(), {}, {}, roots, [])
    (tmp_path / "absent").mkdir()
    found = ds.differences(stamp, "in", facts(), ds.tree_fingerprints(roots), {}, {})
    assert found == ["%s appeared since the last deploy" % (tmp_path / "absent")]


def test_watched_roots_add_the_record_folders_once() -> None:
    record = {"sections": {"rpc_server": {"build_root": "/opt/llamafleet/llama.cpp", "home": "/var/lib/llamafleet-rpc",
                                          "cache_dir": "/var/lib/llamafleet-rpc/cache/rpc", "port": 50052},
                           "llama_server": {"build_root": "/opt/llamafleet/llama.cpp/", "home": "relative"}}}
    roots = ds.watched_roots(record, ["/srv/models", "", "/etc/llamafleet"])
    paths = [path for path, names in roots]
    assert paths[:len(ds.FIXED_ROOTS)] == [path for path, names in ds.FIXED_ROOTS]
    assert paths[len(ds.FIXED_ROOTS):] == [
        "/opt/llamafleet/llama.cpp", "/var/lib/llamafleet-rpc", "/var/lib/llamafleet-rpc/cache/rpc", "/srv/models"]


def test_unit_names_and_states(tmp_path: Path) -> None:
    systemd = tmp_path / "systemd"
    systemd.mkdir()
    for name in ("llamafleet-gate.service", "llamafleet-rpc-metrics.timer", "llamafleet-x.conf", "ssh.service"):
        (systemd / name).write_text("")
    edge = tmp_path / "edge"
    assert ds.unit_names(str(systemd), str(edge)) == ["llamafleet-gate.service", "llamafleet-rpc-metrics.timer"]
    edge.mkdir()
    assert ds.unit_names(str(systemd), str(edge))[-1] == "haproxy.service"
    states = ds.unit_states([
        {"Id": "llamafleet-gate.service", "ActiveState": "active", "UnitFileState": "enabled"},
        {"Id": "llamafleet-rpc-metrics.service", "ActiveState": "activating", "UnitFileState": "static"},
    ])
    # a static oneshot that a timer starts comes and goes: only its unit file state counts
    assert states == {"llamafleet-gate.service": {"UnitFileState": "enabled", "ActiveState": "active"},
                      "llamafleet-rpc-metrics.service": {"UnitFileState": "static"}}


def stamp_and_now(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    files = {str(tmp_path / "unit"): "file:644:0:0:abc"}
    units = {"llamafleet-gate.service": {"UnitFileState": "enabled", "ActiveState": "active"}}
    stamp = ds.build_stamp("inputs-1", facts(), files, units, [(str(tmp_path), None)], ["http://10.0.0.1:8080/health"])
    return stamp, dict(inputs="inputs-1", facts=facts(), files=dict(files), units=json.loads(json.dumps(units)),
                       health={})


def test_differences_none_when_everything_is_as_stamped(tmp_path: Path) -> None:
    stamp, now = stamp_and_now(tmp_path)
    assert ds.differences(json.loads(json.dumps(stamp)), **now) == []


@pytest.mark.parametrize("change, expected", [
    (dict(inputs="inputs-2"), ds.INPUTS_CHANGED),
    (dict(facts=facts(cpus=4)), "cpus changed (4, was 2)"),
    (dict(facts=facts(ping_group_range="1\t0")), 'ping_group_range changed ("1 0", was "0 2147483647")'),
    (dict(files={}), "unit is gone since the last deploy"),
    (dict(units={"llamafleet-gate.service": {"UnitFileState": "enabled", "ActiveState": "failed"}}),
     "llamafleet-gate.service: ActiveState failed, UnitFileState enabled, was ActiveState active, UnitFileState enabled"),
    (dict(units={}), "llamafleet-gate.service: not there, was ActiveState active, UnitFileState enabled"),
    (dict(health={"http://10.0.0.1:8080/health": "answered 503"}), "http://10.0.0.1:8080/health: answered 503"),
])
def test_each_difference_is_said_naming_what_changed(tmp_path: Path, change: dict[str, Any], expected: str) -> None:
    stamp, now = stamp_and_now(tmp_path)
    now.update(change)
    found = ds.differences(stamp, **now)
    assert len(found) == 1 and found[0].endswith(expected), found


def test_differences_without_a_stamp_or_with_another_schema(tmp_path: Path) -> None:
    stamp, now = stamp_and_now(tmp_path)
    assert ds.differences(None, **now) == ["no stamp of a whole deploy"]
    assert ds.differences(dict(stamp, schema=99), **now)[0].startswith("the stamp's schema is 99")


def test_many_changed_files_are_counted_after_a_few(tmp_path: Path) -> None:
    stamp, now = stamp_and_now(tmp_path)
    now["files"] = dict(now["files"], **{"/f%02d" % index: "file:x" for index in range(9)})
    found = ds.differences(stamp, **now)
    assert len(found) == ds.REPORT_LIMIT + 1 and found[-1] == "and %d more" % (9 - ds.REPORT_LIMIT)


def test_input_variables_leave_out_how_the_run_started_and_facts() -> None:
    facts_now = {"default_ipv4": {"address": "10.0.0.1"}}
    assert ds.input_variable("llama_server_ctx_size", facts_now)
    assert ds.input_variable("ansible_host", facts_now)
    for name in ("ansible_check_mode", "ansible_run_tags", "omit", "playbook_dir", "ansible_default_ipv4",
                 "_llamafleet_preflight_done", "__rpc_server_memory", "llamafleet_skip_when_in_sync"):
        assert not ds.input_variable(name, facts_now), name


def test_inputs_digest_follows_variables_files_and_collection_but_not_order(tmp_path: Path) -> None:
    cert = tmp_path / "edge.pem"
    cert.write_text("first")
    hosts = {"lab1": {"edge_tls_cert_file": str(cert), "llama_server_ctx_size": 2048, "group_names": ["a"]},
             "lab2": {"rpc_server_threads": 2}}
    base = ds.inputs_digest({"roles/x.yml": "1"}, hosts, "2.19.4")
    reordered = {"lab2": dict(hosts["lab2"]), "lab1": dict(reversed(list(hosts["lab1"].items())))}
    assert ds.inputs_digest({"roles/x.yml": "1"}, reordered, "2.19.4") == base
    assert ds.inputs_digest({"roles/x.yml": "2"}, hosts, "2.19.4") != base
    assert ds.inputs_digest({"roles/x.yml": "1"}, hosts, "2.20.0") != base
    assert ds.inputs_digest({"roles/x.yml": "1"}, dict(hosts, lab2={"rpc_server_threads": 4}), "2.19.4") != base
    # the same path, a new certificate in it
    cert.write_text("second")
    assert ds.inputs_digest({"roles/x.yml": "1"}, hosts, "2.19.4") != base


def test_collection_files_cover_roles_plugins_and_playbooks_not_bytecode() -> None:
    found = ds.collection_files(str(REPO))
    assert "playbooks/deploy.yml" in found and "galaxy.yml" in found
    assert "plugins/modules/deploy_stamp.py" in found and "roles/llama_server/tasks/main.yml" in found
    assert not any("__pycache__" in path or path.endswith(".pyc") for path in found)
    assert not any(path.startswith(("tests/", "benchmarks/", "llamafleet/")) for path in found)


def test_sync_report_says_nothing_to_do_or_why_every_host_converges() -> None:
    hosts = ["lab1", "lab2", "lab3"]
    assert ds.sync_report(hosts, [{"in_sync": True, "differences": []}] * 3).startswith("Every host is as the last")
    report = ds.sync_report(hosts, [
        {"in_sync": False, "differences": [ds.INPUTS_CHANGED]},
        {"in_sync": False, "differences": [ds.INPUTS_CHANGED, "/etc/x changed since the last deploy"]},
        {"in_sync": True, "differences": []},
    ])
    assert report == ("Converging every host. The deploy's inputs changed (inventory variables, extra vars, groups, "
                      "the collection's files, Ansible's version or a controller file they name); "
                      "lab2: /etc/x changed since the last deploy.")
    assert ds.sync_report(["lab1"], [{"skipped": True}]) == "Converging every host. lab1: not checked."
    none_yet = {"in_sync": False, "differences": ["no stamp of a whole deploy"]}
    assert ds.sync_report(hosts, [none_yet, none_yet, dict(none_yet, differences=[
        "no stamp of a whole deploy", "llamafleet-gate.service: not there, was ActiveState active"])]) == (
        "Converging every host. Every host: no stamp of a whole deploy; "
        "lab3: llamafleet-gate.service: not there, was ActiveState active.")


def run(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    rc, result = run_main(module.main, args, capsys)
    assert rc == 0, result
    return result


def test_module_stamps_then_finds_a_changed_file_and_forgets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    watched = tmp_path / "watched"
    watched.mkdir()
    (watched / "rules.conf").write_text("allow 10.0.0.1\n")
    stamp = tmp_path / "stamp.json"
    common = dict(path=str(stamp), paths=[str(watched)], inputs="digest-1")

    assert run(dict(common, state="check"), capsys)["differences"] == ["no stamp of a whole deploy"]
    written = run(dict(common, state="present"), capsys)
    assert written["changed"] is False and written["files"] >= 2
    assert stamp.stat().st_mode & 0o777 == 0o600
    assert json.loads(stamp.read_text())["files"][str(watched / "rules.conf")].startswith("file:")

    checked = run(dict(common, state="check"), capsys)
    assert checked["in_sync"] is True and checked["differences"] == []

    (watched / "rules.conf").write_text("allow 10.0.0.2\n")
    checked = run(dict(common, state="check"), capsys)
    assert checked["in_sync"] is False
    assert checked["differences"] == ["%s changed since the last deploy" % (watched / "rules.conf")]
    assert run(dict(common, state="check", inputs="digest-2"), capsys)["differences"][0] == ds.INPUTS_CHANGED

    assert run(dict(path=str(stamp), state="absent", _ansible_check_mode=True), capsys)["changed"] is False
    assert stamp.exists()
    run(dict(path=str(stamp), state="absent"), capsys)
    assert not stamp.exists()
