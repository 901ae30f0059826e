"""The lab: real hosts on this machine, as one object.

``Lab(hosts=3).up()`` gives hosts ``lab1``..``lab3``, each a systemd-nspawn container
booting real systemd and sshd at 10.77.0.11.. on bridge ``lfbr0``, plus the two
controller daemons the hosts need (package proxy, file mirror) and an Ansible
inventory.  ``up`` is idempotent and undoes what it made when it fails; ``down``
removes everything, finding it by name and command line if the state files are gone.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from . import artifacts
from .daemon import DaemonSpec, DaemonStatus, daemon_status, ensure_daemon, port_open, stop_daemon
from .image import (DEFAULT_KIND, HOST_KINDS, OVERLAY_SOURCE, BaseImage, HostRoot, detect_mirror, ensure_base_image,
                    image_key, provision_host, prune_images)
from .inventory import remove_inventory, render_known_hosts, write_inventory
from .machines import (CGROUP_PARENT, Machine, console_tail, container_inits, find_machines, kill_orphaned_containers,
                       remove_cgroups, start_machine, stop_machines, systemd_cgroup_roots)
from .memory import (check_memory_mib, host_limit_mib, keep_limit, memory_hierarchy, outside_lab_cgroup,
                     prepare_host_cgroup, remove_memory_cgroups)
from .mirror import MIRROR_PORT, publish
from .net import (BRIDGE, GATEWAY, HOST_NAME_RE, MAX_HOSTS, LabHost, bridge_state, delete_link, ensure_bridge,
                  ip_forwarding_enabled, lab_hosts, lab_veths, link_exists, parse_rate, qdisc_rate, set_tbf)
from .paths import DEFAULT_INVENTORY_DIR, LabPaths, require_checkout
from .proxy import PROXY_PORT, PROXY_URL
from .system import (LabError, current_mounts, lab_lock, remove_tree, require_controller, run, unmount,
                     write_atomic)

UP_TOOLS = ("debootstrap", "systemd-nspawn", "ip", "ssh", "ssh-keygen", "mount", "umount", "setsid", "systemctl")
DOWN_TOOLS = ("ip", "umount")
SHAPE_TOOLS = ("tc", "nsenter")
BOOT_TIMEOUT = 120.0
STATE_VERSION = 1
# Each lab host stands for a machine with this much RAM (enforced: its memory cgroup's limit). Large enough for a
# compile and for gemma; a model of over 4 GiB fits on no single host, only across the fleet.
DEFAULT_MEMORY_MIB = 4096

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- SSH


def host_kinds(hosts: Sequence[LabHost], kinds: Mapping[str, str]) -> dict[str, str]:
    """Each host's kind (:data:`~llamafleet.lab.image.HOST_KINDS`): ``kinds`` names the hosts that are not
    ``cpu``. A name outside ``hosts`` or an unknown kind is a LabError naming it."""
    names = [h.name for h in hosts]
    for name, kind in kinds.items():
        if name not in names:
            raise LabError(f"{name} is not a host of this lab ({', '.join(names)}): it cannot be a {kind} host")
        if kind not in HOST_KINDS:
            raise LabError(f"{name}: unknown host kind {kind!r} (known: {', '.join(sorted(HOST_KINDS))})")
    return {name: kinds.get(name, DEFAULT_KIND) for name in names}


def resolve_host(host: str | LabHost) -> LabHost:
    """A :class:`LabHost` from itself, a name (``lab2``) or a lab address (``10.77.0.12``)."""
    if isinstance(host, LabHost):
        return host
    if HOST_NAME_RE.match(host):
        return LabHost.from_name(host)
    for candidate in lab_hosts(MAX_HOSTS):
        if candidate.address == host:
            return candidate
    raise LabError(f"{host!r} is neither a lab host name (lab1, lab2, ...) nor a lab address (10.77.0.11, ...)")


def ssh_argv(paths: LabPaths, host: LabHost, command: str | Sequence[str], connect_timeout: int = 5) -> list[str]:
    """An ``ssh`` command line to run ``command`` as root on ``host``, with its host key pinned."""
    remote = command if isinstance(command, str) else shlex.join(command)
    return [
        "ssh", "-i", str(paths.ssh_key), "-o", "IdentitiesOnly=yes",
        "-o", f"UserKnownHostsFile={paths.known_hosts}", "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}", "-o", "LogLevel=ERROR",
        f"root@{host.address}", "--", remote,
    ]


def ssh(
    host: str | LabHost,
    command: str | Sequence[str],
    *,
    check: bool = True,
    timeout: float = 300,
    connect_timeout: int = 5,
    paths: LabPaths | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (a shell string or an argument list) as root on a lab host over SSH.

    Returns the completed process (text ``stdout``/``stderr``); with ``check`` a
    non-zero exit raises :class:`LabError` naming the host and the command.
    """
    target = resolve_host(host)
    argv = ssh_argv(paths or LabPaths.default(), target, command, connect_timeout)
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{target.name}: {argv[-1]!r} did not finish within {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise LabError(f"{target.name}: {argv[-1]!r} failed (exit {proc.returncode})"
                       + ("\n  " + "\n  ".join(detail) if detail else ""))
    return proc


def ensure_ssh_key(paths: LabPaths) -> str:
    """The lab's SSH public key, generating the ed25519 key pair on first use."""
    if not paths.ssh_key.is_file():
        paths.lab_dir.mkdir(parents=True, exist_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "llamafleet-lab", "-f", str(paths.ssh_key)],
            what="generating the lab SSH key")
    paths.ssh_key.chmod(0o600)
    return paths.ssh_key.with_suffix(".pub").read_text(encoding="ascii").strip()


