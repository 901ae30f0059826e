"""The host_user module's main(): check mode for an account the host lacks, and a real run on one it has."""

from __future__ import annotations

import grp
import os
import pwd
import stat

import pytest

from ansible_collections.llamafleet.cluster.plugins.modules import host_user
from tests.unit.module_runner import run_main

MISSING = "llamafleet-unit-test-absent"


def test_check_mode_plans_the_group_user_and_home_and_changes_nothing(tmp_path, capsys):
    home = tmp_path / "state"
    wanted = [group.gr_name for group in grp.getgrall()][:1] + ["llamafleet-no-such-group"]
    rc, result = run_main(host_user.main, {"name": MISSING, "home": str(home), "groups": wanted,
                                           "_ansible_check_mode": True, "_ansible_diff": True}, capsys)
    assert rc == 0, result
    assert result["changed"] is True
    assert result["groups"] == wanted[:1]
    assert [line[0] for line in result["commands"]] == ["groupadd", "useradd"]
    assert result["gid"] is None and result["uid"] is None
    assert result["diff"][0]["before"] == {"group": "absent", "user": "absent"}
    assert result["diff"][1]["after"] == {"state": "directory"}
    assert not home.exists()
    with pytest.raises(KeyError):
        pwd.getpwnam(MISSING)


def test_an_account_the_host_has_right_is_left_alone(capsys):
    # the user running the tests, where its group has its name (root on CI): nothing to run, the same ids back
    entry = pwd.getpwuid(os.getuid())
    try:
        own_group = grp.getgrnam(entry.pw_name)
    except KeyError:
        pytest.skip("the user's primary group is not named after it")
    if own_group.gr_gid != entry.pw_gid or not os.path.isdir(entry.pw_dir):
        pytest.skip("the user's primary group is not its own, or it has no home")
    home = os.stat(entry.pw_dir)
    args = {"name": entry.pw_name, "home": entry.pw_dir, "shell": entry.pw_shell,
            "mode": "%04o" % stat.S_IMODE(home.st_mode)}
    rc, result = run_main(host_user.main, args, capsys)
    assert rc == 0, result
    assert result["changed"] is False, result
    assert result["commands"] == []
    assert (result["gid"], result["uid"]) == (entry.pw_gid, entry.pw_uid)
    rc, result = run_main(host_user.main, {**args, "shell": "/bin/false", "_ansible_check_mode": True}, capsys)
    assert result["changed"] is True
    assert result["commands"] == [["usermod", "--shell", "/bin/false", "--", entry.pw_name]]
    assert pwd.getpwuid(os.getuid()).pw_shell == entry.pw_shell
