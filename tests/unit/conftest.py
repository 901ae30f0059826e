"""Unit-test plumbing: the collection import path, and a tiny GGUF writer for test files.

Modules and module_utils import each other as
``ansible_collections.llamafleet.cluster.plugins...``; the checkout links itself
at collections/ansible_collections/llamafleet/cluster (committed), and this conftest
puts collections/ on sys.path.

The library's tests live in tests/unit/llamafleet/, mirroring the package; pytest puts
tests/unit on sys.path, where that directory would pass for a namespace package
``llamafleet``.  The repository root goes on sys.path too, so that ``import llamafleet``
finds the real (regular) package, which wins over namespace directories wherever they are.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
COLLECTIONS = REPO / "collections"
for _entry in (str(COLLECTIONS), str(Path(__file__).resolve().parent)):
    if _entry not in sys.path:
        sys.path.insert(0, _entry)
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # last: only the llamafleet package is wanted from there


from gguf_testfile import write_gguf  # noqa: E402  (tests/unit is on sys.path, see above)


@pytest.fixture
def make_gguf(tmp_path: Path) -> Callable[..., Path]:
    """Factory: make_gguf(name, metadata, tensors, **options) writes tmp_path/name."""

    def make(name: str, metadata: dict[str, Any], tensors: Sequence[Any] = (), **options: Any) -> Path:
        return write_gguf(tmp_path / name, metadata, tensors, **options)

    return make


@pytest.fixture(scope="session")
def fnv_helper(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The llamafleet-fnv1a64 helper compiled from the role's source (skips without a C compiler)."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build llamafleet-fnv1a64")
    out = tmp_path_factory.mktemp("fnv") / "llamafleet-fnv1a64"
    source = REPO / "roles" / "llamacpp_build" / "files" / "llamafleet-fnv1a64.c"
    subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-pthread", "-o", str(out), str(source)], check=True)
    return str(out)


@pytest.fixture
def serve_dir() -> Iterator[Callable[..., str]]:
    """Factory: serve_dir(root, ranges=True) serves ``root`` on loopback until the test ends; returns the base URL.

    With ranges, the lab mirror (byte ranges, 206); without, http.server, which ignores Range and answers 200.
    """
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    from llamafleet.lab.mirror import MirrorServer

    servers = []

    def serve(root: Path, ranges: bool = True) -> str:
        if ranges:
            srv = MirrorServer(("127.0.0.1", 0), root)
        else:
            srv = ThreadingHTTPServer(("127.0.0.1", 0),
                                      functools.partial(SimpleHTTPRequestHandler, directory=str(root)))
        srv.handle_error = lambda *args: None  # a client that closes early is no error here
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield serve
    for srv in servers:
        srv.shutdown()
        srv.server_close()