# --------------------------------------------------------------------------- daemons


def proxy_spec(allow: Sequence[str] = ()) -> DaemonSpec:
    """The package proxy daemon, forwarding only to the mirrors in ``allow``."""
    args = ["--listen", f"{GATEWAY}:{PROXY_PORT}"]
    for entry in allow:
        args += ["--allow", entry]
    return DaemonSpec("proxy", "llamafleet.lab.proxy", tuple(args), GATEWAY, PROXY_PORT)


def mirror_spec(paths: LabPaths) -> DaemonSpec:
    """The file mirror daemon, serving ``paths.mirror_dir``."""
    args = ("--listen", f"{GATEWAY}:{MIRROR_PORT}", "--root", str(paths.mirror_dir))
    return DaemonSpec("mirror", "llamafleet.lab.mirror", args, GATEWAY, MIRROR_PORT)


# --------------------------------------------------------------------------- status


@dataclass(frozen=True)
class HostStatus:
    """One host as seen now."""

    name: str
    address: str
    running: bool
    ssh_ok: bool
    systemd: str
    shaped: str | None = None
    memory_mib: int | None | bool = None  # the enforced limit; None: none; False: outside a lab memory cgroup

    @property
    def healthy(self) -> bool:
        return self.running and self.ssh_ok and self.systemd == "running"


@dataclass(frozen=True)
class LabStatus:
    """Hosts, daemons and bridge as seen now."""

    hosts: list[HostStatus]
    daemons: list[DaemonStatus]
    bridge: bool
    bridge_addresses: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        """True when there is at least one host and everything is up and answering."""
        return (bool(self.hosts) and self.bridge and all(h.healthy for h in self.hosts)
                and all(d.pid and d.listening for d in self.daemons))


