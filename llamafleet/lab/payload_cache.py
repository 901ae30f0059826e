# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A bytecode cache for Ansible's module payloads on the lab's hosts, for the tests' time only.

Every module run on a host imports Ansible's module_utils from the run's own AnsiballZ zip, and Python compiles
what it imports from a zip every time: about 0.2 s of the host's CPU a module run, most of a deploy's host CPU on the
lab (2 cores shared by three hosts and the controller). On a lab host, Ansible's Python is :data:`INTERPRETER`, a
wrapper that runs ``/usr/bin/python3`` with this file as its ``sitecustomize``: code compiled from a file inside a
``*_payload.zip`` is kept in :data:`CACHE_DIR`, keyed by the Python, the file's path in the zip and its source, and
loaded from there the next time the same source comes. Nothing else changes: the same interpreter runs the same
modules on the same host. A fleet's own hosts never get it (their deploy figures, issue 26's, are measured as
users meet them: ``benchmarks/deploy_speed.py`` passes ``ansible_python_interpreter=/usr/bin/python3``).

This file runs on the hosts as it is (stdlib only); :func:`host_files` gives the files ``lab up`` writes.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
import types
import zipimport

INTERPRETER = "/usr/local/libexec/llamafleet-lab/python3"
SITE_DIR = "/usr/local/lib/llamafleet-lab"
CACHE_DIR = "/var/cache/llamafleet-lab-pyc"
CACHE_DIR_ENV = "LLAMAFLEET_LAB_PYC_DIR"  # another folder (the unit tests')
PAYLOAD = "_payload.zip"


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the code objects in it with ``filename`` (this run's zip, as tracebacks should name it)."""
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def install(folder: str | None = None) -> bool:
    """Route zipimport's compiling of payload files through the cache in ``folder``; False where this Python's
    zipimport has no ``_compile_source`` to wrap (then nothing changes)."""
    compile_source = getattr(zipimport, "_compile_source", None)
    if compile_source is None or getattr(compile_source, "llamafleet_lab", False):
        return False
    tag = (sys.implementation.cache_tag or sys.version).encode()
    folder = folder or os.environ.get(CACHE_DIR_ENV) or CACHE_DIR

    def cached(pathname: str, source: bytes) -> types.CodeType:
        if PAYLOAD not in pathname:
            return compile_source(pathname, source)
        inner = pathname.split(PAYLOAD, 1)[1].encode()
        path = os.path.join(folder, hashlib.sha256(tag + b"\0" + inner + b"\0" + source).hexdigest())
        try:
            with open(path, "rb") as handle:
                return _renamed(marshal.loads(handle.read()), pathname)
        except (OSError, ValueError, EOFError, TypeError):
            pass
        code = compile_source(pathname, source)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            tmp = "%s.%d.tmp" % (path, os.getpid())
            with open(tmp, "wb") as handle:
                handle.write(marshal.dumps(code))
            os.replace(tmp, path)
        except OSError:
            pass
        return code

    cached.llamafleet_lab = True  # type: ignore[attr-defined]
    zipimport._compile_source = cached  # type: ignore[attr-defined]
    return True


def run_system_sitecustomize() -> None:
    """Run the ``sitecustomize`` the host's Python would have run without :data:`SITE_DIR` first (Debian's)."""
    import importlib.machinery
    import importlib.util

    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if p != SITE_DIR])
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception:  # noqa: BLE001  as Python's site does with a failing sitecustomize: carry on
        pass


def write_into(root: str) -> list[str]:
    """Write :func:`host_files` into the host whose root filesystem is ``root`` (a running host's too: its
    overlay as this machine mounts it); the paths written (those that were missing or differed)."""
    written = []
    for path, (content, mode) in host_files().items():
        target = os.path.join(root, path.lstrip("/"))
        try:
            with open(target, encoding="utf-8") as handle:
                if handle.read() == content and (os.stat(target).st_mode & 0o777) == mode:
                    continue
        except OSError:
            pass
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        tmp = target + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(content)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        written.append(path)
    return written


def host_files() -> dict[str, tuple[str, int]]:
    """Path on the host -> (content, mode): the interpreter wrapper and the ``sitecustomize`` that installs the cache
    (a ``sitecustomize`` the system had still runs after it)."""
    with open(__file__, encoding="utf-8") as handle:
        source = handle.read()
    site = source + "\n\ninstall()\nrun_system_sitecustomize()\n"
    wrapper = ("#!/bin/sh\n"
               "# llamafleet lab: Ansible's Python on this host, with a bytecode cache for its module payloads\n"
               "# (llamafleet/lab/payload_cache.py on the controller)\n"
               'PYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec /usr/bin/python3 "$@"\n' % SITE_DIR)
    return {SITE_DIR + "/sitecustomize.py": (site, 0o644), INTERPRETER: (wrapper, 0o755)}
