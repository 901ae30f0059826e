"""The three ways users install llamafleet, each from scratch in a clean folder, against the deployed lab.

- the collection tarball, installed by ``ansible-galaxy collection install``, runs
  ``ansible-playbook llamafleet.cluster.deploy`` (and resolves ``llamafleet.cluster.bench``);
- a fresh clone, with no ``make`` and no ANSIBLE_CONFIG, runs ``ansible-playbook playbooks/deploy.yml``;
- the library's wheel, pip-installed into a new virtual environment, gives a ``llamafleet`` whose ``status``
  reads the lab, with ansible-core among its declared requirements and nothing resolved into a checkout.

The lab is deployed already (the ``deployed`` fixture): each deploy here must find nothing to change,
which also proves the route runs the very same collection.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tests.e2e.quiet import quiet
from tests.helpers import EVERY_TASK, INVENTORY, REPO, env, parse_recap

BIN = Path(sys.executable).parent
LAB_CACHE = Path(os.environ.get("LLAMAFLEET_CACHE", "/var/cache/llamafleet"))

# What the collection tarball must not carry: tests that need the lab, molecule, the library and its lab, raw
# fixtures, the checkout's own link to itself, lab inventories, benchmark results.
NOT_IN_TARBALL = re.compile(r"^(tests/(e2e|integration|unit)/|extensions/|llamafleet/|collections/|inventories/lab/"
                            r"|benchmarks/|bench-results/|Makefile$|pyproject\.toml$|requirements/|\.ci/)")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user with only a virtual environment active: no ANSIBLE_CONFIG, no make's exports but
    the controller's cache (the same user's: the models it fetched before are there, as the deploys' own)."""
    e = {k: v for k, v in env().items()
         if k == "LLAMAFLEET_CACHE" or not k.startswith(("ANSIBLE_CONFIG", "ANSIBLE_COLLECTIONS", "LLAMAFLEET_"))}
    e.update(extra)
    return e


def run(cmd: list[str], cwd: Path, timeout: float = 1800, **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(**extra), capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_nothing_changed(proc: subprocess.CompletedProcess) -> None:
    recap = parse_recap(proc.stdout)
    assert recap and all(h.get("failed", 0) == 0 and h.get("unreachable", 0) == 0 for h in recap.values()), recap
    assert sum(h.get("changed", 0) for h in recap.values()) == 0, (recap, proc.stdout[-6000:])


@quiet("route-tarball")
def _tarball_route(tmp_path: Path) -> None:
    started = time.monotonic()
    run([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(tmp_path), str(REPO)], REPO)
    (tarball,) = tmp_path.glob("llamafleet-cluster-*.tar.gz")
    with tarfile.open(tarball) as tar:
        names = [m.name for m in tar.getmembers()]
    assert {"MANIFEST.json", "playbooks/deploy.yml", "playbooks/bench.yml", "meta/runtime.yml",
            "plugins/module_utils/split_plan.py", "roles/rpc_server/tasks/main.yml"} <= set(names)
    stray = [n for n in names if NOT_IN_TARBALL.match(n)]
    assert not stray, f"the tarball carries what is not collection content: {stray[:20]}"

    user = tmp_path / "user"  # a folder of the user's: no ansible.cfg, no checkout
    user.mkdir()
    collections = tmp_path / "collections"
    # as the user would: the folder it installs into is the one Ansible will search
    run([str(BIN / "ansible-galaxy"), "collection", "install", "-p", str(collections), str(tarball)], user,
        ANSIBLE_COLLECTIONS_PATH=str(collections))
    installed = collections / "ansible_collections" / "llamafleet" / "cluster"
    assert (installed / "playbooks" / "deploy.yml").is_file() and not (installed / "tests" / "e2e").exists()

    paths = {"ANSIBLE_COLLECTIONS_PATH": str(collections)}
    listed = run([str(BIN / "ansible-playbook"), "-i", str(INVENTORY), "llamafleet.cluster.bench", "--list-tasks"],
                 user, **paths)
    # the bench playbook (and the plays it imports) came from the installed collection
    assert f"playbook: {installed}/playbooks/bench.yml" in listed.stdout, listed.stdout[:3000]
    assert "llamafleet.cluster.bench : " in listed.stdout, listed.stdout[-3000:]
    # every task, so the installed roles run whatever the stamps say (EVERY_TASK)
    deploy = run([str(BIN / "ansible-playbook"), "-i", str(INVENTORY), "llamafleet.cluster.deploy", *EVERY_TASK], user,
                 **paths)
    assert_nothing_changed(deploy)
    # the modules ran from the installed collection, not from this checkout
    where = run([str(BIN / "ansible-doc"), "-t", "module", "llamafleet.cluster.rpc_plan"], user, **paths)
    assert str(installed) in where.stdout
    print(f"tarball route: build, install and an idempotent deploy in {time.monotonic() - started:.0f} s")
    return deploy


@quiet("route-clone")
def _clone_route(tmp_path: Path) -> None:
    checkout = tmp_path / "llamafleet"
    run(["git", "clone", "--quiet", str(REPO), str(checkout)], tmp_path)
    assert not (checkout / ".build").exists()
    started = time.monotonic()
    deploy = run([str(BIN / "ansible-playbook"), "playbooks/deploy.yml", "-i", str(INVENTORY), *EVERY_TASK], checkout)
    assert_nothing_changed(deploy)
    print(f"fresh clone route: idempotent deploy in {time.monotonic() - started:.0f} s")
    return deploy


def _setuptools_floor() -> str:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'requires\s*=\s*\["setuptools>=([0-9.]+)"\]', text)
    assert match, "pyproject.toml's build-system names no setuptools floor"
    return match.group(1)


