"""FNV-1a 64: published test vectors, the C helper against the Python fallback, and errors."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from llamafleet.core import fnv
from llamafleet.core.fnv import (
    HashError,
    find_helper,
    fnv1a64,
    hash_name,
    hash_ranges,
    hash_ranges_python,
)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # FNV-1a 64-bit reference vectors (Fowler/Noll/Vo test suite)
        (b"", 0xCBF29CE484222325),
        (b"a", 0xAF63DC4C8601EC8C),
        (b"foobar", 0x85944171F73967E8),
        (b"abc", 0xE71FA2190541574B),
    ],
)
def test_reference_vectors(data: bytes, expected: int) -> None:
    assert fnv1a64(data) == expected


def test_hash_can_be_continued() -> None:
    assert fnv1a64(b"bar", fnv1a64(b"foo")) == fnv1a64(b"foobar")


@pytest.mark.parametrize(("value", "name"), [(0, "0000000000000000"), (0xAF63DC4C8601EC8C, "af63dc4c8601ec8c")])
def test_hash_name(value: int, name: str) -> None:
    assert hash_name(value) == name


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(random.Random(7).randbytes(3 * 1024 * 1024 + 17))
    return path


RANGES = [(0, 0), (0, 1), (5, 6), (1000, 5 * 1024 * 1024 // 2), (3 * 1024 * 1024, 17)]


def test_python_fallback_matches_in_memory_hash(data_file: Path) -> None:
    data = data_file.read_bytes()
    names = hash_ranges_python(data_file, RANGES)
    assert names == [hash_name(fnv1a64(data[o:o + n])) for o, n in RANGES]


@pytest.mark.parametrize("jobs", [1, 2, 8])
def test_helper_matches_python(data_file: Path, fnv_helper: str, jobs: int) -> None:
    assert hash_ranges(data_file, RANGES, helper=fnv_helper, jobs=jobs) == hash_ranges_python(data_file, RANGES)


def test_helper_reads_ranges_from_stdin_and_args(data_file: Path, fnv_helper: str) -> None:
    expected = hash_ranges_python(data_file, [(5, 6), (0, 1)])
    by_args = subprocess.run([fnv_helper, str(data_file), "5:6", "0:1"], capture_output=True, text=True, check=True)
    by_stdin = subprocess.run([fnv_helper, str(data_file)], input="5:6\n 0:1 ", capture_output=True, text=True,
                              check=True)
    assert by_args.stdout.split() == by_stdin.stdout.split() == expected


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (["{file}", "0:999999999"], 1, "ends past the end of the file"),
        (["{file}", "12"], 2, "bad range '12'"),
        (["{file}", "-1:2"], 2, "bad range"),
        (["{file}", "1:99999999999999999999999"], 2, "bad range"),
        (["/nonexistent/x", "0:1"], 1, "/nonexistent/x: No such file"),
        (["-j", "0", "{file}", "0:1"], 2, "-j wants a number"),
        ([], 2, "usage"),
    ],
)
def test_helper_errors(data_file: Path, fnv_helper: str, args: list[str], rc: int, message: str) -> None:
    argv = [fnv_helper] + [a.format(file=data_file) for a in args]
    proc = subprocess.run(argv, capture_output=True, text=True, input="", check=False)
    assert proc.returncode == rc
    assert message in proc.stderr
    assert proc.stdout == ""


def test_range_outside_the_file_is_refused_before_hashing(data_file: Path) -> None:
    size = data_file.stat().st_size
    with pytest.raises(HashError, match=r"blob.bin: range %d:1 is outside the file" % size):
        hash_ranges(data_file, [(size, 1)], helper=None)


def test_explicit_helper_must_exist(data_file: Path) -> None:
    with pytest.raises(HashError, match="/nonexistent/helper does not exist"):
        hash_ranges(data_file, [(0, 1)], helper="/nonexistent/helper")


def test_failing_helper_is_reported(data_file: Path, tmp_path: Path) -> None:
    fake = tmp_path / "bad-helper"
    fake.write_text("#!/bin/sh\necho 'boom' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(HashError, match=r"failed on .*blob.bin \(exit 3\): boom"):
        hash_ranges(data_file, [(0, 1)], helper=str(fake))


def test_helper_printing_garbage_is_reported(data_file: Path, tmp_path: Path) -> None:
    fake = tmp_path / "bad-helper"
    fake.write_text("#!/bin/sh\necho nothex\n")
    fake.chmod(0o755)
    with pytest.raises(HashError, match="printed 1 hashes for 2 ranges"):
        hash_ranges(data_file, [(0, 1), (1, 1)], helper=str(fake))


def test_find_helper_order(monkeypatch: pytest.MonkeyPatch, fnv_helper: str, tmp_path: Path) -> None:
    monkeypatch.delenv(fnv.HELPER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_helper() is None
    (tmp_path / fnv.HELPER_NAME).symlink_to(fnv_helper)
    assert find_helper() == str(tmp_path / fnv.HELPER_NAME)
    monkeypatch.setenv(fnv.HELPER_ENV, fnv_helper)
    assert find_helper() == fnv_helper
    monkeypatch.setenv(fnv.HELPER_ENV, "/nonexistent/helper")
    with pytest.raises(HashError):
        find_helper()


def test_no_ranges(data_file: Path) -> None:
    assert hash_ranges(data_file, []) == []
    assert os.path.exists(data_file)
