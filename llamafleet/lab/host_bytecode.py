"""Lab hosts only: a bytecode cache for the Python that Ansible sends in its module payloads.

Every module run on a host imports Ansible's module_utils (and the module itself) from the payload's zip, and Python
cannot keep bytecode for a zip: each run compiles the same sources again, about 0.15 s of a lab host's CPU, and the
lab's hosts share this machine's two cores with the controller. ``lab up`` installs this file on each host it creates
(stdlib only, loaded by a ``.pth`` line at every Python start there) so that a source compiled once is read back as
bytecode afterwards, keyed by the source's bytes and the interpreter's bytecode tag. What runs is what the source
says either way; only the compiling is saved. Nothing of it is in the collection: users' hosts compile as before.

The cache is written only by root, into a directory only root can write; a directory that others could write is not
read (its bytecode could be anybody's).
"""

from __future__ import annotations

import os
import sys

CACHE_DIR = "/var/cache/llamafleet-lab/bytecode"
MODULE_NAME = "llamafleet_lab_bytecode"
# the .pth line that loads it at each Python start (site runs lines that begin with "import")
PTH_LINE = f"import {MODULE_NAME}; {MODULE_NAME}.install()\n"
MARK = "_llamafleet_lab_bytecode"


def _trusted(directory: str) -> bool:
    """Whether ``directory`` is root's and nobody else may write into it."""
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    return info.st_uid == 0 and not info.st_mode & 0o022 and os.path.isdir(directory)


def _store(directory: str, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` at once (a temporary file renamed), as root only; any failure leaves no file."""
    if os.geteuid() != 0:
        return
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        if not _trusted(directory):
            return
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass


def install(cache_dir: str = CACHE_DIR) -> bool:
    """Make zip imports read and keep their bytecode under ``cache_dir``; whether it is in place."""
    try:
        import _imp
        import zipimport

        original = zipimport._compile_source
        fix_filename = _imp._fix_co_filename
    except (ImportError, AttributeError):
        return False  # another Python than the ones this was written for: it compiles as before
    if getattr(original, MARK, False):
        return True
    directory = os.path.join(cache_dir, f"{sys.implementation.cache_tag}-O{sys.flags.optimize}")

    def compile_source(pathname, source):
        import hashlib
        import marshal

        path = os.path.join(directory, hashlib.sha256(source).hexdigest())
        if _trusted(directory):
            try:
                with open(path, "rb") as handle:
                    code = marshal.loads(handle.read())
            except (OSError, EOFError, ValueError, TypeError):
                pass
            else:
                fix_filename(code, pathname)  # this payload's path in tracebacks, not the one it was first read from
                return code
        code = original(pathname, source)
        _store(directory, path, marshal.dumps(code))
        return code

    setattr(compile_source, MARK, True)
    zipimport._compile_source = compile_source
    return True


def host_files(python_dir: str = "/usr/lib/python3/dist-packages") -> dict[str, str]:
    """``{path on the host: text}``: this module and the ``.pth`` line that loads it (Debian's python3 reads both)."""
    with open(__file__, encoding="utf-8") as handle:
        source = handle.read()
    return {f"{python_dir}/{MODULE_NAME}.py": source, f"{python_dir}/{MODULE_NAME}.pth": PTH_LINE}
