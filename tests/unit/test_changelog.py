"""The changelog comes from antsibull-changelog: fragments that lint, a changelog.yaml that lints, a
CHANGELOG.md that is what ``antsibull-changelog generate`` writes, and a galaxy.yml version that agrees.

The linter's failures are shown on broken copies in a temporary folder, never in the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CHANGELOGS = REPO / "changelogs"
TOOL = Path(sys.executable).parent / "antsibull-changelog"  # pinned in requirements/lock.txt


def antsibull(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run antsibull-changelog in ``cwd`` (a collection root: galaxy.yml and changelogs/)."""
    assert TOOL.exists(), "antsibull-changelog is not installed beside %s (requirements/lock.txt)" % sys.executable
    return subprocess.run([str(TOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def collection_copy(root: Path) -> Path:
    """galaxy.yml, CHANGELOG.md and changelogs/ of the checkout, copied under ``root``."""
    shutil.copytree(CHANGELOGS, root / "changelogs")
    for name in ("galaxy.yml", "CHANGELOG.md"):
        shutil.copy(REPO / name, root / name)
    return root


def galaxy_version() -> Version:
    return Version(yaml.safe_load((REPO / "galaxy.yml").read_text())["version"])


def test_fragments_lint() -> None:
    done = antsibull("lint", cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr


def test_changelog_yaml_lints() -> None:
    done = antsibull("lint-changelog-yaml", str(CHANGELOGS / "changelog.yaml"), cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr


BROKEN_FRAGMENTS = [
    # (fragment text, what the linter says)
    ("minor_changes: one change, not a list\n", 'section "minor_changes" must be type list not str'),
    ("new_things:\n  - a section the config does not have\n", "invalid section: new_things"),
    ('bugfixes:\n  - "``an inline literal never closed"\n', "Inline literal start-string without end-string"),
    ("minor_changes:\n  - 42\n", "list items must be type str not int"),
]


@pytest.mark.parametrize("text, message", BROKEN_FRAGMENTS)
def test_a_broken_fragment_fails_the_lint(text: str, message: str, tmp_path: Path) -> None:
    root = collection_copy(tmp_path)  # a copy of what test_fragments_lint passes, plus one broken fragment
    (root / "changelogs" / "fragments" / "zz-broken.yml").write_text("---\n" + text)
    done = antsibull("lint", cwd=root)
    assert done.returncode != 0
    assert "changelogs/fragments/zz-broken.yml" in done.stdout and message in done.stdout, done.stdout


def test_a_broken_changelog_yaml_fails_its_lint(tmp_path: Path) -> None:
    changelog = yaml.safe_load((CHANGELOGS / "changelog.yaml").read_text())
    release = changelog["releases"][max(changelog["releases"], key=Version)]
    del release["release_date"]
    broken = tmp_path / "changelog.yaml"
    broken.write_text(yaml.safe_dump(changelog))
    done = antsibull("lint-changelog-yaml", str(broken), cwd=tmp_path)
    assert done.returncode != 0 and "release_date" in done.stdout, done.stdout


def test_changelog_md_is_generated(tmp_path: Path) -> None:
    root = collection_copy(tmp_path)
    (root / "CHANGELOG.md").unlink()
    done = antsibull("generate", cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "CHANGELOG.md").read_text() == (REPO / "CHANGELOG.md").read_text(), (
        "CHANGELOG.md differs from what `antsibull-changelog generate` writes: edit changelogs/, then run it")


def test_galaxy_version_follows_the_releases() -> None:
    """With fragments waiting, galaxy.yml names the next release (newer than every one released);
    without any, the latest release."""
    released = sorted(Version(v) for v in yaml.safe_load((CHANGELOGS / "changelog.yaml").read_text())["releases"])
    waiting = [p for p in (CHANGELOGS / "fragments").iterdir() if p.suffix in (".yml", ".yaml")]
    if waiting:
        assert galaxy_version() > released[-1], (galaxy_version(), released[-1])
    else:
        assert galaxy_version() == released[-1]
