"""The Ansible inventory ``lab up`` writes for its hosts.

Two files under the inventory directory (default ``inventories/lab`` in the
repository, both gitignored):

* ``hosts.ini``: groups ``llamafleet_orchestrator`` (lab1), ``llamafleet_workers``
  (lab2..labN), ``llamafleet`` (both), with SSH settings that pin the hosts' keys.
* ``group_vars/all/lab.yml``: the variables that make the roles use the lab's
  mirror, rendered from :func:`lab_group_vars`.

Rendering is pure (text from values) so it is unit-tested without a lab.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..core import constants
from .artifacts import LLAMA_CPP_ARCHIVE_SUBDIR, LLAMA_CPP_COMMIT, LLAMA_CPP_SOURCE, MODEL, MODEL_NAME
from .mirror import MIRROR_URL, mirror_url
from .net import LabHost
from .proxy import PROXY_URL
from .system import write_atomic

HEADER = "Written by `llamafleet lab up`; rewritten on every run, removed by `llamafleet lab down`."


def lab_group_vars(mirror_base: str = MIRROR_URL, proxy_url: str = PROXY_URL) -> dict[str, Any]:
    """The inventory variables (group ``all``) that point the roles at the lab's own sources.

    This is the one place the lab's role variables are decided; role authors extend it.
    """
    return {
        "llamafleet_lab": True,
        "llamafleet_lab_mirror_url": mirror_base,
        "llamafleet_lab_proxy_url": proxy_url,
        "llamacpp_build_source_type": "archive",
        "llamacpp_build_archive_url": mirror_url(LLAMA_CPP_SOURCE.subdir, LLAMA_CPP_SOURCE.name, mirror_base),
        "llamacpp_build_archive_sha256": LLAMA_CPP_SOURCE.sha256,
        "llamacpp_build_archive_subdir": LLAMA_CPP_ARCHIVE_SUBDIR,
        "llamacpp_build_version": LLAMA_CPP_COMMIT,
        "model_name": MODEL_NAME,
        "model_files": [
            {"url": mirror_url(MODEL.subdir, MODEL.name, mirror_base), "sha256": MODEL.sha256},
        ],
        # Lab hosts share this machine's cores and RAM: one thread per worker,
        # and a memory cap per worker as an operator would set on a shared host.
        "rpc_server_threads": 1,
        "rpc_server_device_overrides": [{"match": "cpu", "max_mib": 4096}],
        "llama_server_ctx_size": 2048,
        # -lv 5 logs the device of every layer: the demo and the tests compare it with the plan.
        "llama_server_log_verbosity": 5,
        # The lab's hosts inherit this machine's hard limit on open files, which caps HAProxy's connections
        # (roles/edge: 2 descriptors a connection and 1024 more, checked by its preflight).
        "edge_maxconn": lab_edge_maxconn(resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
    }


# The edge role's default edge_maxconn, which a lab host keeps when its limit on open files allows it.
EDGE_MAXCONN_DEFAULT = 20000


def lab_edge_maxconn(nofile_hard: int) -> int:
    """The edge's connection cap on lab hosts whose services can have ``nofile_hard`` descriptors at most
    (resource.RLIM_INFINITY: no limit)."""
    if nofile_hard == resource.RLIM_INFINITY:
        return EDGE_MAXCONN_DEFAULT
    return max(1, min(EDGE_MAXCONN_DEFAULT, (nofile_hard - 1024) // 2))


def backend_group_vars(backend: str) -> dict[str, Any]:
    """The variables of the group ``llamafleet_backend_<backend>`` (the lab's hosts of that backend)."""
    values: dict[str, Any] = {"llamacpp_build_backend": backend}
    if backend == "vulkan":
        # lavapipe is a CPU-type Vulkan device, which llama.cpp's Vulkan backend skips unless it is named
        # (a GPU would not need this); and a memory cap as the CPU workers have.
        for role in ("rpc_server", "llama_server"):
            values[f"{role}_environment"] = {"GGML_VK_VISIBLE_DEVICES": "0"}
            values[f"{role}_device_overrides"] = [{"match": "vulkan", "max_mib": 4096}]
    return values


# The backends a lab host can have besides cpu (image.HOST_KINDS), each with its group_vars file.
LAB_BACKENDS = ("vulkan",)


def render_group_vars(values: Mapping[str, Any]) -> str:
    """YAML for a group_vars file, with the lab's header comment."""
    body = yaml.safe_dump(dict(values), sort_keys=False, default_flow_style=False, width=1000)
    return f"---\n# {HEADER}\n{body}"


def render_hosts_ini(hosts: Sequence[LabHost], ssh_key: Path, known_hosts: Path,
                     backends: Mapping[str, str] | None = None) -> str:
    """The INI inventory of ``hosts``: the first is the orchestrator, the rest are workers. A host whose backend
    (``backends``: name -> backend) is not ``cpu`` is in the group ``llamafleet_backend_<backend>``."""
    if not hosts:
        raise ValueError("an inventory needs at least one host")

    def _backend(host: LabHost) -> str:
        return (backends or {}).get(host.name, "cpu")

    def line(host: LabHost) -> str:
        return f"{host.name} ansible_host={host.address} llamafleet_cluster_address={host.address}"

    for path in (ssh_key, known_hosts):
        if any(c.isspace() or c in "'\"\\" for c in str(path)):
            raise ValueError(f"{path}: lab paths must not contain spaces or quotes (set LLAMAFLEET_CACHE elsewhere)")
    ssh_args = " ".join([
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "IdentitiesOnly=yes",
    ])
    sections = [
        f"# {HEADER}",
        f"[{constants.GROUP_ORCHESTRATOR}]\n{line(hosts[0])}",
        f"[{constants.GROUP_WORKERS}]\n" + "".join(line(h) + "\n" for h in hosts[1:]).rstrip("\n"),
        *(f"[{constants.GROUP_BACKEND_PREFIX}{backend}]\n" + "\n".join(h.name for h in hosts if _backend(h) == backend)
          for backend in sorted({_backend(h) for h in hosts} - {"cpu"})),
        f"[{constants.GROUP_FLEET}:children]\n{constants.GROUP_ORCHESTRATOR}\n{constants.GROUP_WORKERS}",
        "\n".join([
            f"[{constants.GROUP_FLEET}:vars]",
            "ansible_user=root",
            f"ansible_ssh_private_key_file={ssh_key}",
            f"ansible_ssh_common_args='{ssh_args}'",
            "ansible_python_interpreter=/usr/bin/python3",
        ]),
    ]
    return "\n\n".join(s.rstrip("\n") for s in sections) + "\n"


def render_known_hosts(host_keys: Mapping[str, Mapping[str, str]], hosts: Sequence[LabHost]) -> str:
    """known_hosts lines pinning each host's SSH keys to its lab address.

    ``host_keys`` maps a host name to ``{key type: base64 key}``.
    """
    lines = []
    for host in hosts:
        for key_type, blob in sorted(host_keys[host.name].items()):
            lines.append(f"{host.address} {key_type} {blob}")
    return "\n".join(lines) + "\n"


def backend_vars_file(inventory_dir: Path, backend: str) -> Path:
    """The group_vars file of the lab's ``backend`` hosts."""
    return inventory_dir / "group_vars" / f"{constants.GROUP_BACKEND_PREFIX}{backend}" / "lab.yml"


def inventory_files(inventory_dir: Path) -> tuple[Path, ...]:
    """The files the lab may write in ``inventory_dir``: hosts.ini, group_vars/all/lab.yml and each backend
    group's group_vars file."""
    return (inventory_dir / "hosts.ini", inventory_dir / "group_vars" / "all" / "lab.yml",
            *(backend_vars_file(inventory_dir, backend) for backend in LAB_BACKENDS))


def write_inventory(inventory_dir: Path, hosts: Sequence[LabHost], ssh_key: Path, known_hosts: Path,
                    backends: Mapping[str, str] | None = None) -> Path:
    """Write hosts.ini, group_vars/all/lab.yml and the group_vars of the backends some host has (removing those
    of backends no host has now); return the hosts.ini path."""
    hosts_ini, group_vars = inventory_files(inventory_dir)[:2]
    write_atomic(hosts_ini, render_hosts_ini(hosts, ssh_key, known_hosts, backends))
    write_atomic(group_vars, render_group_vars(lab_group_vars()))
    used = set((backends or {}).values())
    for backend in LAB_BACKENDS:
        path = backend_vars_file(inventory_dir, backend)
        if backend in used:
            write_atomic(path, render_group_vars(backend_group_vars(backend)))
        else:
            _remove_lab_file(path)
    return hosts_ini


def _remove_lab_file(path: Path) -> bool:
    """Remove ``path`` if it carries the lab's header (and its directory, left empty); True when removed."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    if HEADER not in text:
        return False
    path.unlink()
    if path.parent.name.startswith(constants.GROUP_BACKEND_PREFIX) and not any(path.parent.iterdir()):
        path.parent.rmdir()
    return True


def remove_inventory(inventory_dir: Path) -> list[Path]:
    """Remove the files :func:`write_inventory` wrote (only if they carry the lab's header)."""
    removed = [path for path in inventory_files(inventory_dir) if _remove_lab_file(path)]
    # deploy.yml's record of the lab's last deploy (playbooks/_fleet_changes.yml): the hosts it lists are gone
    record = inventory_dir / ".llamafleet" / "deployment.json"
    if record.exists():
        record.unlink()
        removed.append(record)
        if not any(record.parent.iterdir()):
            record.parent.rmdir()
    return removed