class _Undo:
    """What a failing ``up`` must take back, most recent first."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], object]]] = []

    def push(self, what: str, action: Callable[[], object]) -> None:
        self._steps.append((what, action))

    def __bool__(self) -> bool:
        return bool(self._steps)

    def run(self, say: Progress) -> None:
        while self._steps:
            what, action = self._steps.pop()
            try:
                action()
            except Exception as exc:  # keep undoing the rest; report what could not be undone
                say(f"    could not undo {what}: {exc}")


# --------------------------------------------------------------------------- the lab


class Lab:
    """A lab of ``hosts`` hosts (``lab1``..) on this machine.

    ``paths`` defaults to ``$LLAMAFLEET_CACHE``; ``inventory_dir`` to the
    repository's ``inventories/lab``; ``progress`` receives human progress lines
    (pass ``None`` for silence).
    """

    def __init__(self, hosts: int = 3, *, kinds: Mapping[str, str] | None = None, paths: LabPaths | None = None,
                 inventory_dir: Path | None = None, progress: Progress | None = print,
                 memory_mib: int = DEFAULT_MEMORY_MIB) -> None:
        self.hosts: list[LabHost] = lab_hosts(hosts)
        check_memory_mib(memory_mib)
        self.memory_mib = memory_mib
        self.kinds = host_kinds(self.hosts, kinds or {})
        self.paths = paths or LabPaths.default()
        if not inventory_dir:
            require_checkout("the lab's default inventory (inventories/lab; --inventory-dir DIR names another)")
        self.inventory_dir = Path(inventory_dir) if inventory_dir else DEFAULT_INVENTORY_DIR
        self._progress = progress
        self._say_lock = threading.Lock()

    # ------------------------------------------------------------------ public

    @property
    def inventory(self) -> Path:
        """The hosts.ini that ``up`` writes."""
        return self.inventory_dir / "hosts.ini"

    def up(self) -> list[LabHost]:
        """Bring the lab to exactly ``hosts`` healthy hosts; a no-op when it already is."""
        require_controller(UP_TOOLS)
        with lab_lock(announce=self._say):
            undo = _Undo()
            try:
                self._up(undo)
            except BaseException:
                if undo:
                    self._say("==> lab up failed: removing what this run made")
                    undo.run(self._say)
                raise
        return list(self.hosts)

    def down(self) -> None:
        """Remove every lab host, the bridge, the daemons and the inventory; leave nothing behind."""
        require_controller(DOWN_TOOLS)
        with lab_lock(announce=self._say):
            started = time.monotonic()
            self._teardown()
            self._say(f"==> lab is down ({time.monotonic() - started:.1f} s)")

    def status(self) -> LabStatus:
        """What runs now: hosts (from state and from running containers), daemons, bridge."""
        machines = find_machines()
        names = set(self._load_state().get("hosts", {})) | set(machines)
        hosts = [LabHost.from_name(n) for n in sorted(names, key=lambda n: LabHost.from_name(n).index)]

        def probe(host: LabHost) -> HostStatus:
            if host.name not in machines:
                return HostStatus(host.name, host.address, False, False, "-")
            proc = ssh(host, "systemctl is-system-running", check=False, timeout=15, connect_timeout=3,
                       paths=self.paths)
            reached = proc.returncode != 255  # 255: ssh itself failed
            state = (proc.stdout.strip() or "-") if reached else "-"
            shaped = qdisc_rate(host.veth) if link_exists(host.veth) else None
            return HostStatus(host.name, host.address, True, reached, state, shaped,
                              host_limit_mib(machines[host.name][0].leader))

        with ThreadPoolExecutor(max_workers=max(len(hosts), 1)) as pool:
            host_status = list(pool.map(probe, hosts))
        bridge, addresses = bridge_state()
        # Without the bridge, 10.77.0.1 is not this machine: do not send it anything.
        daemons = [daemon_status(spec, probe=bridge) for spec in (proxy_spec(), mirror_spec(self.paths))]
        return LabStatus(host_status, daemons, bridge, addresses)

    def ssh(self, host: str | LabHost, command: str | Sequence[str], *, check: bool = True, timeout: float = 300,
            connect_timeout: int = 5) -> subprocess.CompletedProcess[str]:
        """:func:`ssh` with this lab's paths."""
        return ssh(host, command, check=check, timeout=timeout, connect_timeout=connect_timeout, paths=self.paths)

    def shape(self, host: str | LabHost, rate: str | None) -> None:
        """Limit ``host``'s link to ``rate`` (``30mbit``) in both directions, or clear it (None).

        Traffic towards the host is shaped on the controller's ``vb-<host>``, traffic
        from it on the host's own ``host0``, both with tbf (the kernel here has no netem).
        """
        shape(host, rate)

    def _lab_host(self, name: str) -> LabHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise LabError(f"{name} is not a host of this lab ({', '.join(h.name for h in self.hosts)})")

    def power_off(self, name: str) -> None:
        """Shut host ``name`` down as its admin would (its systemd powers off; the disk stays), for fault tests."""
        host = self._lab_host(name)
        machines = find_machines().get(host.name, [])
        if not machines:
            raise LabError(f"{name} is not running")
        self._say(f"==> powering {name} off")
        stop_machines(machines)
        remove_cgroups(name)
        remove_memory_cgroups(name)

    def power_on(self, name: str) -> None:
        """Boot host ``name`` again from the disk it had (after :meth:`power_off`) and wait until it runs."""
        host = self._lab_host(name)
        if find_machines().get(host.name):
            raise LabError(f"{name} is already running")
        hroot = self._host_root(name)
        if not hroot.is_mounted():
            raise LabError(f"{name} has no disk to boot from (its overlay is not mounted): run `llamafleet lab up`")
        self._say(f"==> powering {name} on")
        started = time.monotonic()
        limit = self._load_state().get("hosts", {}).get(name, {}).get("memory_mib", self.memory_mib)
        machine = start_machine(host, hroot.root, hroot.console_log,
                                memory_cgroup=prepare_host_cgroup(host.name, limit))
        self._wait_ready(host, machine, hroot, started + BOOT_TIMEOUT)
        self._say(f"    {name} ready in {time.monotonic() - started:.1f} s")

    # ------------------------------------------------------------------ up

    def _up(self, undo: _Undo) -> None:
        started = time.monotonic()
        paths = self.paths
        for artifact in (artifacts.LLAMA_CPP_SOURCE, artifacts.MODEL):
            artifacts.ensure_artifact(artifact, paths.root, self._say)
        mirror = detect_mirror()
        images = {name: ensure_base_image(paths.images_dir, mirror, suite=HOST_KINDS[name].suite,
                                          packages=HOST_KINDS[name].packages, progress=self._say)
                  for name in sorted(set(self.kinds.values()))}
        image_of = {h.name: images[self.kinds[h.name]] for h in self.hosts}
        public_key = ensure_ssh_key(paths)

        if ensure_bridge():
            self._say(f"==> created bridge {BRIDGE} ({GATEWAY}/24)")
            undo.push(f"bridge {BRIDGE}", partial(delete_link, BRIDGE))
        if ip_forwarding_enabled():
            self._say("    warning: this machine forwards IPv4 (net.ipv4.ip_forward=1): lab hosts could "
                      "route beyond the lab through it; set it to 0 to keep them inside")

        for artifact in (artifacts.LLAMA_CPP_SOURCE, artifacts.MODEL):
            publish(artifact.path(paths.root), artifact.subdir, mirror_dir=paths.mirror_dir)
        for spec in (proxy_spec(mirror.proxy_allow), mirror_spec(paths)):
            if ensure_daemon(spec, paths.run_dir):
                self._say(f"==> started lab {spec.name} on {spec.url}")
                undo.push(f"{spec.name} daemon", partial(stop_daemon, spec.name, spec.module, paths.run_dir))

        state = self._load_state()
        state_hosts: dict[str, dict] = state.get("hosts", {})
        orphans = kill_orphaned_containers()
        if orphans:
            self._say(f"==> killed {len(orphans)} orphaned container(s) left by an earlier run")
        machines = find_machines()
        wanted = {h.name for h in self.hosts}
        surplus = sorted((set(machines) | set(state_hosts)) - wanted)
        if surplus:
            self._say(f"==> removing hosts beyond --hosts {len(self.hosts)}: {', '.join(surplus)}")
            for name in surplus:
                self._remove_host(name)
                state_hosts.pop(name, None)

        with ThreadPoolExecutor(max_workers=len(self.hosts)) as pool:
            healthy = dict(zip(self.hosts, pool.map(
                lambda h: self._is_healthy(h, machines.get(h.name, []), state_hosts.get(h.name), image_of[h.name]),
                self.hosts)))
        to_create = [h for h in self.hosts if not healthy[h]]
        for host in to_create:
            state_hosts.pop(host.name, None)
            undo.push(f"host {host.name}", partial(self._remove_host, host.name))

        def create(host: LabHost) -> None:
            state_hosts[host.name] = dict(self._create_host(host, image_of[host.name], public_key),
                                          kind=self.kinds[host.name])

        if to_create:
            self._run_per_host(to_create, create)
        for host in (h for h in self.hosts if h not in to_create):
            keep_limit(host.name, machines[host.name][0].leader, self.memory_mib, self._say)
            state_hosts[host.name]["memory_mib"] = self.memory_mib

        state = {"version": STATE_VERSION, "images": {name: image.key for name, image in images.items()},
                 "inventory_dir": str(self.inventory_dir), "hosts": {h.name: state_hosts[h.name] for h in self.hosts}}
        self._write_known_hosts(state["hosts"])
        self._save_state(state)
        write_inventory(self.inventory_dir, self.hosts, paths.ssh_key, paths.known_hosts,
                        backends={name: HOST_KINDS[kind].backend for name, kind in self.kinds.items()})
        # every kind's current image stays (a lab of another mix reuses it); older ones go
        current = [image_key(kind.suite, kind.packages, mirror) for kind in HOST_KINDS.values()]
        for key in prune_images(paths.images_dir, keep=current):
            self._say(f"==> removed base image {key}, which nothing uses any more")
        took = time.monotonic() - started
        if to_create:
            roles = ["orchestrator"] + ["worker"] * (len(self.hosts) - 1)
            self._say(f"==> lab is up ({took:.1f} s): " + ", ".join(
                f"{h.name} {h.address} ({r}{'' if self.kinds[h.name] == DEFAULT_KIND else ', ' + self.kinds[h.name]})"
                for h, r in zip(self.hosts, roles)))
        else:
            self._say(f"==> lab already up ({len(self.hosts)} hosts, checked in {took:.1f} s)")
        self._say(f"    inventory: {self.inventory}")

    def _is_healthy(self, host: LabHost, machines: list[Machine], host_state: dict | None, image: BaseImage) -> bool:
        """Whether ``host`` is running as this lab would start it now, and answers over SSH."""
        if len(machines) != 1 or machines[0].root != str(self._host_root(host.name).root):
            return False
        if not host_state or host_state.get("image") != image.key or not self.paths.known_hosts.is_file():
            return False
        if outside_lab_cgroup(machines[0].leader):
            return False  # started before hosts had memory cgroups: recreated with one
        for _ in range(2):  # a second chance, so a busy machine does not cost a host
            if ssh(host, "true", check=False, timeout=15, connect_timeout=5, paths=self.paths).returncode == 0:
                return True
        return False

    def _create_host(self, host: LabHost, image: BaseImage, public_key: str) -> dict:
        """(Re)create ``host`` from ``image``, boot it, and wait until systemd is running."""
        self._remove_host(host.name)
        hroot = self._host_root(host.name)
        hroot.mount(image)
        keys = provision_host(hroot.root, host, self.hosts, public_key, PROXY_URL, kind=self.kinds[host.name])
        entry = {"address": host.address, "image": image.key, "host_keys": keys, "memory_mib": self.memory_mib}
        # Known before the host answers, so the readiness check already verifies its key.
        self._write_known_hosts({host.name: entry}, merge=True)
        self._say(f"==> booting {host.name} ({host.address})")
        started = time.monotonic()
        machine = start_machine(host, hroot.root, hroot.console_log,
                                memory_cgroup=prepare_host_cgroup(host.name, self.memory_mib))
        self._wait_ready(host, machine, hroot, started + BOOT_TIMEOUT)
        self._say(f"    {host.name} ready in {time.monotonic() - started:.1f} s")
        return entry

    def _wait_ready(self, host: LabHost, machine: Machine, hroot: HostRoot, deadline: float) -> None:
        """Wait for sshd, then for systemd to finish booting; insist on state ``running``."""
        def still_booting() -> None:
            if machine.pid not in {m.pid for m in find_machines().get(host.name, [])}:
                raise LabError(f"{host.name}: the container exited while booting; console:\n  "
                               + console_tail(hroot.console_log))
            if time.monotonic() > deadline:
                raise LabError(f"{host.name}: not ready within {BOOT_TIMEOUT:.0f} s; console:\n  "
                               + console_tail(hroot.console_log))

        while not port_open(host.address, 22, timeout=0.5):
            still_booting()
            time.sleep(0.2)
        while True:
            proc = ssh(host, "systemctl is-system-running --wait", check=False,
                       timeout=max(deadline - time.monotonic(), 1), paths=self.paths)
            if proc.returncode != 255:
                break
            still_booting()  # sshd accepted the connection but was not ready yet
            time.sleep(0.3)
        state = proc.stdout.strip()
        if state != "running":
            raise LabError(f"{host.name}: systemd reports {state!r}, not 'running'\n  "
                           + self._failed_units_report(host).replace("\n", "\n  "))

    def _failed_units_report(self, host: LabHost) -> str:
        """The failed units of ``host`` with the end of each one's journal, for error messages."""
        script = ("systemctl --failed --no-legend --plain | while read -r unit _; do "
                  "echo \"failed: $unit\"; journalctl -b -u \"$unit\" -n 8 --no-pager -o short-monotonic; done")
        proc = ssh(host, script, check=False, timeout=30, paths=self.paths)
        return (proc.stdout.strip() or proc.stderr.strip() or "(no failed units listed)")

    def _run_per_host(self, hosts: list[LabHost], action: Callable[[LabHost], object]) -> None:
        """Run ``action`` on every host in parallel; report every host that failed, not just the first."""
        with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
            futures = {h: pool.submit(action, h) for h in hosts}
        errors = [(h, exc) for h, f in futures.items() if (exc := f.exception()) is not None]
        if errors:
            if len(errors) == 1:
                raise errors[0][1]
            raise LabError("lab up failed on " + ", ".join(h.name for h, _ in errors) + ":\n"
                           + "\n".join(f"  {h.name}: {e}" for h, e in errors))

    # ------------------------------------------------------------------ down

    def _host_root(self, name: str) -> HostRoot:
        return HostRoot(self.paths.host_dir(name))

    def _remove_host(self, name: str) -> None:
        """Stop ``name``'s container (and any orphans of an earlier one), delete its overlay, drop its veth."""
        stop_machines(find_machines().get(name, []))
        kill_orphaned_containers([self._host_root(name).directory])
        remove_tree(self._host_root(name).directory)
        delete_link(f"vb-{name}")
        remove_cgroups(name)
        remove_memory_cgroups(name)

    def _teardown(self) -> None:
        machines = [m for ms in find_machines().values() for m in ms]
        if machines:
            self._say("==> stopping " + ", ".join(sorted({m.name for m in machines})))
            stop_machines(machines)
        orphans = kill_orphaned_containers()
        if orphans:
            self._say(f"==> killed {len(orphans)} orphaned container(s) whose nspawn had died")
        for mountpoint in sorted((m.mountpoint for m in current_mounts() if m.source == OVERLAY_SOURCE),
                                 key=lambda p: p.count("/"), reverse=True):
            unmount(mountpoint)
        if self.paths.hosts_dir.is_dir():
            for entry in self.paths.hosts_dir.iterdir():
                remove_tree(entry)
        for veth in lab_veths():
            delete_link(veth)
        remove_cgroups()
        remove_memory_cgroups()
        if link_exists(BRIDGE):
            self._say(f"==> removing bridge {BRIDGE}")
            delete_link(BRIDGE)
        for spec in (proxy_spec(), mirror_spec(self.paths)):
            if stop_daemon(spec.name, spec.module, self.paths.run_dir):
                self._say(f"==> stopped lab {spec.name}")
        state = self._load_state()
        for inventory_dir in {Path(state.get("inventory_dir") or self.inventory_dir), self.inventory_dir}:
            remove_inventory(inventory_dir)
        for path in (self.paths.known_hosts, self.paths.state_file):
            path.unlink(missing_ok=True)
        left = leftovers(self.paths)
        if left:
            raise LabError("lab down left these behind:\n  " + "\n  ".join(left))

    # ------------------------------------------------------------------ state

    def _load_state(self) -> dict:
        try:
            state = json.loads(self.paths.state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return state if state.get("version") == STATE_VERSION else {}

    def _save_state(self, state: dict) -> None:
        write_atomic(self.paths.state_file, json.dumps(state, indent=2) + "\n")

    _known_hosts_lock = threading.Lock()

    def _write_known_hosts(self, hosts: dict[str, dict], merge: bool = False) -> None:
        """Pin the SSH host keys of ``hosts`` (adding to the existing file with ``merge``)."""
        with self._known_hosts_lock:
            entries = dict(hosts)
            path = self.paths.known_hosts
            if merge and path.is_file():
                kept = [line for line in path.read_text(encoding="ascii").splitlines()
                        if line.split(" ", 1)[0] not in {e["address"] for e in hosts.values()}]
            else:
                kept = []
            names = sorted(entries, key=lambda n: LabHost.from_name(n).index)
            text = render_known_hosts({n: entries[n]["host_keys"] for n in names},
                                      [LabHost.from_name(n) for n in names])
            write_atomic(path, "".join(line + "\n" for line in kept) + text, encoding="ascii")

    def _say(self, line: str) -> None:
        if self._progress is not None:
            with self._say_lock:
                self._progress(line)


# --------------------------------------------------------------------------- module-level API


def shape(host: str | LabHost, rate: str | None) -> None:
    """Limit a running lab host's link to ``rate`` (tc syntax, ``30mbit``) both ways; None clears it."""
    require_controller(SHAPE_TOOLS)
    target = resolve_host(host)
    if rate is not None:
        parse_rate(rate)  # reject a bad rate before touching anything
    machines = find_machines().get(target.name, [])
    if not machines or machines[0].leader is None:
        raise LabError(f"{target.name} is not running; start the lab with: llamafleet lab up")
    set_tbf(target.veth, rate)
    set_tbf("host0", rate, netns_pid=machines[0].leader)


def leftovers(paths: LabPaths | None = None) -> list[str]:
    """Everything of a lab still present on this machine, described; empty when the lab is fully down."""
    paths = paths or LabPaths.default()
    left = [f"container {name} (pid {m.pid})" for name, ms in find_machines().items() for m in ms]
    left += [f"network link {v}" for v in lab_veths()]
    if link_exists(BRIDGE):
        left.append(f"bridge {BRIDGE}")
    left += [f"overlay mount {m.mountpoint}" for m in current_mounts() if m.source == OVERLAY_SOURCE]
    attached = {m.leader for ms in find_machines().values() for m in ms}
    left += [f"orphaned container (init pid {pid}, {hdir.name})"
             for pid, hdir in container_inits().items() if pid not in attached]
    for spec in (proxy_spec(), mirror_spec(paths)):
        status = daemon_status(spec, probe=False)
        if status.pid:
            left.append(f"{spec.name} daemon (pid {status.pid})")
    if paths.hosts_dir.is_dir():
        left += [f"host directory {d}" for d in sorted(paths.hosts_dir.iterdir())]
    left += [f"cgroup {d}" for root in systemd_cgroup_roots() if (d := root / CGROUP_PARENT).exists()]
    memory = memory_hierarchy()
    if memory is not None and memory.version == 1 and memory.parent.exists():
        left.append(f"memory cgroup {memory.parent}")
    return left
