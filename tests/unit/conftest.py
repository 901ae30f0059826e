"""Unit-test plumbing: a tiny GGUF writer for test files, a C helper, a loopback file server.

The import paths are configuration, not code: pyproject.toml's ``pythonpath`` puts the
repository root (the ``llamafleet`` package, whose ``core`` is plugins/module_utils) and
collections/ (the checkout linked as ``ansible_collections.llamafleet.cluster``, the name
Ansible gives modules and filters) on sys.path.  pytest's rootdir-relative import puts
tests/unit there too, for the helpers beside this file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from tests.unit.gguf_testfile import write_gguf
from tests.unit.needs import require

REPO = Path(__file__).resolve().parents[2]


def drives_ansible_playbook(path: Path) -> bool:
    """A module that runs roles or action plugins through ansible-playbook: the long ones (tens of seconds each)."""
    return path.parent.name == "roles" or path.name.endswith("_playbook.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On pytest-xdist's workers (make check), the modules that drive ansible-playbook first, each module's tests
    still together and in order: started last, one of them would keep a worker running long after the other ends."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not drives_ansible_playbook(item.path))


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
    require(compiler, "a C compiler (cc or gcc) to build llamafleet-fnv1a64")
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
