"""host_firewall: the tools' output parsed, rules rendered, the plan, and converge on pretend hosts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.unit.firewall_sim import FirewallHost

from llamafleet.core import host_firewall as hf
from llamafleet.core.constants import HOST_FIREWALL_COMMENT

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "host_firewall"
ROLE = Path(__file__).resolve().parents[4] / "roles" / "rpc_server"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def fw(zone: str, client: str, port: int = 50052, address: str = "10.77.0.13") -> hf.Rule:
    return hf.Rule("firewalld", zone, client, address, port)


def ufw(client: str, port: int = 50052, address: str = "10.77.0.13") -> hf.Rule:
    return hf.Rule("ufw", "", client, address, port)


@pytest.mark.parametrize(("text", "expected"), [
    ("10.77.0.11", "10.77.0.11"),
    ("10.77.0.11/32", "10.77.0.11"),
    (" 10.77.0.0/24 ", "10.77.0.0/24"),
    ("10.77.0.5/24", "10.77.0.0/24"),
    ("fd00::11/128", "fd00::11"),
    ("FD00::0011", "fd00::11"),
])
def test_normalize_address(text: str, expected: str) -> None:
    assert hf.normalize_address(text) == expected


@pytest.mark.parametrize("text", ["lab1", "", "10.77.0.300", "any"])
def test_normalize_address_refuses_names(text: str) -> None:
    with pytest.raises(ValueError):
        hf.normalize_address(text)


# --- firewalld ---

@pytest.mark.parametrize(("rule", "text"), [
    (fw("public", "10.77.0.11"),
     'rule family="ipv4" source address="10.77.0.11" destination address="10.77.0.13" port port="50052" '
     'protocol="tcp" accept'),
    (fw("public", "10.77.0.0/24", 50053, ""),
     'rule family="ipv4" source address="10.77.0.0/24" port port="50053" protocol="tcp" accept'),
    (fw("internal", "fd00::11", 50052, "fd00::13"),
     'rule family="ipv6" source address="fd00::11" destination address="fd00::13" port port="50052" '
     'protocol="tcp" accept'),
])
def test_rich_rule_renders_and_parses_back(rule: hf.Rule, text: str) -> None:
    assert hf.render_rich_rule(rule) == text
    assert hf.parse_rich_rule(text, rule.zone) == rule


def test_rich_rules_listing_keeps_our_shape_only() -> None:
    found = hf.parse_rich_rules(fixture("firewall-cmd_list-rich-rules_public_reconstructed.txt"), "public")
    assert sorted(found) == sorted([
        fw("public", "10.77.0.11"),
        fw("public", "10.77.0.99"),
        fw("public", "192.168.7.0/24", 50052, ""),
        fw("public", "10.77.0.11", 50053, ""),          # written 10.77.0.11/32: the same rule
        fw("public", "fd00::11", 50052, "fd00::13"),
    ])
    # removal uses the line as firewalld listed it
    listed = found[fw("public", "10.77.0.11", 50053, "")]
    assert listed.endswith('address="10.77.0.11/32" port port="50053" protocol="tcp" accept')


@pytest.mark.parametrize("line", [
    'rule family="ipv4" source NOT address="10.77.0.11" port port="50052" protocol="tcp" accept',
    'rule family="ipv6" source address="10.77.0.11" port port="50052" protocol="tcp" accept',   # wrong family
    'rule family="ipv4" source address="10.77.0.11" port port="50052" protocol="tcp" reject',
    'rule family="ipv4" source address="10.77.0.11" port port="50052-50060" protocol="tcp" accept',
    'rule family="ipv4" source ipset="clients" port port="50052" protocol="tcp" accept',
    "",
])
def test_rich_rules_of_other_shapes_are_not_ours(line: str) -> None:
    assert hf.parse_rich_rule(line, "public") is None


@pytest.mark.parametrize(("name", "expected"), [
    ("firewall-cmd_get-active-zones_1.3_reconstructed.txt",
     {"public": {"interfaces": ["host0"], "sources": []},
      "trusted": {"interfaces": [], "sources": ["10.77.0.0/24", "10.77.0.11"]}}),
    ("firewall-cmd_get-active-zones_2.1_reconstructed.txt",
     {"internal": {"interfaces": ["eth1"], "sources": []}, "public": {"interfaces": ["eth0"], "sources": []},
      "work": {"interfaces": [], "sources": ["192.168.7.0/24"]}}),
])
def test_parse_active_zones(name: str, expected: dict) -> None:
    assert hf.parse_active_zones(fixture(name)) == expected


ZONES_2 = hf.parse_active_zones(fixture("firewall-cmd_get-active-zones_2.1_reconstructed.txt"))
ZONES_1 = hf.parse_active_zones(fixture("firewall-cmd_get-active-zones_1.3_reconstructed.txt"))


@pytest.mark.parametrize(("client", "interface", "zones", "expected"), [
    ("10.77.0.11", "eth0", ZONES_2, ["public"]),               # the interface's zone
    ("10.77.0.11", "eth1", ZONES_2, ["internal"]),
    ("10.77.0.11", "eth9", ZONES_2, ["block"]),                # interface in no zone: the default zone
    ("192.168.7.20", "eth0", ZONES_2, ["work"]),               # a source binding wins over the interface
    ("10.77.0.11", "host0", ZONES_1, ["trusted"]),             # the most specific source: /32 over /24 (same zone)
    ("10.77.0.12", "host0", ZONES_1, ["trusted"]),
    ("fd00::11", "host0", ZONES_1, ["public"]),                # an IPv4 source never holds an IPv6 client
    ("10.77.0.11", None, ZONES_2, ["block", "internal", "public"]),   # wildcard bind: every interface zone
])
def test_client_zones(client: str, interface: str | None, zones: dict, expected: list[str]) -> None:
    assert hf.client_zones(client, interface, zones, "block") == expected


def test_client_zones_prefers_the_longest_source_prefix() -> None:
    zones = {"wide": {"interfaces": [], "sources": ["10.0.0.0/8"]},
             "narrow": {"interfaces": [], "sources": ["10.77.0.0/24"]}}
    assert hf.client_zones("10.77.0.11", "eth0", zones, "public") == ["narrow"]
    assert hf.client_zones("10.1.0.1", "eth0", zones, "public") == ["wide"]


# --- ufw ---

def test_ufw_status_keeps_our_shape_only() -> None:
    for name in ("ufw_status_0.36.2_reconstructed.txt", "ufw_status_numbered_0.36.2_reconstructed.txt"):
        status = hf.parse_ufw_status(fixture(name))
        assert status["active"] is True, name
        assert status["rules"] == {
            ufw("10.77.0.11"): HOST_FIREWALL_COMMENT,
            ufw("10.77.0.99"): HOST_FIREWALL_COMMENT,
            ufw("10.77.0.11", 50053): "",
            ufw("192.168.7.0/24", 50052, ""): "admin: lab subnet",
            ufw("fd00::11", 50052, "fd00::13"): HOST_FIREWALL_COMMENT,
        }, name


@pytest.mark.parametrize("line", [
    "10.77.0.13 50052/tcp       DENY        10.77.0.50                ",
    "10.77.0.13 50052/tcp       ALLOW       10.77.0.12                 (log) # llamafleet-rpc",
    "10.77.0.13 50052/udp       ALLOW       10.77.0.11                ",
    "10.77.0.13 50052/tcp on eth1 ALLOW       10.77.0.11                ",
    "Anywhere                   ALLOW OUT   10.77.0.11                 # llamafleet-rpc",
    "22/tcp                     ALLOW       Anywhere                  ",
    "10.77.0.13 50052/tcp       ALLOW       10.77.0.11 8080/tcp       ",
])
def test_ufw_lines_of_other_shapes_are_not_ours(line: str) -> None:
    assert hf.parse_ufw_line(line) is None


def test_ufw_inactive() -> None:
    assert hf.parse_ufw_status(fixture("ufw_status_inactive_reconstructed.txt")) == {"active": False, "rules": {}}


def test_ufw_rule_args_add_what_the_status_shows() -> None:
    assert hf.ufw_rule_args(ufw("10.77.0.11")) == [
        "allow", "proto", "tcp", "from", "10.77.0.11", "to", "10.77.0.13", "port", "50052",
        "comment", HOST_FIREWALL_COMMENT]
    assert hf.ufw_rule_args(ufw("10.77.0.11", 50052, ""), "x")[5:7] == ["to", "any"]


# --- the host ---

def test_parse_ip_addresses_real() -> None:
    found = hf.parse_ip_addresses(fixture("ip_o_addr_show_iproute2-6.1.0_real.txt"))
    assert found["10.77.0.1"] == "lfbr0" and found["192.0.2.2"] == "eth0" and found["fd00::2"] == "eth0"
    assert found["127.0.0.1"] == "lo"


@pytest.mark.parametrize(("name", "expected"), [
    ("nft_list_tables_firewalld_reconstructed.txt", ["inet llamafleet_rpc", "inet firewalld"]),
    ("nft_list_tables_ufw_reconstructed.txt", ["inet llamafleet_rpc", "ip filter", "ip6 filter"]),
])
def test_parse_nft_tables(name: str, expected: list[str]) -> None:
    assert hf.parse_nft_tables(fixture(name)) == expected


def facts(firewalld: bool | None, ufw_on: bool | None) -> dict:
    """None: not installed."""
    return {"firewalld": {"installed": firewalld is not None, "active": bool(firewalld), "status": "not running"},
            "ufw": {"installed": ufw_on is not None, "active": bool(ufw_on), "status": "Status: inactive"}}


@pytest.mark.parametrize(("requested", "host", "manager", "problem"), [
    ("auto", facts(None, None), "none", None),
    ("auto", facts(True, None), "firewalld", None),
    ("auto", facts(False, True), "ufw", None),
    ("auto", facts(True, True), "none", "firewalld and ufw are both active on this host: name the one in charge"),
    ("firewalld", facts(True, True), "firewalld", None),
    ("ufw", facts(True, True), "ufw", None),
    ("firewalld", facts(None, True), "none", "firewalld is not installed on this host"),
    ("firewalld", facts(False, None), "none", "firewalld is not active (not running) on this host"),
    ("ufw", facts(True, False), "none", "ufw is not active (Status: inactive) on this host"),
    ("none", facts(True, True), "none", None),
])
def test_resolve_manager(requested: str, host: dict, manager: str, problem: str | None) -> None:
    assert hf.resolve_manager(requested, host) == (manager, problem)
    expected = None if problem is None else "rpc_server_host_firewall=%s: %s" % (requested, problem)
    assert hf.host_firewall_problem(requested, host) == expected


# --- the plan ---

A, B, C = ufw("10.77.0.11"), ufw("10.77.0.12"), ufw("10.77.0.99")


@pytest.mark.parametrize(("wanted", "present", "tracked", "add", "remove", "after"), [
    # first run: add, track
    ({A}, {"ufw": set()}, set(), {"ufw": [A]}, {"ufw": []}, [A]),
    # converged: nothing
    ({A}, {"ufw": {A}}, {A}, {"ufw": []}, {"ufw": []}, [A]),
    # the admin's identical rule: kept, never tracked (so never removed)
    ({A}, {"ufw": {A}}, set(), {"ufw": []}, {"ufw": []}, []),
    # a client left: its rule goes
    ({A}, {"ufw": {A, C}}, {A, C}, {"ufw": []}, {"ufw": [C]}, [A]),
    # a client left and someone removed its rule already: forgotten
    ({A}, {"ufw": {A}}, {A, C}, {"ufw": []}, {"ufw": []}, [A]),
    # an untracked rule that is not wanted: left alone
    ({A}, {"ufw": {A, B}}, {A}, {"ufw": []}, {"ufw": []}, [A]),
    # manager no longer chosen: everything tracked goes
    (set(), {"ufw": {A, B}}, {A, B}, {"ufw": []}, {"ufw": [A, B]}, []),
    # firewalld's two layers: missing from permanent only (a --reload would lose it)
    ({A}, {"runtime": {A}, "permanent": set()}, set(), {"runtime": [], "permanent": [A]},
     {"runtime": [], "permanent": []}, [A]),
    # after a --reload dropped a runtime-only rule of ours
    ({A, B}, {"runtime": {A}, "permanent": {A, C}}, {A, C}, {"runtime": [B], "permanent": [B]},
     {"runtime": [], "permanent": [C]}, [A, B]),
])
def test_plan_changes(wanted, present, tracked, add, remove, after) -> None:
    plan = hf.plan_changes(wanted, present, tracked)
    assert (plan.add, plan.remove, plan.tracked) == (add, remove, after)
    assert plan.empty == (not any(add.values()) and not any(remove.values()))


def test_state_round_trip_and_bad_files() -> None:
    rules = [fw("public", "10.77.0.11"), ufw("10.77.0.12")]
    text = hf.dump_state(rules + rules[:1])
    assert json.loads(text)["version"] == hf.STATE_VERSION
    assert hf.load_state(text) == sorted(rules)
    for bad in (None, "", "not json", "[]", '{"rules": [{"manager": "ufw"}]}'):
        assert hf.load_state(bad) == []
    assert hf.load_state('{"rules": [{"manager": "iptables", "zone": "", "client": "x", "address": "", "port": 1}]}') == []


# --- converge on pretend hosts ---

def converge(host: FirewallHost, state: str | None, clients=("10.77.0.11",), requested: str = "auto",
             check_mode: bool = False, address: str = "10.77.0.13") -> hf.Outcome:
    return hf.converge(host.run, host.which, requested, list(clients), [50052], address, state,
                       check_mode=check_mode)


def test_firewalld_check_apply_again_remove_and_reload() -> None:
    host = FirewallHost(firewalld="running")
    first = converge(host, None, check_mode=True)
    assert first.manager == "firewalld" and host.changes() == []
    assert len(first.added) == 2 and first.added[0].startswith("runtime firewalld zone public: rule")
    applied = converge(host, None)
    assert sorted(applied.added) == sorted(first.added)
    rule = hf.render_rich_rule(fw("public", "10.77.0.11"))
    assert host.runtime["public"] == [rule] and host.permanent["public"] == [rule]
    assert applied.tracked == [fw("public", "10.77.0.11")]
    assert applied.zones == {"interface": "host0", "default_zone": "public", "zones": ["public"]}
    state = hf.dump_state(applied.tracked)
    calls = len(host.changes())
    again = converge(host, state)
    assert (again.added, again.removed, len(host.changes())) == ([], [], calls)
    assert again.before == again.after and len(again.after) == 2
    # a second orchestrator, then it leaves again
    both = converge(host, state, clients=("10.77.0.11", "10.77.0.99"))
    assert len(both.added) == 2 and len(host.permanent["public"]) == 2
    left = converge(host, hf.dump_state(both.tracked))
    assert len(left.removed) == 2 and host.runtime["public"] == [rule] and host.permanent["public"] == [rule]
    assert left.tracked == [fw("public", "10.77.0.11")]
    # --reload keeps the permanent rule: nothing to do afterwards
    host.run(["/usr/sbin/firewall-cmd", "--reload"])
    assert converge(host, hf.dump_state(left.tracked)).added == []


def test_firewalld_leaves_the_admins_rules_alone() -> None:
    host = FirewallHost(firewalld="running")
    mine = hf.render_rich_rule(fw("public", "10.77.0.11"))
    admins = 'rule family="ipv4" source address="10.77.0.99/32" destination address="10.77.0.13" port port="50052" ' \
             'protocol="tcp" accept'
    host.runtime["public"] = [mine, admins]
    host.permanent["public"] = [mine, admins]
    outcome = converge(host, None)
    # both there already and not ours: nothing added, nothing tracked, nothing removed
    assert (outcome.added, outcome.removed, outcome.tracked) == ([], [], [])
    assert host.permanent["public"] == [mine, admins]


def test_firewalld_zone_of_a_source_binding() -> None:
    bindings = {"public": {"interfaces": ["host0"], "sources": []},
                "trusted": {"interfaces": [], "sources": ["10.77.0.11"]}}
    host = FirewallHost(firewalld="running", bindings=bindings)
    outcome = converge(host, None, clients=("10.77.0.11", "10.77.0.12"))
    assert sorted((r.zone, r.client) for r in outcome.tracked) == [("public", "10.77.0.12"), ("trusted", "10.77.0.11")]
    assert len(host.permanent["trusted"]) == 1 and len(host.permanent["public"]) == 1


def test_firewalld_without_bound_zones_uses_the_default_zone() -> None:
    # no NetworkManager (the lab's containers): no interface is bound, firewalld applies the default zone
    host = FirewallHost(firewalld="running", default_zone="work", bindings={})
    outcome = converge(host, None)
    assert outcome.tracked == [fw("work", "10.77.0.11")] and len(host.permanent["work"]) == 1
    assert outcome.zones == {"interface": "host0", "default_zone": "work", "zones": []}


def test_firewalld_removal_uses_the_listed_spelling() -> None:
    host = FirewallHost(firewalld="running")
    listed = 'rule family="ipv4" source address="10.77.0.99/32" destination address="10.77.0.13" port port="50052" ' \
             'protocol="tcp" accept'
    host.runtime["public"] = [listed]
    host.permanent["public"] = [listed]
    outcome = converge(host, hf.dump_state([fw("public", "10.77.0.99")]))
    assert len(outcome.removed) == 2 and host.runtime["public"] == host.permanent["public"] == [
        hf.render_rich_rule(fw("public", "10.77.0.11"))]
    assert ["--remove-rich-rule=" + listed] == [c[-1] for c in host.changes() if "--remove" in c[-1]][:1]


def test_ufw_check_apply_again_and_remove() -> None:
    host = FirewallHost(ufw="active")
    check = converge(host, None, check_mode=True)
    assert check.manager == "ufw" and check.added == ["ufw " + " ".join(hf.ufw_rule_args(ufw("10.77.0.11")))]
    assert host.ufw_rules == []
    applied = converge(host, None, clients=("10.77.0.11", "10.77.0.99"))
    assert len(applied.added) == 2 and len(host.ufw_rules) == 2
    assert all(r[4] == HOST_FIREWALL_COMMENT for r in host.ufw_rules)
    # the state file lost: our comment still tells our rules apart
    left = converge(host, None)
    assert left.removed == ["ufw " + " ".join(hf.ufw_rule_args(ufw("10.77.0.99")))]
    assert host.ufw_rules == [("10.77.0.11", "10.77.0.13", "50052", "tcp", HOST_FIREWALL_COMMENT)]
    calls = len(host.changes())
    assert converge(host, hf.dump_state(left.tracked)).added == [] and len(host.changes()) == calls


def test_ufw_wildcard_bind_opens_to_any_address() -> None:
    host = FirewallHost(ufw="active")
    converge(host, None, address="0.0.0.0")
    assert host.ufw_rules == [("10.77.0.11", "any", "50052", "tcp", HOST_FIREWALL_COMMENT)]
    assert converge(host, None, address="0.0.0.0").added == []


def test_neither_manager_changes_nothing() -> None:
    host = FirewallHost()
    outcome = converge(host, None)
    assert (outcome.manager, outcome.added, outcome.tracked) == ("none", [], [])
    assert outcome.facts["nft_tables"] == ["inet llamafleet_rpc"]
    assert host.changes() == []


def test_switching_managers_and_managers_gone() -> None:
    host = FirewallHost(firewalld="running", ufw="active")
    with pytest.raises(hf.HostFirewallError, match="both active"):
        converge(host, None)
    on_firewalld = converge(host, None, requested="firewalld")
    state = hf.dump_state(on_firewalld.tracked)
    # told to use ufw instead: firewalld's rules go, ufw's come
    on_ufw = converge(host, state, requested="ufw")
    assert host.permanent["public"] == [] and len(host.ufw_rules) == 1
    assert [r.manager for r in on_ufw.tracked] == ["ufw"]
    # ufw disabled but installed: its rule stays tracked, with a warning
    host.ufw = "inactive"
    off = converge(host, hf.dump_state(on_ufw.tracked), requested="none")
    assert off.tracked == on_ufw.tracked and "ufw is not active" in off.warnings[0]
    # ufw purged: forgotten
    host.ufw = "absent"
    gone = converge(host, hf.dump_state(off.tracked), requested="none")
    assert gone.tracked == [] and "no longer installed" in gone.warnings[0]


def test_named_manager_must_be_active() -> None:
    with pytest.raises(hf.HostFirewallError, match="firewalld is not active"):
        converge(FirewallHost(firewalld="stopped"), None, requested="firewalld")


def test_failing_command_is_named() -> None:
    host = FirewallHost(firewalld="running")
    real = host.run

    def failing(argv):
        if any(a.startswith("--add-rich-rule") for a in argv):
            return 13, "", "Error: INVALID_RULE: bad\n"
        return real(argv)

    with pytest.raises(hf.HostFirewallError, match=r"--zone=public --add-rich-rule=.*failed \(13\): Error: INVALID_RULE"):
        hf.converge(failing, host.which, "auto", ["10.77.0.11"], [50052], "10.77.0.13", None)


def test_choices_match_the_role() -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["rpc_server_host_firewall"]
    assert tuple(option["choices"]) == hf.CHOICES
    assert defaults["rpc_server_host_firewall"] == "auto"
