"""Model files that preflight must refuse, published on the lab mirror for test_deploy.py.

- an HTML page (a login or error page served with 200) where a GGUF file should be;
- the lab model cut to half, pinned by the sha256 of the cut file, so only the GGUF
  header (whose tensors end past the served bytes) gives it away;
- a small GGUF whose general.architecture the planner does not know.

Each comes with its URL, its sha256 and the text preflight's error must contain.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from llamafleet.core.gguf import data_end, read_gguf
from llamafleet.lab.artifacts import MODEL
from llamafleet.lab.mirror import publish
from llamafleet.lab.paths import LabPaths

SUBDIR = "bad-models"
UNKNOWN_ARCH = "llamafleet-unknown"
HTML_PAGE = (b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head>\n"
             b"<body><form method=\"post\">user <input name=\"u\"> password <input name=\"p\"></form></body></html>\n")


@dataclass(frozen=True)
class BadModel:
    url: str
    sha256: str
    expected: tuple[str, ...]  # every string must be in deploy.yml's output

    def extra_vars(self) -> list[str]:
        """ansible-playbook arguments that deploy this file as another model (not yet on any host)."""
        files = '{"model_files": [{"url": "%s", "sha256": "%s"}]}' % (self.url, self.sha256)
        return ["-e", "model_name=other", "-e", files]


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def unknown_architecture_gguf(arch: str) -> bytes:
    """A valid little-endian GGUF v3 of one F32 tensor whose architecture is ``arch``, with llama's keys.

    Written here, independently of the reader under test: magic, version, tensor and key
    counts, the keys (string key, u32 type, value), the tensor table, padding to 32, the data.
    """
    keys = [("general.architecture", 8, _string(arch)),
            ("llama.block_count", 4, struct.pack("<I", 1)),
            ("llama.embedding_length", 4, struct.pack("<I", 8))]
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(keys))
    for key, value_type, value in keys:
        head += _string(key) + struct.pack("<I", value_type) + value
    head += _string("blk.0.attn_norm.weight") + struct.pack("<IQIQ", 1, 8, 0, 0)  # 1 dim of 8, F32, offset 0
    head += bytes(-len(head) % 32)
    return head + struct.pack("<8f", *([1.0] * 8))


def make_bad_models(work: Path | None = None) -> tuple[dict[str, BadModel], list[Path]]:
    """Write the three files, publish them on the lab mirror; ({case: BadModel}, the paths to remove afterwards)."""
    paths = LabPaths.default()
    work = work or paths.root / "e2e" / SUBDIR
    work.mkdir(parents=True, exist_ok=True)
    model = MODEL.path(paths.root)
    made: dict[str, BadModel] = {}
    written: list[Path] = []

    def put(name: str, data: bytes) -> tuple[str, str]:
        path = work / name
        path.write_bytes(data)
        written.append(path)
        url = publish(path, SUBDIR)
        written.append(paths.mirror_dir / SUBDIR / name)
        return url, hashlib.sha256(data).hexdigest()

    url, sha = put("login.html", HTML_PAGE)
    made["html-page"] = BadModel(url, sha, (
        "the controller: model_files[0].url %s: not a GGUF file (text/html, starts with '<!DOCTYPE html>')" % url,))

    full = model.read_bytes()
    half = full[:len(full) // 2]
    needed = data_end(read_gguf(model, max_array_items=0))
    url, sha = put("gemma-3-270m-half.gguf", half)
    made["truncated-gguf"] = BadModel(url, sha, (
        "the controller: model_files[0] (%s): the server has %d bytes, the GGUF header needs %d" % (url, len(half), needed),))

    url, sha = put("unknown-arch.gguf", unknown_architecture_gguf(UNKNOWN_ARCH))
    made["unknown-architecture"] = BadModel(url, sha, (
        "the controller: model_files[0] (%s): required metadata keys %s.block_count and %s.embedding_length are missing for "
        "general.architecture '%s'" % (url, UNKNOWN_ARCH, UNKNOWN_ARCH, UNKNOWN_ARCH),))
    return made, written
