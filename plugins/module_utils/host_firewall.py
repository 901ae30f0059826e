# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The workers' rpc allowlist on hosts where firewalld or ufw also filters.

The rpc_server role's own nftables table (``inet llamafleet_rpc``, base chain at
hook input) accepts the clients on the rpc-server ports and rejects everyone else
with an explicit rule, not a chain policy.  nftables runs every base chain of a
hook: ``accept`` only ends the chain it is in, ``drop``/``reject`` is final.  So
where firewalld (table ``inet firewalld``) or ufw (iptables-nft chains in
``ip filter``/``ip6 filter``) is active, a packet our table accepts must also be
accepted there: this file opens the ports to the clients only, in that manager
(a firewalld rich rule, permanent and runtime, in the zone the client's packets
land in; a ufw ``allow ... comment llamafleet-rpc`` rule).  Our table stays the
allowlist: where the manager accepts everything (firewalld's ``trusted`` zone,
``ufw default allow``), it still rejects everyone else.

Rules added are recorded in a state file (constants.HOST_FIREWALL_STATE), since
firewalld rich rules carry no comment, and removed when no longer wanted (an
orchestrator left).  A rule that was already there (the admin's) is never
recorded, so never removed.

Halves: parsers of the tools' output and renderers of their rules (pure), the
plan (pure), and :func:`probe`/:func:`converge`, which run commands through a
``Runner`` the caller passes (the modules pass ``module.run_command``).
Stdlib only (``llamafleet.core.host_firewall``).
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .constants import HOST_FIREWALL_COMMENT
from .gpu_probe import Runner, Which

MANAGERS = ("firewalld", "ufw")
# rpc_server_host_firewall: auto detects the active manager.
CHOICES = ("auto",) + MANAGERS + ("none",)
PROTOCOL = "tcp"
STATE_VERSION = 1
# firewalld keeps two configurations: the running one and the one loaded at start and on --reload.
FIREWALLD_LAYERS = ("runtime", "permanent")
ANY_ADDRESSES = ("", "0.0.0.0", "::")


class HostFirewallError(Exception):
    """A command failed or the settings cannot be met; the message says which."""


@dataclass(frozen=True, order=True)
class Rule:
    """One allow rule: TCP from ``client`` to ``address`` (``""``: any) port ``port``, in ``manager``.

    ``zone`` is the firewalld zone ("" for ufw).  Addresses are normalized (:func:`normalize_address`).
    """

    manager: str
    zone: str
    client: str
    address: str
    port: int

    def as_dict(self) -> dict[str, Any]:
        """The rule as the state file stores it."""
        return asdict(self)

    def describe(self) -> str:
        """One line for reports: the manager, the zone and the rule as the tool writes it."""
        if self.manager == "firewalld":
            return "firewalld zone %s: %s" % (self.zone, render_rich_rule(self))
        return "ufw " + " ".join(ufw_rule_args(self))


def normalize_address(text: str) -> str:
    """An address or network in one spelling: ``10.77.0.11/32`` -> ``10.77.0.11``, ``10.0.0.1/8`` -> ``10.0.0.0/8``.

    Raises ValueError for anything else.
    """
    network = ipaddress.ip_network(str(text).strip(), strict=False)
    if network.prefixlen == network.max_prefixlen:
        return str(network.network_address)
    return str(network)


def family(address: str) -> str:
    """``ipv4`` or ``ipv6``: the firewalld rule family of an address or network."""
    return "ipv%d" % ipaddress.ip_network(address, strict=False).version


def _contains(network: str, address: str) -> int | None:
    """The prefix length of ``network`` when it holds ``address``, else None (bad text: None)."""
    try:
        net = ipaddress.ip_network(network, strict=False)
        addr = ipaddress.ip_network(address, strict=False)
    except ValueError:
        return None
    if net.version != addr.version or not addr.subnet_of(net):
        return None
    return net.prefixlen


# --- firewalld -------------------------------------------------------------------------------

def render_rich_rule(rule: Rule) -> str:
    """The firewalld rich rule of ``rule``, written as firewalld lists it (its Rich_Rule.__str__ order)."""
    text = 'rule family="%s" source address="%s"' % (family(rule.client), rule.client)
    if rule.address:
        text += ' destination address="%s"' % rule.address
    return text + ' port port="%d" protocol="%s" accept' % (rule.port, PROTOCOL)


_RICH_RULE = re.compile(
    r'^rule family="(?P<family>ipv[46])" source address="(?P<client>[^"]+)"'
    r'(?: destination address="(?P<address>[^"]+)")?'
    r' port port="(?P<port>\d+)" protocol="(?P<protocol>[a-z]+)" accept$')


def parse_rich_rule(line: str, zone: str) -> Rule | None:
    """The Rule of one line of ``firewall-cmd --list-rich-rules``, or None when it is not of our shape.

    Our shape: family, one source address, an optional destination address, one port, accept, nothing
    else (no NOT, log, limit, priority).  Anything else is someone else's rule and left alone.
    """
    match = _RICH_RULE.match(line.strip())
    if not match or match["protocol"] != PROTOCOL:
        return None
    try:
        client = normalize_address(match["client"])
        address = normalize_address(match["address"]) if match["address"] else ""
    except ValueError:
        return None
    if family(client) != match["family"]:
        return None
    return Rule("firewalld", zone, client, address, int(match["port"]))


def parse_rich_rules(text: str, zone: str) -> dict[Rule, str]:
    """``{Rule: the line as listed}`` of our shape in ``firewall-cmd [--permanent] --zone=Z --list-rich-rules``."""
    found = {}
    for line in text.splitlines():
        rule = parse_rich_rule(line, zone)
        if rule is not None:
            found[rule] = line.strip()
    return found


def parse_active_zones(text: str) -> dict[str, dict[str, list[str]]]:
    """``firewall-cmd --get-active-zones``: ``{zone: {"interfaces": [...], "sources": [...]}}``.

    A zone line is the zone's name (firewalld 2 adds `` (default)`` or `` (active)``); its bindings follow,
    indented, as ``interfaces: a b`` and ``sources: 10.0.0.0/8``.
    """
    zones: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            current = line.split()[0]
            zones[current] = {"interfaces": [], "sources": []}
            continue
        key, sep, values = line.strip().partition(":")
        if current is not None and sep and key in ("interfaces", "sources"):
            zones[current][key].extend(values.split())
    return zones


def client_zones(client: str, interface: str | None, zones: Mapping[str, Mapping[str, Sequence[str]]],
                 default_zone: str) -> list[str]:
    """The zones whose rules firewalld applies to ``client``'s packets arriving for the rpc-server.

    A zone bound to a source holding the client wins (the most specific one); else the zone of the interface
    holding the bind address; else the default zone.  With no interface known (a wildcard bind address),
    every zone bound to an interface and the default zone.
    """
    by_source = [(prefix, name) for name, binding in zones.items() for src in binding.get("sources", ())
                 for prefix in [_contains(src, client)] if prefix is not None]
    if by_source:
        return [max(by_source)[1]]
    if interface is not None:
        for name, binding in zones.items():
            if interface in binding.get("interfaces", ()):
                return [name]
        return [default_zone]
    return sorted({name for name, binding in zones.items() if binding.get("interfaces")} | {default_zone})


# --- ufw -------------------------------------------------------------------------------------

def ufw_rule_args(rule: Rule, comment: str = HOST_FIREWALL_COMMENT) -> list[str]:
    """The arguments of ``ufw`` (after ``ufw`` or ``ufw delete``) that add ``rule`` with ``comment``."""
    return ["allow", "proto", PROTOCOL, "from", rule.client, "to", rule.address or "any",
            "port", str(rule.port), "comment", comment]


# ufw's get_status: "%-26s %-12s%-26s%s%s" % (to, "ACTION DIR", from, " (log)", " # comment");
# the direction is left out for incoming rules of a plain `ufw status`.
_UFW_LINE = re.compile(
    r"^(?:\[\s*\d+\]\s+)?(?P<to>.+?)\s+(?P<action>ALLOW|DENY|REJECT|LIMIT)(?: (?P<direction>IN|OUT|FWD))?\s+"
    r"(?P<source>.+?)(?:\s+\((?P<attribs>[^)]*)\))?(?:\s+# (?P<comment>.*))?$")
_UFW_TO = re.compile(r"^(?:(?P<address>\S+) )?(?P<port>\d+)/(?P<protocol>[a-z]+)$")


def parse_ufw_line(line: str) -> tuple[Rule, str] | None:
    """(Rule, comment) of one rule line of ``ufw status`` (or ``status numbered``), or None when not our shape.

    Our shape: an incoming ALLOW to one TCP port, from one address, no interface, no logging, IPv4 or IPv6.
    """
    match = _UFW_LINE.match(line.rstrip())
    if not match or match["action"] != "ALLOW" or match["direction"] not in (None, "IN") or match["attribs"]:
        return None
    to = _UFW_TO.match(match["to"].strip())
    source = match["source"].strip()
    if not to or to["protocol"] != PROTOCOL or " " in source:
        return None
    try:
        client = normalize_address(source)
        address = normalize_address(to["address"]) if to["address"] else ""
    except ValueError:
        return None
    return Rule("ufw", "", client, address, int(to["port"])), (match["comment"] or "").strip()


def parse_ufw_status(text: str) -> dict[str, Any]:
    """``ufw status``: ``{"active": bool, "rules": {Rule: comment}}`` (rules of our shape only)."""
    lines = text.splitlines()
    active = bool(lines) and lines[0].strip() == "Status: active"
    rules = {}
    for line in lines[1:]:
        parsed = parse_ufw_line(line)
        if parsed is not None:
            rules[parsed[0]] = parsed[1]
    return {"active": active, "rules": rules}


# --- the host --------------------------------------------------------------------------------

def parse_ip_addresses(text: str) -> dict[str, str]:
    """``ip -o addr show``: ``{address: interface}`` (``4: eth0    inet 192.0.2.2/24 ...``)."""
    found = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("inet", "inet6"):
            found[fields[3].split("/")[0]] = fields[1].split("@")[0]
    return found


def parse_nft_tables(text: str) -> list[str]:
    """``nft list tables``: ``["inet firewalld", "ip filter", ...]``."""
    return [line.strip()[len("table "):] for line in text.splitlines() if line.strip().startswith("table ")]


def resolve_manager(requested: str, facts: Mapping[str, Any]) -> tuple[str, str | None]:
    """(the manager to open the ports in, or ``none``; a problem or None) for ``requested`` on a host.

    ``auto`` takes the active one; firewalld and ufw both active is a problem (say which is in charge).
    A manager named outright must be active.
    """
    active = [m for m in MANAGERS if facts.get(m, {}).get("active")]
    if requested not in CHOICES:
        return "none", "must be one of %s, got %r" % (", ".join(CHOICES), requested)
    if requested == "auto":
        if len(active) > 1:
            return "none", "firewalld and ufw are both active on this host: name the one in charge"
        return (active[0] if active else "none"), None
    if requested in MANAGERS and requested not in active:
        state = facts.get(requested, {})
        why = "is not installed" if not state.get("installed") else "is not active (%s)" % (
            state.get("status") or "no answer")
        return "none", "%s %s on this host" % (requested, why)
    return requested, None


@dataclass
class Plan:
    """What to change in one manager: rules to add and to remove per layer, and the rules to track after."""

    add: dict[str, list[Rule]] = field(default_factory=dict)
    remove: dict[str, list[Rule]] = field(default_factory=dict)
    tracked: list[Rule] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to add or remove."""
        return not any(self.add.values()) and not any(self.remove.values())


def plan_changes(wanted: Iterable[Rule], present: Mapping[str, Iterable[Rule]], tracked: Iterable[Rule]) -> Plan:
    """Add what is wanted and missing, remove what we added and is no longer wanted, per layer.

    ``present``: the rules of our shape in each layer (firewalld: runtime and permanent).  ``tracked``: the
    rules we added before (the state file, and ufw rules with our comment).  A wanted rule that was in every
    layer already and that we did not add stays untracked, so that it is never removed.
    """
    wanted, tracked = set(wanted), set(tracked)
    layers = {name: set(rules) for name, rules in present.items()}
    plan = Plan()
    for name, rules in layers.items():
        plan.add[name] = sorted(wanted - rules)
        plan.remove[name] = sorted((tracked - wanted) & rules)
    added = {rule for rules in plan.add.values() for rule in rules}
    plan.tracked = sorted((tracked & wanted) | added)
    return plan


def load_state(text: str | None) -> list[Rule]:
    """The rules a state file records (an absent or unreadable file records none)."""
    if not text:
        return []
    try:
        data = json.loads(text)
        return sorted(Rule(r["manager"], r["zone"], r["client"], r["address"], int(r["port"]))
                      for r in data.get("rules", []) if r.get("manager") in MANAGERS)
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


def dump_state(rules: Iterable[Rule]) -> str:
    """The state file's text for ``rules``."""
    return json.dumps({"version": STATE_VERSION, "rules": [r.as_dict() for r in sorted(set(rules))]},
                      indent=2, sort_keys=True) + "\n"


def _run(run: Runner, argv: list[str], empty_ok: bool = False) -> str:
    """stdout of ``argv``; HostFirewallError naming the command when it fails (``empty_ok``: unless it printed nothing)."""
    rc, out, err = run(argv)
    if rc != 0 and not (empty_ok and not out.strip()):
        raise HostFirewallError("%s failed (%d): %s" % (" ".join(argv), rc, (err or out).strip()[-400:]))
    return out if rc == 0 else ""


def probe(run: Runner, which: Which) -> dict[str, Any]:
    """Which firewall managers are installed and active, and the nftables tables.

    firewalld: ``firewall-cmd --state`` (``running``; it asks the daemon).  ufw: ``ufw status`` (``Status:
    active``); ``systemctl is-active ufw`` says nothing, the unit is a oneshot that stays active with
    ufw disabled.  Read-only.
    """
    facts: dict[str, Any] = {}
    for name, tool, argv, is_active in (
            ("firewalld", "firewall-cmd", ["--state"], lambda rc, out: rc == 0 and out.strip() == "running"),
            ("ufw", "ufw", ["status"], lambda rc, out: rc == 0 and parse_ufw_status(out)["active"])):
        path = which(tool)
        if path is None:
            facts[name] = {"installed": False, "active": False, "status": ""}
            continue
        rc, out, err = run([path] + argv)
        status = (out.strip() or err.strip()).splitlines()
        facts[name] = {"installed": True, "active": bool(is_active(rc, out)), "status": status[0] if status else ""}
    nft = which("nft")
    listed = run([nft, "list", "tables"]) if nft else (1, "", "")
    facts["nft_tables"] = parse_nft_tables(listed[1]) if listed[0] == 0 else None
    return facts


def _firewalld_wanted(run: Runner, tool: str, clients: Sequence[str], ports: Sequence[int],
                      address: str, ip_tool: str | None) -> tuple[set[Rule], dict[str, Any]]:
    """The firewalld rules wanted, with the zones found (``{"interface", "default_zone", "zones"}``)."""
    interface = None
    if address and ip_tool:
        interface = parse_ip_addresses(_run(run, [ip_tool, "-o", "addr", "show"])).get(address)
    default_zone = _run(run, [tool, "--get-default-zone"]).strip()
    # no interface or source bound to a zone: some versions exit non-zero, printing nothing
    zones = parse_active_zones(_run(run, [tool, "--get-active-zones"], empty_ok=True))
    wanted = {Rule("firewalld", zone, client, address, port)
              for client in clients for zone in client_zones(client, interface, zones, default_zone)
              for port in ports}
    return wanted, {"interface": interface, "default_zone": default_zone, "zones": sorted(zones)}


def _firewalld_present(run: Runner, tool: str, zones: Iterable[str]) -> dict[str, dict[Rule, str]]:
    """``{layer: {Rule: listed line}}`` of our shape in ``zones``, runtime and permanent."""
    present: dict[str, dict[Rule, str]] = {layer: {} for layer in FIREWALLD_LAYERS}
    for zone in sorted(set(zones)):
        for layer in FIREWALLD_LAYERS:
            argv = [tool] + (["--permanent"] if layer == "permanent" else []) + ["--zone=" + zone, "--list-rich-rules"]
            present[layer].update(parse_rich_rules(_run(run, argv), zone))
    return present


def firewalld_command(tool: str, layer: str, verb: str, rule: Rule, text: str | None = None) -> list[str]:
    """``firewall-cmd [--permanent] --zone=Z --add-rich-rule=R`` (verb ``add`` or ``remove``)."""
    return ([tool] + (["--permanent"] if layer == "permanent" else [])
            + ["--zone=" + rule.zone, "--%s-rich-rule=%s" % (verb, text or render_rich_rule(rule))])


def ufw_command(tool: str, verb: str, rule: Rule, comment: str) -> list[str]:
    """``ufw allow ...`` or ``ufw delete allow ...`` for ``rule``."""
    return [tool] + (["delete"] if verb == "remove" else []) + ufw_rule_args(rule, comment)


@dataclass
class Outcome:
    """What :func:`converge` found and did (or, in check mode, would do)."""

    manager: str
    facts: dict[str, Any]
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    tracked: list[Rule] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    zones: dict[str, Any] = field(default_factory=dict)
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The module's result (without ``changed``)."""
        return {"manager": self.manager, "facts": self.facts, "added": self.added, "removed": self.removed,
                "rules": [r.as_dict() for r in self.tracked], "warnings": self.warnings, "firewalld": self.zones,
                "diff": {"before": "".join(line + "\n" for line in self.before),
                         "after": "".join(line + "\n" for line in self.after)}}


def _lines(layers: Mapping[str, Iterable[Rule]]) -> list[str]:
    """Report lines of rules per layer."""
    return sorted("%s %s" % (layer, rule.describe()) if layer != "ufw" else rule.describe()
                  for layer, rules in layers.items() for rule in rules)


def converge(run: Runner, which: Which, requested: str, clients: Sequence[str], ports: Sequence[int],
             address: str, state: str | None, comment: str = HOST_FIREWALL_COMMENT,
             check_mode: bool = False) -> Outcome:
    """Open ``ports`` at ``address`` to ``clients`` in the host's active manager and remove what we no longer want.

    ``state``: the state file's text (None: none yet); the caller writes :func:`dump_state` of
    ``outcome.tracked`` when it differs.  A manager other than the chosen one gets its tracked rules removed
    when it is active; when it is not, they stay tracked (installed: it may start again) or are forgotten
    (not installed: nothing left to remove).
    """
    facts = probe(run, which)
    manager, problem = resolve_manager(requested, facts)
    if problem:
        raise HostFirewallError(problem)
    clients = sorted({normalize_address(c) for c in clients})
    address = "" if address in ANY_ADDRESSES else normalize_address(address)
    ports = sorted({int(p) for p in ports})
    outcome = Outcome(manager, facts)
    tracked_all = load_state(state)
    for name in MANAGERS:
        tracked = {r for r in tracked_all if r.manager == name}
        if not facts[name]["active"]:
            if tracked and facts[name]["installed"]:
                outcome.tracked.extend(sorted(tracked))
                outcome.warnings.append("%s is not active: the %d rule(s) llamafleet added there stay until it runs "
                                        "again (%s)" % (name, len(tracked), "; ".join(r.describe() for r in sorted(tracked))))
            elif tracked:
                outcome.warnings.append("%s is no longer installed: forgetting the rule(s) llamafleet had added there"
                                        % name)
            continue
        tool = which("firewall-cmd" if name == "firewalld" else "ufw")
        if name == "firewalld":
            wanted: set[Rule] = set()
            if manager == name:
                wanted, outcome.zones = _firewalld_wanted(run, tool, clients, ports, address, which("ip"))
            listed = _firewalld_present(run, tool, {r.zone for r in wanted | tracked})
            present = {layer: set(rules) for layer, rules in listed.items()}
        else:
            wanted = {Rule("ufw", "", c, address, p) for c in clients for p in ports} if manager == name else set()
            found = parse_ufw_status(_run(run, [tool, "status"]))["rules"]
            tracked |= {rule for rule, note in found.items() if note == comment}
            present = {"ufw": set(found)}
            listed = {}
        plan = plan_changes(wanted, present, tracked)
        outcome.before.extend(_lines({layer: rules & (wanted | tracked) for layer, rules in present.items()}))
        outcome.after.extend(_lines({layer: (rules & (wanted | tracked)) - set(plan.remove[layer]) | wanted
                                     for layer, rules in present.items()}))
        for verb, changes in (("remove", plan.remove), ("add", plan.add)):
            for layer, rules in changes.items():
                for rule in rules:
                    if name == "firewalld":
                        argv = firewalld_command(tool, layer, verb, rule, listed[layer].get(rule))
                    else:
                        argv = ufw_command(tool, verb, rule, comment)
                    if not check_mode:
                        _run(run, argv)
                    (outcome.added if verb == "add" else outcome.removed).append(
                        ("%s %s" % (layer, rule.describe())) if name == "firewalld" else rule.describe())
        outcome.tracked.extend(plan.tracked)
    outcome.tracked.sort()
    return outcome


def host_firewall_problem(requested: str, facts: Mapping[str, Any]) -> str | None:
    """The preflight's message for ``rpc_server_host_firewall=requested`` on a host with ``facts``, or None."""
    problem = resolve_manager(requested, facts)[1]
    return None if problem is None else "rpc_server_host_firewall=%s: %s" % (requested, problem)
