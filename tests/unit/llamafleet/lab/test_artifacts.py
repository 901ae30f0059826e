"""The lab's pinned artifacts: fetched once, verified by sha256, remembered by the collection's marker."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from llamafleet.core.checksum import marker_matches
from llamafleet.lab import artifacts, fetch
from llamafleet.lab.system import LabError

CONTENT = b"pinned bytes"
PINNED = artifacts.Artifact(name="thing.bin", subdir="src", sha256=hashlib.sha256(CONTENT).hexdigest(), origin="test")


@pytest.fixture()
def fetches(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the fetchers by one that writes CONTENT and records each call."""
    calls: list[Path] = []

    def fake(dest: Path) -> None:
        calls.append(dest)
        dest.write_bytes(CONTENT)

    monkeypatch.setitem(artifacts._FETCHERS, PINNED.name, fake)
    return calls


def test_fetched_once_then_trusted(tmp_path: Path, fetches: list[Path]) -> None:
    said: list[str] = []
    path = artifacts.ensure_artifact(PINNED, tmp_path, said.append)
    assert path == tmp_path / "src" / "thing.bin" and path.read_bytes() == CONTENT
    assert marker_matches(path, PINNED.sha256)
    assert artifacts.ensure_artifact(PINNED, tmp_path, said.append) == path
    assert len(fetches) == 1 and said == ["==> fetching thing.bin (test)"]
    assert sorted(p.name for p in path.parent.iterdir()) == [".thing.bin.verified", "thing.bin"]


def test_wrong_content_is_refused_and_removed(tmp_path: Path, fetches: list[Path]) -> None:
    wrong = artifacts.Artifact(name=PINNED.name, subdir="src", sha256="0" * 64, origin="test")
    with pytest.raises(LabError, match="thing.bin from test has sha256 .*, expected 0{64}; refusing to use it"):
        artifacts.ensure_artifact(wrong, tmp_path, lambda _msg: None)
    assert len(fetches) == 1 and list((tmp_path / "src").iterdir()) == []


@pytest.mark.parametrize(("artifact", "requirement", "subdir"), [
    (artifacts.LLAMA_CPP_SOURCE, "llama-cpp-python==0.3.36", "llama_cpp_python-0.3.36/vendor/llama.cpp"),
    (artifacts.LLAMA_CPP_OTHER_SOURCE, "llama-cpp-python==0.3.35", "llama_cpp_python-0.3.35/vendor/llama.cpp"),
])
def test_each_llama_cpp_source_is_fetched_as_its_own_sdist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          artifact, requirement, subdir) -> None:
    asked: list[list[str]] = []

    def fake_run(cmd, **_kwargs):
        asked.append(cmd)
        (Path(cmd[cmd.index("--dest") + 1]) / artifact.name).write_bytes(b"sdist")
        return artifacts.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(artifacts.subprocess, "run", fake_run)
    dest = tmp_path / "got.tar.gz"
    artifacts._FETCHERS[artifact.name](dest)
    assert dest.read_bytes() == b"sdist" and asked[0][-1] == requirement
    # the sdist of llama-cpp-python alone: its build dependencies (for the metadata) may come as wheels
    assert asked[0][asked[0].index("--no-binary") + 1] == "llama-cpp-python"
    assert artifacts.llama_cpp_archive_subdir(artifact) == subdir
    assert artifact.subdir == "src" and artifact.name == subdir.split("/")[0] + ".tar.gz"


def test_fetch_without_a_lab_puts_each_named_artifact_in_the_cache(tmp_path: Path, fetches: list[Path],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """python -m llamafleet.lab.fetch NAME...: into $LLAMAFLEET_CACHE, each path printed; a second run fetches
    nothing; an unknown name is refused (2) and a failed fetch says why (1)."""
    monkeypatch.setenv("LLAMAFLEET_CACHE", str(tmp_path))
    monkeypatch.setitem(fetch.BY_NAME, "thing", PINNED)
    assert fetch.main(["thing"]) == 0 and fetch.main(["thing"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(PINNED.path(tmp_path))] * 2
    assert len(fetches) == 1 and PINNED.path(tmp_path).read_bytes() == CONTENT
    assert fetch.main(["thing", "weights"]) == 2 and "unknown artifact weights" in capsys.readouterr().err
    monkeypatch.setitem(artifacts._FETCHERS, PINNED.name, lambda dest: dest.write_bytes(b"other"))
    PINNED.path(tmp_path).unlink()
    assert fetch.main(["thing"]) == 1 and "refusing to use it" in capsys.readouterr().err
    assert sorted(fetch.BY_NAME) == ["model", "source", "thing"]
    assert (fetch.BY_NAME["model"], fetch.BY_NAME["source"]) == (artifacts.MODEL, artifacts.LLAMA_CPP_SOURCE)
