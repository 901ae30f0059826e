"""bench cache: the commands and seeding groups it derives from each worker's inventory variables."""

from __future__ import annotations

import pytest

from llamafleet.bench.cache import CACHE_DIR, empty_cache_command, seed_groups
from llamafleet.core import constants
from llamafleet.fleet import Fleet


@pytest.fixture
def lab(lab_inventory) -> Fleet:
    return Fleet.from_inventory_json(lab_inventory)


def test_empty_cache_command_follows_each_workers_settings(lab):
    assert empty_cache_command(lab, lab.hosts["lab2"]) == (
        f"systemctl stop {constants.RPC_SERVER_UNIT} && rm -rf {CACHE_DIR} && "
        f"install -d -m 0700 -o {constants.RPC_SERVER_USER} -g {constants.RPC_SERVER_USER} {CACHE_DIR}")
    lab3 = empty_cache_command(lab, lab.hosts["lab3"])
    assert lab3.startswith("systemctl stop llamafleet-rpc-server-cuda0.service llamafleet-rpc-server-cuda1.service && ")
    assert "rm -rf /srv/rpc/cache/rpc && " in lab3


def test_seed_groups_group_workers_with_the_same_cache(lab):
    assert seed_groups(lab) == {(CACHE_DIR, constants.RPC_SERVER_USER): ["lab2"],
                                ("/srv/rpc/cache/rpc", constants.RPC_SERVER_USER): ["lab3"]}
    lab.hosts["lab3"].vars.pop("rpc_server_home")
    assert seed_groups(lab) == {(CACHE_DIR, constants.RPC_SERVER_USER): ["lab2", "lab3"]}
