"""Shared helpers for the tests that drive real hosts: the CLI, ansible-playbook and the recap."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
INVENTORY = REPO / "inventories" / "lab" / "hosts.ini"
BIN = Path(sys.executable).parent
# deploy.yml's preflight fit check (roles/llama_server/tasks/fit_check.yml) as the output names its task, and the play
# after the preflight that fetches the model (playbooks/deploy.yml): a refusal in preflight never prints the second.
FIT_CHECK_TASK = ("TASK [llamafleet.cluster.llama_server : Check the model fits the cluster at this context "
                  "(preflight, from the GGUF header)")
MODEL_PLAY = "PLAY [Fetch the model]"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
    e["PATH"] = f"{BIN}:{e.get('PATH', '')}"
    e.setdefault("ANSIBLE_FORCE_COLOR", "0")
    e["ANSIBLE_NOCOLOR"] = "1"
    return e


def cli(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "llamafleet"), *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"llamafleet {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# deploy.yml with every task, whatever the stamps say: the tests of the roles' own idempotence and check mode (a run
# without it on a fleet in sync with its stamps leaves the roles out: tests/e2e/test_deploy.py tests that way)
EVERY_TASK = ("-e", "llamafleet_skip_when_in_sync=false")


@dataclass
class PlaybookRun:
    rc: int
    output: str
    recap: dict[str, dict[str, int]]

    @property
    def changed(self) -> int:
        return sum(h.get("changed", 0) for h in self.recap.values())

    @property
    def failed(self) -> int:
        return sum(h.get("failed", 0) + h.get("unreachable", 0) for h in self.recap.values())


RECAP_LINE = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$")


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    recap: dict[str, dict[str, int]] = {}
    in_recap = False
    for line in output.splitlines():
        if line.startswith("PLAY RECAP"):
            in_recap = True
            continue
        if in_recap:
            m = RECAP_LINE.match(line.strip())
            if m:
                recap[m.group(1)] = {k: int(v) for k, v in (kv.split("=") for kv in m.group(2).split())}
    return recap


def playbook(name: str, *args: str, timeout: float = 3600, inventory: Path = INVENTORY) -> PlaybookRun:
    cmd = [str(BIN / "ansible-playbook"), "-i", str(inventory), str(REPO / "playbooks" / name), *args]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    run = PlaybookRun(proc.returncode, out, parse_recap(proc.stdout))
    _log_run(name, args, time.monotonic() - started, run)
    return run


def _log_run(name: str, args: tuple[str, ...], seconds: float, run: PlaybookRun) -> None:
    """One line per playbook run in the e2e progress file (LLAMAFLEET_E2E_PROGRESS, when set): where a module's
    time goes, run by run."""
    progress = os.environ.get("LLAMAFLEET_E2E_PROGRESS")
    if not progress:
        return
    shown = " ".join(args)
    shown = shown if len(shown) <= 100 else shown[:97] + "..."
    with open(progress, "a", encoding="utf-8") as handle:
        handle.write(f"{time.strftime('%H:%M:%S')} {seconds:7.1f} s playbook rc={run.rc} changed={run.changed} "
                     f"{name} {shown}\n")


def inventory_variant(folder: Path, lines: list[str]) -> Path:
    """``folder``/hosts.ini with ``lines`` (the lab inventory edited) and the lab's group_vars beside it, as ansible
    reads them: the inventory to pass to :func:`playbook`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts.ini").write_text("\n".join(lines) + "\n")
    shutil.copytree(INVENTORY.parent / "group_vars", folder / "group_vars", dirs_exist_ok=True)
    return folder / "hosts.ini"


def self_signed_pair(host: str, days: int = 1) -> tuple[bytes, bytes]:
    """A self-signed certificate for ``host`` (an IP address or a DNS name) and its key, both PEM
    (needs the ``cryptography`` package, which the tests' lock pins)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt = x509.DNSName(host)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def _cache() -> Path:
    return Path(os.environ.get("LLAMAFLEET_CACHE", "/var/cache/llamafleet"))


def lowest_ansible(runtime_text: str) -> str:
    """The version in requires_ansible's ``>=`` clause (``">=2.17.0"`` or ``">=2.17.0,<2.21"`` -> ``"2.17.0"``)."""
    spec = str(yaml.safe_load(runtime_text)["requires_ansible"])
    lowest = [m.group(1) for m in (re.fullmatch(r"\s*>=\s*([0-9]+\.[0-9]+\.[0-9]+)\s*", c) for c in spec.split(","))
              if m]
    if len(lowest) != 1:
        raise ValueError("requires_ansible %r has no single >=X.Y.Z clause" % spec)
    return lowest[0]


def ansible_venv(version: str) -> Path:
    """bin/ of a virtual environment holding ansible-core ``version``, made once and kept in the cache."""
    venv = _cache() / ("ansible-core-%s" % version)
    done = venv / ".installed"
    _cache().mkdir(parents=True, exist_ok=True)
    with open(_cache() / (".ansible-core-%s.lock" % version), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once build it once
        if not done.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                            "ansible-core==%s" % version], check=True)
            done.touch()
    return venv / "bin"


def invocation(fleet, host: str, unit: str) -> str:
    """The InvocationID of ``unit`` on ``host``: it changes on every (re)start."""
    import shlex  # noqa: PLC0415

    from llamafleet.core.systemd_show import show_argv  # noqa: PLC0415 - the library, only for the lab tests

    return fleet.run_one(shlex.join(show_argv(unit, ["InvocationID"], value=True)), fleet.hosts[host]).strip()


def current_builds(fleet) -> dict[str, str]:
    """The build id each host's ``<build root>/current`` link names (a relative link: the id itself)."""
    from llamafleet.core import constants  # noqa: PLC0415 - the library, only for the lab tests

    return {host: r.stdout.strip() for host, r in fleet.run(f"readlink {constants.LLAMACPP_ROOT}/current").items()}


def listeners(fleet, port: int, host=None) -> list[str]:
    """The programs that listen on ``port`` on ``host`` (the orchestrator by default), as ``PROGRAM ADDRESS:PORT``:
    ``haproxy 10.77.0.11:8080`` where the edge serves the clients' port, ``python3 ...`` where the gate does."""
    out = fleet.run_one(f"ss -Hltnp 'sport = :{port}'", host or fleet.orchestrator)
    found = []
    for line in out.splitlines():
        fields = line.split()
        program = re.search(r'users:\(\("([^"]+)"', line)
        found.append(f"{program.group(1) if program else '?'} {fields[3]}")
    return sorted(set(found))


# Where the e2e tests put the TLS pairs they make on the orchestrator (under /etc/llamafleet: teardown takes it too).
TLS_DIR = "/etc/llamafleet/tls"


def put_tls_file(fleet, host, path: str, data: bytes, mode: str) -> None:
    """``data`` (PEM) into ``path`` in TLS_DIR on ``host``, root's and the service group's (the gate reads it as the
    service user with ``llamafleet_edge: none``; the edge's HAProxy reads a copy as root)."""
    res = fleet.run(f"install -d -m 0750 -o root -g llamafleet {TLS_DIR} && cat > {path} <<'EOF'\n"
                    f"{data.decode()}EOF\nchown root:llamafleet {path} && chmod {mode} {path}", [host])[host.name]
    assert res.ok, res.stderr
