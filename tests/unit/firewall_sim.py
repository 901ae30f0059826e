"""A pretend host running firewalld or ufw, answering their commands as the real tools do.

firewalld: runtime and permanent rich rules per zone, ``--reload`` (runtime := permanent), the zone
bindings of ``--get-active-zones``; rules are listed as given (firewalld keeps the parsed rule's string).
ufw: the rules, and ``ufw status`` written with ufw's own format (src/backend_iptables.py ``get_status``).
Every command run is kept in ``calls``.
"""

from __future__ import annotations

import ipaddress
import shlex

UFW_LINE = "%-26s %-12s%-26s%s%s\n"
UFW_HEADER = "%-26s %-12s%s\n"
# `ip -o addr show` of a lab worker (iproute2 6.1)
LAB3_ADDRESSES = ("2: host0    inet 10.77.0.13/24 brd 10.77.0.255 scope global host0\\"
                  "       valid_lft forever preferred_lft forever\n")


class FirewallHost:
    """``run(argv)`` and ``which(name)`` of a host with firewalld and/or ufw."""

    def __init__(self, firewalld: str = "absent", ufw: str = "absent", nft: bool = True,
                 addresses: str = LAB3_ADDRESSES,
                 default_zone: str = "public", bindings: dict | None = None) -> None:
        self.firewalld = firewalld      # absent | stopped | running
        self.ufw = ufw                  # absent | inactive | active
        self.nft = nft
        self.addresses = addresses
        self.default_zone = default_zone
        self.bindings = bindings if bindings is not None else {"public": {"interfaces": ["host0"], "sources": []}}
        self.runtime: dict[str, list[str]] = {}
        self.permanent: dict[str, list[str]] = {}
        self.ufw_rules: list[tuple[str, str, str, str, str]] = []   # (client, address, port, proto, comment)
        self.calls: list[list[str]] = []

    def which(self, name: str) -> str | None:
        present = {"firewall-cmd": self.firewalld != "absent", "ufw": self.ufw != "absent", "nft": self.nft, "ip": True}
        return "/usr/sbin/" + name if present.get(name) else None

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(list(argv))
        tool, args = argv[0].rsplit("/", 1)[-1], argv[1:]
        return getattr(self, "_" + tool.replace("-", "_"))(args)

    def changes(self) -> list[list[str]]:
        """The commands that change something."""
        return [c for c in self.calls if any(a.startswith(("--add-", "--remove-", "allow", "delete")) for a in c[1:])]

    # --- the tools ---

    def _ip(self, args):
        return 0, self.addresses, ""

    def _nft(self, args):
        tables = ["inet llamafleet_rpc"] + (["inet firewalld"] if self.firewalld == "running" else []) + (
            ["ip filter", "ip6 filter"] if self.ufw == "active" else [])
        return 0, "".join("table %s\n" % t for t in tables), ""

    def _firewall_cmd(self, args):
        if args == ["--state"]:
            return (0, "running\n", "") if self.firewalld == "running" else (252, "", "not running\n")
        if self.firewalld != "running":
            return 252, "", "FirewallD is not running\n"
        if args == ["--get-default-zone"]:
            return 0, self.default_zone + "\n", ""
        if args == ["--get-active-zones"]:
            out = ""
            for zone, binding in self.bindings.items():
                out += zone + "\n" + "".join("  %s: %s\n" % (k, " ".join(v)) for k, v in binding.items() if v)
            return (0 if out else 2), out, ""
        if args == ["--reload"]:
            self.runtime = {z: list(r) for z, r in self.permanent.items()}
            return 0, "success\n", ""
        store = self.permanent if "--permanent" in args else self.runtime
        zone = next(a.split("=", 1)[1] for a in args if a.startswith("--zone="))
        rules = store.setdefault(zone, [])
        action = args[-1]
        if action == "--list-rich-rules":
            return 0, "".join(r + "\n" for r in rules), ""
        verb, rule = action.split("=", 1)
        if verb == "--add-rich-rule":
            if rule in rules:
                return 0, "", "Warning: ALREADY_ENABLED: %s\nsuccess\n" % rule
            rules.append(rule)
            return 0, "success\n", ""
        if verb == "--remove-rich-rule":
            if rule not in rules:
                return 0, "", "Warning: NOT_ENABLED: %s\nsuccess\n" % rule
            rules.remove(rule)
            return 0, "success\n", ""
        return 2, "", "usage: see firewall-cmd man page\n"

    def _ufw(self, args):
        if args == ["status"]:
            if self.ufw != "active":
                return 0, "Status: inactive\n", ""
            out = "Status: active\n"
            if self.ufw_rules:
                out += "\n" + UFW_HEADER % ("To", "Action", "From") + UFW_HEADER % ("--", "------", "----")
                for client, address, port, proto, comment in self.ufw_rules:
                    to = ("%s %s/%s" % (address, port, proto)) if address != "any" else "%s/%s" % (port, proto)
                    out += UFW_LINE % (to, "ALLOW ", client, "", " # %s" % comment if comment else "")
            return 0, out, ""
        delete = args[0] == "delete"
        words = args[1:] if delete else args
        fields = dict(zip(words[1::2], words[2::2]))  # allow proto P from C to A port N comment X
        rule = (str(ipaddress.ip_address(fields["from"])), fields["to"], fields["port"], fields["proto"],
                fields.get("comment", ""))
        same = [r for r in self.ufw_rules if r[:4] == rule[:4]]
        if delete:
            if not same:
                return 0, "Could not delete non-existent rule\n", ""
            self.ufw_rules.remove(same[0])
            return 0, "Rule deleted\n", ""
        if same:
            return 0, "Skipping adding existing rule\n", ""
        self.ufw_rules.append(rule)
        return 0, "Rule added\n", ""

    def __repr__(self) -> str:
        return "FirewallHost(%s)" % " ".join(shlex.quote(" ".join(c)) for c in self.calls)
