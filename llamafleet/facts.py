"""Facts: a command to run on a host and a pure parser of its output (as in pyinfra).

Every fact a CLI command needs from a host travels in one SSH session: the
facts' commands are joined into one shell script whose output marks where
each fact starts and ends, and each section goes to its fact's parser.  The
parsers take text and return values, so they are tested on recorded output
without SSH.  :func:`gather` runs the script on many hosts at once and keeps a
result or an error per host.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError
from .fleet import Fleet, Host

START = "::llamafleet-fact"
END = "::llamafleet-end"
NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Fact:
    """``command`` runs in a ``sh`` subshell (stderr discarded); ``parse`` turns its stdout into a value."""

    name: str
    command: str
    parse: Callable[[str], Any]

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ValueError(f"fact name {self.name!r} must match {NAME.pattern}")


@dataclass
class HostFacts:
    """The values of one host's facts, or why there are none."""

    host: str
    values: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def script(facts: Iterable[Fact]) -> str:
    """One shell script that prints every fact's output between markers (exit status included).

    Each command runs in its own subshell, so one that exits or fails does not stop the next.
    """
    return "".join(
        f"echo '{START} {fact.name}'\n"
        f"( {fact.command}\n) 2>/dev/null </dev/null\n"
        f"printf '\\n{END} %s\\n' \"$?\"\n"
        for fact in facts
    )


def split_sections(stdout: str) -> dict[str, tuple[str, int]]:
    """``{fact name: (its output, its exit status)}`` from the output of :func:`script`."""
    sections: dict[str, tuple[str, int]] = {}
    pattern = re.compile(rf"^{re.escape(START)} ([a-z0-9_]+)\n(.*?)\n{re.escape(END)} (\d+)$", re.M | re.S)
    for match in pattern.finditer(stdout):
        sections[match.group(1)] = (match.group(2), int(match.group(3)))
    return sections


def parse_output(facts: Iterable[Fact], stdout: str) -> dict[str, Any]:
    """Every fact's value from the script's output; ValueError names a fact that is missing or unreadable."""
    sections = split_sections(stdout)
    values = {}
    for fact in facts:
        if fact.name not in sections:
            raise ValueError(f"no output for fact {fact.name}")
        try:
            values[fact.name] = fact.parse(sections[fact.name][0])
        except (ValueError, IndexError, KeyError) as exc:
            raise ValueError(f"cannot read fact {fact.name}: {exc}") from exc
    return values


def gather(fleet: Fleet, hosts: Iterable[Host], facts_of: Callable[[Host], list[Fact]],
           timeout: float = 30.0) -> dict[str, HostFacts]:
    """The facts ``facts_of(host)`` of every host, read in parallel, one session per host."""
    hosts = list(hosts)
    results: dict[str, HostFacts] = {}
    planned: dict[str, list[Fact]] = {}
    for host in hosts:
        try:
            planned[host.name] = facts_of(host)
        except UserError as exc:
            results[host.name] = HostFacts(host.name, error=str(exc))
    runs = fleet.run(lambda h: script(planned[h.name]), [h for h in hosts if h.name in planned], timeout=timeout)
    for name, res in runs.items():
        if not res.ok:
            results[name] = HostFacts(name, error=res.reason)
            continue
        try:
            results[name] = HostFacts(name, parse_output(planned[name], res.stdout))
        except ValueError as exc:
            results[name] = HostFacts(name, error=str(exc))
    return {h.name: results[h.name] for h in hosts}


# Parsers of common commands' output.

def parse_du_bytes(text: str) -> int:
    """``du -sb PATH``: the size in bytes (0 when the path is missing and du printed nothing)."""
    line = text.strip().splitlines()[:1]
    return int(line[0].split()[0]) if line else 0


def parse_line_count(text: str) -> int:
    """Non-empty lines (``ls -A DIR``: entries of a directory)."""
    return sum(1 for line in text.splitlines() if line.strip())


def parse_word(text: str) -> str:
    """A single value (``readlink``, ``cat FILE``) without surrounding whitespace."""
    return text.strip()


def parse_route_device(text: str) -> str:
    """``ip -o route get ADDRESS``: the interface the route leaves by."""
    words = text.split()
    if "dev" not in words or words.index("dev") + 1 >= len(words):
        raise ValueError(f"no 'dev' in {text.strip()!r}")
    return words[words.index("dev") + 1]


def parse_counters(text: str) -> dict[str, int]:
    """``grep -H . /sys/class/net/*/statistics/NAME``: ``{interface: value}``."""
    out = {}
    for line in text.splitlines():
        path, sep, value = line.rpartition(":")
        if not sep:
            continue
        parts = path.split("/")
        if len(parts) >= 5 and parts[-2] == "statistics":
            out[parts[-3]] = int(value)
    return out


def parse_cmdline(text: str) -> list[str]:
    """``/proc/PID/cmdline``: the exact argv (NUL-separated)."""
    if not text:
        return []
    args = text.split("\0")
    return args[:-1] if args[-1] == "" else args