@quiet("route-wheel")
def _wheel_route(tmp_path: Path) -> None:
    # The wheel is built with exactly the setuptools floor pyproject.toml declares (no build isolation), so a
    # floor below what the build needs fails here.
    floor = _setuptools_floor()
    builder = LAB_CACHE / f"setuptools-{floor}-builder"
    if not (builder / "bin" / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", str(builder)], check=True)
        run([str(builder / "bin" / "pip"), "install", "-q", f"setuptools=={floor}", "wheel"], tmp_path, timeout=600)
    # build from a clean copy of the tracked files (an egg-info or build/ of the checkout must not help)
    source = tmp_path / "source"
    run(["git", "clone", "--quiet", str(REPO), str(source)], tmp_path)
    run([str(builder / "bin" / "pip"), "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(source)], tmp_path, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("llamafleet-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    started = time.monotonic()
    run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], tmp_path, timeout=900)
    print(f"wheel route: pip install (with ansible-core from PyPI) in {time.monotonic() - started:.0f} s")
    requires = run([str(venv / "bin" / "pip"), "show", "llamafleet"], tmp_path).stdout
    assert re.search(r"^Requires:.*\bansible-core\b", requires, re.M), requires

    user = tmp_path / "user"
    user.mkdir()
    cli = str(venv / "bin" / "llamafleet")
    started = time.monotonic()
    proc = run([cli, "status", "--json", "-i", str(INVENTORY)], user)
    status_seconds = time.monotonic() - started
    rows = {row["host"]: row for row in json.loads(proc.stdout)}
    assert set(rows) == {"lab1", "lab2", "lab3"}
    assert all(row["state"] == "active" for row in rows.values()), rows
    print(f"wheel route: llamafleet status on 3 hosts in {status_seconds:.2f} s")

    # ANSIBLE_INVENTORY stands in for -i, as for ansible-playbook
    proc = run([cli, "status", "--json"], user, ANSIBLE_INVENTORY=str(INVENTORY))
    assert {row["host"] for row in json.loads(proc.stdout)} == set(rows)
    # nothing of the installed package points into a checkout
    site = next((venv / "lib").glob("python3*/site-packages"))
    installed = {p.relative_to(site).parts[0] for p in site.iterdir()}
    assert "inventories" not in installed and "playbooks" not in installed
    demo = subprocess.run([cli, "demo"], cwd=user, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert demo.returncode == 2 and "needs a checkout of llamafleet" in demo.stderr, demo.stderr
    no_inventory = subprocess.run([cli, "status"], cwd=user, env=clean_env(), capture_output=True, text=True,
                                  timeout=60)
    assert no_inventory.returncode == 2 and "inventory not found" in no_inventory.stderr, no_inventory.stderr
    return rows


# Each route runs in the quiet batch (tests/e2e/quiet.py: no unit restarted, no unit file changed), its checks inside;
# a failed check is raised again by the test that reads the route's outcome.


def test_the_collection_tarball_installed_by_galaxy_deploys_the_lab(quiet_runs):
    assert_nothing_changed(quiet_runs["route-tarball"])


def test_a_fresh_clone_runs_the_deploy_playbook_without_make(quiet_runs):
    assert_nothing_changed(quiet_runs["route-clone"])


def test_the_wheel_gives_a_working_cli_outside_the_checkout(quiet_runs):
    rows = quiet_runs["route-wheel"]
    assert set(rows) == {"lab1", "lab2", "lab3"} and all(row["state"] == "active" for row in rows.values()), rows
