"""The environment the lab tests give ansible-playbook (tests/helpers.py): Mitogen's strategy, or Ansible's own ssh."""

from __future__ import annotations

from tests import helpers


def test_the_lab_runs_take_mitogens_strategy_from_the_pinned_package(monkeypatch):
    monkeypatch.delenv("ANSIBLE_STRATEGY", raising=False)
    e = helpers.env()
    assert e["ANSIBLE_STRATEGY"] == "mitogen_linear"
    folder = helpers.mitogen_strategies()
    assert e["ANSIBLE_STRATEGY_PLUGINS"] == str(folder)
    # the plugin the name selects is there, in the package requirements/lock.txt pins
    assert (folder / "mitogen_linear.py").is_file()
    lock = (helpers.REPO / "requirements" / "lock.txt").read_text().splitlines()
    assert any(line.startswith("mitogen==") for line in lock)


def test_ansible_ssh_drops_the_strategy_even_from_the_callers_environment(monkeypatch):
    monkeypatch.setenv("ANSIBLE_STRATEGY", "mitogen_free")
    monkeypatch.setenv("ANSIBLE_STRATEGY_PLUGINS", "/somewhere")
    e = helpers.env(ansible_ssh=True)
    assert "ANSIBLE_STRATEGY" not in e and "ANSIBLE_STRATEGY_PLUGINS" not in e
    assert e["ANSIBLE_CONFIG"] == str(helpers.REPO / "ansible.cfg")
