"""The lab hosts' bytecode cache for zip imports (llamafleet.lab.host_bytecode), in fresh Python processes."""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from llamafleet.lab import host_bytecode
from llamafleet.lab.image import IMAGE_PACKAGES, provision_host
from llamafleet.lab.net import lab_hosts
from tests.unit.needs import needs

AS_ROOT = needs(os.geteuid() == 0, "root (the cache is written by root only)")

PAYLOAD_MODULE = "def answer():\n    return 42\n\n\ndef fails():\n    raise ValueError('from the payload')\n"

# Run in a fresh interpreter: the cache installed, the payload zip imported, and what happened reported as JSON.
PROBE = """
import json, sys, traceback
sys.path.insert(0, {module_dir!r})
import host_bytecode
installed = host_bytecode.install({cache!r})
sys.path.insert(0, {zip_path!r})
import payload_mod
try:
    payload_mod.fails()
except ValueError:
    where = traceback.extract_tb(sys.exc_info()[2])[-1].filename
print(json.dumps({{"installed": installed, "answer": payload_mod.answer(), "where": where,
                  "file": payload_mod.__file__}}))
"""


def _payload(tmp: Path, name: str, source: str = PAYLOAD_MODULE) -> Path:
    path = tmp / name
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("payload_mod.py", source)
    return path


def _probe(zip_path: Path, cache: Path) -> dict:
    code = PROBE.format(module_dir=str(Path(host_bytecode.__file__).parent), cache=str(cache), zip_path=str(zip_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file())


@AS_ROOT
def test_the_first_import_keeps_the_bytecode_and_the_next_reads_it_with_its_own_path(tmp_path):
    cache = tmp_path / "cache"
    first = _probe(_payload(tmp_path, "first.zip"), cache)
    assert first["installed"] is True and first["answer"] == 42
    kept = _entries(cache)
    assert len(kept) == 1 and kept[0].parent.name == f"{sys.implementation.cache_tag}-O0"
    stamp = kept[0].stat().st_mtime_ns

    second = _probe(_payload(tmp_path, "second.zip"), cache)
    assert second["answer"] == 42
    # read back, not written again, and the traceback names the second payload, not the first one's path
    assert _entries(cache) == kept and kept[0].stat().st_mtime_ns == stamp
    assert second["where"] == str(tmp_path / "second.zip" / "payload_mod.py")
    assert second["file"] == str(tmp_path / "second.zip" / "payload_mod.py")


@AS_ROOT
def test_a_changed_source_is_compiled_and_kept_beside_the_first(tmp_path):
    cache = tmp_path / "cache"
    _probe(_payload(tmp_path, "first.zip"), cache)
    changed = _probe(_payload(tmp_path, "changed.zip", PAYLOAD_MODULE.replace("42", "43")), cache)
    assert changed["answer"] == 43
    assert len(_entries(cache)) == 2


@AS_ROOT
def test_bytecode_in_a_directory_others_may_write_is_not_read(tmp_path):
    cache = tmp_path / "cache"
    _probe(_payload(tmp_path, "first.zip"), cache)
    (kept,) = _entries(cache)
    # bytecode of another source put where this one's belongs: read, it would answer 7
    other = compile("def answer():\n    return 7\n\n\ndef fails():\n    raise ValueError('x')\n", "x", "exec")
    kept.write_bytes(marshal.dumps(other))
    kept.parent.chmod(0o777)
    assert _probe(_payload(tmp_path, "second.zip"), cache)["answer"] == 42
    kept.parent.chmod(0o755)  # root's again: now it is trusted, and what it holds is what is run
    assert _probe(_payload(tmp_path, "third.zip"), cache)["answer"] == 7


@AS_ROOT
def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path):
    cache = tmp_path / "cache"
    directory = cache / f"{sys.implementation.cache_tag}-O0"
    directory.mkdir(parents=True, mode=0o755)
    directory.chmod(0o755)
    entry = directory / hashlib.sha256(PAYLOAD_MODULE.encode()).hexdigest()
    entry.write_bytes(b"\x00not marshal")
    assert _probe(_payload(tmp_path, "first.zip"), cache)["answer"] == 42
    assert marshal.loads(entry.read_bytes()).co_filename == str(tmp_path / "first.zip" / "payload_mod.py")


def test_the_host_files_are_this_module_and_the_pth_line_that_loads_it():
    files = host_bytecode.host_files()
    assert set(files) == {"/usr/lib/python3/dist-packages/llamafleet_lab_bytecode.py",
                          "/usr/lib/python3/dist-packages/llamafleet_lab_bytecode.pth"}
    assert files["/usr/lib/python3/dist-packages/llamafleet_lab_bytecode.py"] == Path(
        host_bytecode.__file__).read_text(encoding="utf-8")
    pth = files["/usr/lib/python3/dist-packages/llamafleet_lab_bytecode.pth"]
    assert pth.startswith("import ") and pth.count("\n") == 1  # site runs a .pth line only when it begins so
    # and the image has the python3 that reads that folder
    assert "python3" in IMAGE_PACKAGES


def test_a_provisioned_host_root_has_both_files(tmp_path):
    hosts = lab_hosts(3)
    (tmp_path / "etc" / "ssh").mkdir(parents=True)
    (tmp_path / "etc" / "apt" / "apt.conf.d").mkdir(parents=True)
    provision_host(tmp_path, hosts[1], hosts, "ssh-ed25519 AAAA test", "http://10.0.0.1:3142")
    for path, text in host_bytecode.host_files().items():
        assert (tmp_path / path.lstrip("/")).read_text(encoding="utf-8") == text
