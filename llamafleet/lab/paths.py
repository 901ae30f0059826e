"""Where the lab keeps things: one cache root (``$LLAMAFLEET_CACHE``), laid out by purpose."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path("/var/cache/llamafleet")

# The repository (collection) root: the parent of the ``llamafleet`` package.
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_INVENTORY_DIR = REPO_ROOT / "inventories" / "lab"


def in_checkout() -> bool:
    """Whether this llamafleet runs from a checkout (the collection beside it), not from an installed wheel."""
    return (REPO_ROOT / "galaxy.yml").is_file() and (REPO_ROOT / "playbooks" / "deploy.yml").is_file()


def require_checkout(what: str) -> Path:
    """The checkout's root, or a UserError saying that ``what`` needs one (an installed wheel has no lab files)."""
    if not in_checkout():
        from ..errors import UserError

        raise UserError(f"{what} needs a checkout of llamafleet (git clone it and run it from there): this "
                        f"llamafleet is installed at {REPO_ROOT}, without the lab's playbooks and inventory")
    return REPO_ROOT


def cache_root() -> Path:
    """The cache root: ``$LLAMAFLEET_CACHE`` or /var/cache/llamafleet."""
    return Path(os.environ.get("LLAMAFLEET_CACHE") or DEFAULT_CACHE)


@dataclass(frozen=True)
class LabPaths:
    """Every path the lab reads or writes, derived from one cache root.

    Layout under the root::

        src/, models/          pinned artifacts (llama.cpp source archive, model)
        mirror/                what the mirror daemon serves (links to the artifacts)
        lab/id_ed25519         the lab's SSH key (made once)
        lab/images/KEY/        base images, one per cache key (rootfs/ + image.json)
        lab/hosts/NAME/        per-host overlay (upper/, work/, root/) and console.log
        lab/run/               pidfiles, daemon logs, known_hosts, state.json
    """

    root: Path

    @classmethod
    def default(cls) -> LabPaths:
        return cls(cache_root())

    @property
    def mirror_dir(self) -> Path:
        return self.root / "mirror"

    @property
    def lab_dir(self) -> Path:
        return self.root / "lab"

    @property
    def images_dir(self) -> Path:
        return self.lab_dir / "images"

    @property
    def hosts_dir(self) -> Path:
        return self.lab_dir / "hosts"

    @property
    def run_dir(self) -> Path:
        return self.lab_dir / "run"

    @property
    def ssh_key(self) -> Path:
        return self.lab_dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.run_dir / "known_hosts"

    @property
    def state_file(self) -> Path:
        return self.run_dir / "state.json"

    def host_dir(self, name: str) -> Path:
        return self.hosts_dir / name
