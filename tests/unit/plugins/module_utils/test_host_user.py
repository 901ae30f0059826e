"""The service account's command lines (module_utils/host_user.py)."""

from __future__ import annotations

from llamafleet.core.host_user import Account, account_commands, account_state, device_groups, wanted_state

NOLOGIN = "/usr/sbin/nologin"
HOME = "/var/lib/llamafleet-rpc"


def test_device_groups_are_those_the_host_has_in_the_order_given():
    assert device_groups(["video", "render", "video"], ["root", "video", "users"]) == ["video"]
    assert device_groups([], ["video"]) == []


def test_a_fresh_host_gets_the_group_then_the_user_in_its_device_groups():
    assert account_commands("svc", HOME, NOLOGIN, ["video", "render"], None, None) == [
        ["groupadd", "--system", "--", "svc"],
        ["useradd", "--system", "--gid", "svc", "--shell", NOLOGIN, "--home-dir", HOME, "--no-create-home",
         "--groups", "video,render", "--", "svc"],
    ]


def test_a_user_without_device_groups_gets_no_groups_option():
    line = account_commands("svc", HOME, NOLOGIN, [], 990, None)[0]
    assert line[0] == "useradd" and "--groups" not in line


def test_a_converged_account_needs_nothing():
    account = Account(gid=990, home=HOME, shell=NOLOGIN, groups=("render", "video"))
    assert account_commands("svc", HOME, NOLOGIN, ["video"], 990, account) == []


def test_an_existing_user_is_put_right_and_only_gains_groups():
    account = Account(gid=100, home="/home/svc", shell="/bin/bash", groups=("audio",))
    assert account_commands("svc", HOME, NOLOGIN, ["audio", "video"], 990, account) == [
        ["usermod", "--gid", "svc", "--shell", NOLOGIN, "--home", HOME, "--append", "--groups", "video", "--",
         "svc"],
    ]


def test_a_user_whose_group_is_missing_gets_the_group_and_joins_it():
    account = Account(gid=100, home=HOME, shell=NOLOGIN, groups=())
    assert account_commands("svc", HOME, NOLOGIN, [], None, account) == [
        ["groupadd", "--system", "--", "svc"], ["usermod", "--gid", "svc", "--", "svc"]]


def test_the_diff_shows_the_groups_kept_and_added():
    account = Account(gid=100, home=HOME, shell=NOLOGIN, groups=("audio",))
    assert account_state("svc", 990, account)["user"]["primary_group_is_own"] is False
    assert account_state("svc", None, None) == {"group": "absent", "user": "absent"}
    assert wanted_state("svc", HOME, NOLOGIN, ["video"], account)["user"]["groups"] == ["audio", "video"]
