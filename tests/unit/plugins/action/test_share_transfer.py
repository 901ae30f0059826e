"""plugin_utils/share_transfer.py's ssh command for model_receive's stream, read back by ssh itself (``ssh -G``
prints the options a command line ends up with, without connecting)."""

from __future__ import annotations

import shutil
import subprocess

from ansible_collections.llamafleet.cluster.plugins.plugin_utils.share_transfer import open_stream, ssh_uncompressed

from tests.unit.needs import needs


def _effective(argv: list) -> dict[str, str]:
    words = [a.decode() if isinstance(a, bytes) else a for a in argv]
    shown = subprocess.run([words[0], "-G", *words[1:-1]], capture_output=True, text=True, check=True, timeout=10)
    return dict(line.split(" ", 1) for line in shown.stdout.splitlines() if " " in line)


@needs(shutil.which("ssh"), "the ssh client")
def test_the_stream_is_uncompressed_and_outside_the_master() -> None:
    # what Ansible's ssh connection builds with its default ssh_args
    ansible = [b"ssh", b"-C", b"-o", b"ControlMaster=auto", b"-o", b"ControlPersist=60s", b"-o",
               b"Compression=yes", b"-o", b"ControlPath=\"/root/.ansible/cp/abc\"", b"-o", b"Port=2222",
               b"host.example", b"/bin/sh -c 'cat'"]
    before = _effective(ansible)
    assert before["compression"] == "yes" and before["controlmaster"] == "auto" and "controlpath" in before
    after = _effective(ssh_uncompressed(ansible))
    assert after["compression"] == "no" and "controlpath" not in after and after["controlmaster"] == "false"
    assert after["port"] == "2222" and after["hostname"] == "host.example"
    assert ssh_uncompressed(ansible)[-2:] == ansible[-2:]


class _Connection:
    """A connection plugin that calls its transport ssh without being Ansible's (Mitogen's mitogen_ssh does: the
    model copy once failed there with "'Connection' object has no attribute '_build_command'")."""

    transport = "ssh"

    @staticmethod
    def get_option(name: str) -> None:
        return None


class _Action:
    _connection = _Connection()


def test_a_connection_without_ansibles_ssh_command_falls_back_to_commands() -> None:
    assert open_stream(_Action(), "cat > /dev/null") is None
