"""Facts: one script per host whose sections go to pure parsers; the parsers on recorded output."""

from __future__ import annotations

import subprocess

import pytest

from llamafleet.errors import UserError
from llamafleet.facts import (
    Fact,
    gather,
    parse_cmdline,
    parse_counters,
    parse_du_bytes,
    parse_line_count,
    parse_output,
    parse_route_device,
    parse_word,
    script,
    split_sections,
)
from llamafleet.fleet import Fleet


def run_sh(text: str) -> str:
    return subprocess.run(["sh", "-c", text], capture_output=True, text=True, check=True).stdout


# The script and its sections, run by this machine's sh

def test_sections_keep_each_output_exactly_with_its_exit_status():
    facts = [
        Fact("no_newline", "printf 'a b'", parse_word),
        Fact("lines", "printf 'one\\ntwo\\n\\n'", parse_word),
        Fact("nul", "printf 'x\\0\\0y\\0'", parse_cmdline),
        Fact("failing", "echo partial; echo hidden >&2; exit 7", parse_word),
        Fact("empty", "true", parse_word),
    ]
    sections = split_sections(run_sh(script(facts)))
    assert sections == {
        "no_newline": ("a b", 0),
        "lines": ("one\ntwo\n\n", 0),
        "nul": ("x\0\0y\0", 0),
        "failing": ("partial\n", 7),
        "empty": ("", 0),
    }


def test_a_failing_fact_does_not_stop_the_next():
    facts = [Fact("first", "exit 1", parse_word), Fact("second", "echo still here", parse_word)]
    assert parse_output(facts, run_sh(script(facts))) == {"first": "", "second": "still here"}


def test_parse_output_names_a_missing_or_unreadable_fact():
    facts = [Fact("size", "echo not-a-number", parse_du_bytes)]
    with pytest.raises(ValueError, match="cannot read fact size"):
        parse_output(facts, run_sh(script(facts)))
    with pytest.raises(ValueError, match="no output for fact size"):
        parse_output(facts, "the connection dropped before the script ran\n")


@pytest.mark.parametrize("name", ["Units", "1st", "with-dash", "", "a b"])
def test_fact_names_are_simple_words(name):
    with pytest.raises(ValueError):
        Fact(name, "true", parse_word)


def test_gather_keeps_a_value_or_an_error_per_host(connector, local):
    def facts_of(host):
        if host.name == "misconfigured":
            raise UserError("misconfigured: rpc_server_devices must be a list")
        return [Fact("name", f"echo {host.name}", parse_word),
                Fact("size", "echo garbage" if host.name == "odd" else "echo '4096\t/x'", parse_du_bytes)]

    def answer(host, command):
        if host.name == "down":
            raise ConnectionRefusedError("connection refused")
        return local()(host, command)

    conn = connector(answer)
    data = {"g": {"hosts": ["up", "down", "odd", "misconfigured"]}, "_meta": {"hostvars": {}}}
    fleet = Fleet.from_inventory_json(data, conn)
    found = gather(fleet, fleet.group("g"), facts_of)
    assert list(found) == ["up", "down", "odd", "misconfigured"]
    assert found["up"].ok and found["up"].values == {"name": "up", "size": 4096}
    assert "connection refused" in found["down"].error
    assert "cannot read fact size" in found["odd"].error
    assert found["misconfigured"].error == "misconfigured: rpc_server_devices must be a list"
    assert sorted(h for h, _ in conn.calls) == ["down", "odd", "up"]  # one session per host, none for the bad one


# Parsers on recorded output

def test_du_and_ls_on_a_real_directory(tmp_path):
    (tmp_path / "0123456789abcdef").write_bytes(b"x" * 5000)
    (tmp_path / ".hidden").write_bytes(b"y" * 100)
    du = run_sh(f"du -sb {tmp_path}")
    assert parse_du_bytes(du) == int(du.split()[0]) >= 5100
    assert parse_line_count(run_sh(f"ls -A {tmp_path}")) == 2
    assert parse_du_bytes("") == 0  # du printed nothing: the cache directory does not exist
    assert parse_line_count("") == 0


@pytest.mark.parametrize(
    ("fixture", "device"),
    [("ip-6.1_route_get_local_real.txt", "lo"), ("ip-6.1_route_get_via_real.txt", "eth0")],
)
def test_route_device(fixture_text, fixture, device):
    assert parse_route_device(fixture_text(fixture)) == device


def test_route_device_without_a_route():
    with pytest.raises(ValueError, match="no 'dev'"):
        parse_route_device("RTNETLINK answers: Network is unreachable\n")


def test_interface_counters(fixture_text):
    counters = parse_counters(fixture_text("sysfs_rx_bytes_grep_real.txt"))
    assert set(counters) == {"eth0", "ifb0", "ifb1", "lo"}
    assert counters["ifb0"] == 0 and counters["eth0"] > 0


def test_cmdline_of_a_real_process_keeps_spaces_and_empty_arguments(running):
    proc, argv = running("two words", "", "it's")
    with open(f"/proc/{proc.pid}/cmdline", encoding="utf-8") as f:
        assert parse_cmdline(f.read()) == argv
    assert parse_cmdline("") == []
