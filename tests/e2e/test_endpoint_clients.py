"""The README's "Using the endpoint" recipes, run as written against the deployed lab.

Each fenced block of that section runs here: the setup (the endpoint and the key fetched over ssh, the header file),
every curl command, the official ``openai`` Python client, and the environment variables that OpenAI-compatible
tools read. Only the example address, port and model name are replaced by the lab's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from tests.helpers import BIN, REPO, env

SECTION = "## Using the endpoint"
EXAMPLE_URL = "http://192.168.1.10:8080"
EXAMPLE_HOST = "192.168.1.10"
EXAMPLE_MODEL = "gemma-3-270m-q4_k_m"


def recipe_blocks() -> list[tuple[str, str]]:
    """The section's fenced blocks, in order, as ``(language, text)``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION + "\n")
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"^```(sh|python)\n(.*?)^```$", text[start:end], re.M | re.S)


def commands(block: str) -> list[str]:
    """The shell commands of a block, continuation lines joined, comments and blank lines left out."""
    return [c for c in re.sub(r"\\\n\s*", " ", block).splitlines() if c.strip() and not c.lstrip().startswith("#")]


def test_the_section_has_its_recipes() -> None:
    assert [lang for lang, _ in recipe_blocks()] == ["sh", "sh", "python", "sh"]


@pytest.fixture(scope="module")
def recipes(deployed, fleet, tmp_path_factory):
    """The blocks with the lab's endpoint and model put in, the environment the setup block leaves, and the
    model's id."""
    orch = fleet.orchestrator
    url = Endpoint.of(fleet, api_key="").url
    assert urlsplit(url).scheme == "http", url  # the lab serves plain HTTP at this point of the run
    model = str(orch.var("model_name"))
    home = tmp_path_factory.mktemp("client-home")
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "config").write_text(
        f"Host {orch.address}\n    IdentityFile {orch.key_file}\n    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {' '.join(orch.known_hosts)}\n    StrictHostKeyChecking yes\n")

    def lab(text: str) -> str:
        return (text.replace(EXAMPLE_URL, url).replace(f"root@{EXAMPLE_HOST}", f"{orch.user}@{orch.address}")
                .replace(EXAMPLE_MODEL, model))

    blocks = [(lang, lab(text)) for lang, text in recipe_blocks()]
    # ssh reads ~/.ssh/config from the passwd entry's home, not $HOME: the client's ssh gets its config by -F
    (home / "bin").mkdir()
    (home / "bin" / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F "$HOME/.ssh/config" "$@"\n')
    (home / "bin" / "ssh").chmod(0o755)
    base = dict(env(), HOME=str(home), PATH=f"{home / 'bin'}:{BIN}:{os.environ.get('PATH', '')}")
    proc = subprocess.run(["bash", "-euc", blocks[0][1] + "\nenv -0"], env=base, capture_output=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    after = dict(item.split("=", 1) for item in proc.stdout.decode().split("\0") if "=" in item)
    return blocks, after, model, home


def run_sh(command: str, environ: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-euc", command], env=environ, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def test_the_setup_reads_the_deploys_key_over_ssh(recipes, fleet) -> None:
    _blocks, after, _model, home = recipes
    key = fleet.run_one(f"cat {constants.API_KEY_PATH}", fleet.orchestrator).strip()
    assert after["LLAMAFLEET_API_KEY"] == key
    header = home / ".llamafleet-auth"
    assert header.read_text() == f"Authorization: Bearer {key}\n" and header.stat().st_mode & 0o077 == 0


def test_the_curl_recipes(recipes) -> None:
    blocks, after, model, _home = recipes
    models, chat, stream, completion, wrong = (run_sh(c, after).stdout for c in commands(blocks[1][1]))
    ids = [m["id"] for m in json.loads(models)["data"]]
    assert ids == [model], ids  # the alias, not the GGUF's path
    answer = json.loads(chat)
    assert answer["choices"][0]["message"]["role"] == "assistant", answer
    assert isinstance(answer["choices"][0]["message"]["content"], str) and answer["usage"]["completion_tokens"] > 0
    events = [line[len("data: "):] for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2, stream[-2000:]
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]
    assert any(d.get("content") for d in deltas), deltas
    done = json.loads(completion)
    assert isinstance(done["choices"][0]["text"], str) and done["usage"]["completion_tokens"] > 0, done
    assert wrong.strip() == "401"


def test_the_openai_python_recipe(recipes) -> None:
    blocks, after, model, _home = recipes
    proc = subprocess.run([sys.executable, "-c", blocks[2][1]], env=after, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == repr([model]), lines
    assert len(lines) >= 4, lines  # the answer, the streamed answer, the completion (each may span lines)


def test_the_environment_variables_recipe(recipes) -> None:
    blocks, after, model, _home = recipes
    out = run_sh(blocks[3][1], after).stdout
    assert out.strip() == repr([model]), out


def test_no_command_of_the_recipes_holds_the_key(recipes) -> None:
    blocks, after, _model, _home = recipes
    key = after["LLAMAFLEET_API_KEY"]
    for lang, text in blocks:
        if lang == "sh":
            reads = ("export ", "umask ", 'LLAMAFLEET_API_KEY="$(ssh ')
            assert all("LLAMAFLEET_API_KEY" not in c or c.lstrip().startswith(reads) or "printf" in c
                       for c in commands(text)), text
        assert key not in text
