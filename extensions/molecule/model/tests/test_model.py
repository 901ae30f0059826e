"""The model role left a verified copy of the pinned GGUF on every host."""

import os

import testinfra.utils.ansible_runner
import yaml

INVENTORY = os.path.join(os.environ["MOLECULE_PROJECT_DIRECTORY"], "inventories", "lab", "hosts.ini")
GROUP_VARS = os.path.join(os.environ["MOLECULE_PROJECT_DIRECTORY"], "inventories", "lab", "group_vars", "all", "lab.yml")
# molecule hands pytest its own (empty) inventory: name the lab's inventory in each host spec
testinfra_hosts = [
    f"ansible://{name}?ansible_inventory={INVENTORY}"
    for name in testinfra.utils.ansible_runner.AnsibleRunner(INVENTORY).get_hosts("llamafleet")
]


def _model():
    with open(GROUP_VARS, encoding="utf-8") as handle:
        values = yaml.safe_load(handle)
    return values["model_name"], values["model_files"][0]


def test_model_file_matches_its_pin(host):
    name, spec = _model()
    path = f"/var/lib/llamafleet/models/{name}/{os.path.basename(spec['url'])}"
    model = host.file(path)
    assert model.is_file
    assert model.user == "root" and model.mode == 0o644
    assert model.sha256sum == spec["sha256"]
    assert not host.file(path + ".part").exists
