"""The lab hosts' bytecode cache for Ansible's module payloads, with a real Python importing from real zips."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from llamafleet.lab import payload_cache

SCRIPT = """\
import sys, traceback, zipimport
sys.path.insert(0, sys.argv[1])
import pkg.mod
print(pkg.mod.VALUE)
try:
    pkg.mod.fail()
except RuntimeError:
    print(traceback.extract_tb(sys.exc_info()[2])[-1].filename)
print(getattr(zipimport._compile_source, "llamafleet_lab", False))
"""


def _zip(path: Path, value: int) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/mod.py", "VALUE = %d\n\ndef fail():\n    raise RuntimeError('x')\n" % value)
    return path


def _run(root: Path, cache: Path, payload: Path) -> list[str]:
    site = root / payload_cache.SITE_DIR.lstrip("/")
    env = dict(os.environ, PYTHONPATH=str(site), **{payload_cache.CACHE_DIR_ENV: str(cache)})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(payload)], env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return proc.stdout.split()


def test_payload_code_is_compiled_once_per_source_and_named_by_this_run(tmp_path: Path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    assert sorted(payload_cache.write_into(str(root))) == sorted(payload_cache.host_files())
    assert payload_cache.write_into(str(root)) == []  # as it should be: nothing written again
    wrapper = (root / payload_cache.INTERPRETER.lstrip("/"))
    assert os.access(wrapper, os.X_OK) and 'exec /usr/bin/python3 "$@"' in wrapper.read_text()

    first = _zip(tmp_path / "ansible_a_payload.zip", 1)
    value, where, hooked = _run(root, cache, first)
    assert (value, hooked) == ("1", "True") and where == str(first / "pkg" / "mod.py")
    kept = sorted(os.listdir(cache))
    assert len(kept) == 2  # pkg/__init__.py and pkg/mod.py

    # the next run's payload has another path: the code comes from the cache, named after this run's zip
    second = _zip(tmp_path / "ansible_b_payload.zip", 1)
    before = {name: (cache / name).stat().st_mtime_ns for name in kept}
    value, where, _ = _run(root, cache, second)
    assert value == "1" and where == str(second / "pkg" / "mod.py")
    assert {name: (cache / name).stat().st_mtime_ns for name in os.listdir(cache)} == before

    # another source is compiled anew, never served stale
    third = _zip(tmp_path / "ansible_c_payload.zip", 2)
    assert _run(root, cache, third)[0] == "2" and len(os.listdir(cache)) == 3

    # a zip that is not a module payload is left to Python alone
    other = _zip(tmp_path / "other.zip", 3)
    assert _run(root, cache, other)[0] == "3" and len(os.listdir(cache)) == 3


def test_a_broken_cache_file_is_compiled_again(tmp_path: Path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    payload_cache.write_into(str(root))
    payload = _zip(tmp_path / "ansible_a_payload.zip", 7)
    _run(root, cache, payload)
    for name in os.listdir(cache):
        (cache / name).write_bytes(b"not marshal")
    assert _run(root, cache, payload)[0] == "7"
