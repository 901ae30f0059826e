"""What ``ansible-galaxy collection build`` puts in the tarball: collection content only (galaxy.yml's build_ignore)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GALAXY = Path(sys.executable).parent / "ansible-galaxy"


@pytest.fixture(scope="module")
def members(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("build")
    done = subprocess.run([str(GALAXY), "collection", "build", "--output-path", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (tarball,) = out.glob("*.tar.gz")
    with tarfile.open(tarball) as tar:
        return tar.getnames()


def test_no_dotfile_wheel_or_checkout_tooling_ships(members) -> None:
    assert not [m for m in members if re.search(r"(^|/)\.", m)], "dotfiles in the tarball"
    assert not [m for m in members if m.endswith((".whl", ".pyc")) or ".egg-info" in m]
    tops = {m.split("/")[0] for m in members}
    assert tops == {"CHANGELOG.md", "FILES.json", "LICENSE", "MANIFEST.json", "README.md", "changelogs", "meta",
                    "playbooks", "plugins", "roles", "tests"}, tops
    assert not [m for m in members if m.startswith("tests/") and not m.startswith("tests/sanity")
                and m != "tests"], "only the sanity files of tests/ are collection content"


def test_the_collection_content_ships(members) -> None:
    for path in ("roles/llama_server/tasks/main.yml", "plugins/modules/rpc_plan.py", "playbooks/deploy.yml",
                 "meta/runtime.yml", "changelogs/changelog.yaml"):
        assert path in members, path


def test_the_readmes_images_work_where_the_tarball_is_read(members) -> None:
    """Galaxy shows the README from the tarball: an image is a full URL or a file the tarball holds."""
    for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", (REPO / "README.md").read_text(encoding="utf-8")):
        assert target.startswith("https://") or target in members, target


def test_the_pyproject_declares_its_urls_and_no_missing_package_data() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    urls = project["project"]["urls"]
    galaxy = yaml.safe_load((REPO / "galaxy.yml").read_text(encoding="utf-8"))
    assert urls["Repository"] == galaxy["repository"] and urls["Issues"] == galaxy["issues"]
    for package, patterns in project["tool"]["setuptools"].get("package-data", {}).items():
        folder = REPO / package.replace(".", "/")
        assert all(list(folder.glob(p)) for p in patterns), (package, patterns)
