"""A 3-host lab, deployed once for all end-to-end tests, removed afterwards.

The modules run in the order of ``ORDER`` below, the one place it is written (not their file names): each module
either only reads the deployed lab or puts it back as it found it, and the order keeps the costly shapes apart
(the mixed Vulkan lab first, while the CPU lab is still to deploy; teardown last, as it takes the cluster away).
The modules in ``SEPARATE`` run by their own make targets only.
A module missing from ``ORDER`` fails the collection, so a new one cannot run in an unplanned place.
It prints the time each module took at the end (setup, calls and teardown together).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from llamafleet.cluster import Endpoint
from llamafleet.core import constants
from tests.e2e import quiet
from tests.helpers import INVENTORY, cli, playbook

ORDER = [
    "test_mixed_vulkan.py",      # its own lab shape (lab3, then lab1 too, Vulkan on Debian 13); compiles both builds
    "test_cli.py",               # the first of the CPU lab's modules: the ``deployed`` fixture deploys bare hosts
    "test_endpoint_clients.py",  # the README's "Using the endpoint" recipes: curl, openai-python, environment
    "test_deploy.py",            # idempotence, check mode, bad input, changes that restore
    "test_faults.py",            # faults, the 2-minute partition included, on the converged lab
    "test_fleet_changes.py",
    "test_install_routes.py",    # deploys from a tarball, a clone and a wheel: nothing changes
    "test_lowest_ansible.py",    # deploy on the lowest ansible-core changes nothing
    "test_monitoring.py",        # adds Prometheus beside the cluster
    "test_serving_tls.py",
    "test_edge_lab.py",          # the edge (on by default): the hostile suite, a flood, its cost; then off and on again
    "test_upgrade.py",           # compiles the other llama.cpp release (cached after)
    "test_weights_local.py",     # reads, and repairs one cache file
    "test_bench.py",
    "test_teardown.py",          # last: takes the cluster away, then deploys it again
]

# Modules make e2e-test leaves out, run by make separate-e2e-test (in this order) and each by its own target: with
# them make test would not end within CI's 90 minutes on a 2-core machine (README, "Test times").
SEPARATE = {
    "test_share_replan.py": "make separate-e2e-test",  # fewest_hops and back: only the difference moves
    "test_host_firewall.py": "make separate-e2e-test",  # firewalld, then ufw, installed beside the worker firewall
    "test_bench_builds.py": "make bench-builds-test",  # both releases side by side (compiles the other one if needed)
    "test_big_model.py": "make big-model-test",  # the 6.41 GiB model over hosts of 4 GiB each, left deployed
}

_MODULE_SECONDS: dict[str, float] = defaultdict(float)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    unknown = sorted({item.path.name for item in items
                      if item.path.parent == here and item.path.name not in ORDER and item.path.name not in SEPARATE})
    if unknown:
        raise pytest.UsageError(f"tests/e2e: {', '.join(unknown)} not in conftest.ORDER: add each where it belongs")
    missing = sorted(name for name in [*ORDER, *SEPARATE] if not (here / name).is_file())
    if missing:
        raise pytest.UsageError(f"tests/e2e/conftest.ORDER names files that do not exist: {', '.join(missing)}")
    for item in items:
        item.add_marker(pytest.mark.e2e)
    order = [*ORDER, *SEPARATE]
    items.sort(key=lambda item: order.index(item.path.name) if item.path.name in order else len(order))


def pytest_runtest_logreport(report):
    _MODULE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration
    progress = os.environ.get("LLAMAFLEET_E2E_PROGRESS")  # a file that gets one line per step as it ends
    if progress:
        with open(progress, "a", encoding="utf-8") as handle:
            handle.write(f"{time.strftime('%H:%M:%S')} {report.duration:7.1f} s {report.when:8} {report.outcome:7} "
                         f"{report.nodeid}\n")


def pytest_terminal_summary(terminalreporter):
    if not _MODULE_SECONDS:
        return
    terminalreporter.section("time per end-to-end module")
    for name in sorted(_MODULE_SECONDS, key=lambda n: ORDER.index(Path(n).name) if Path(n).name in ORDER else 99):
        terminalreporter.write_line(f"{_MODULE_SECONDS[name]:8.1f} s  {name}")
    terminalreporter.write_line(f"{sum(_MODULE_SECONDS.values()):8.1f} s  in all")


@pytest.fixture(scope="session")
def lab():
    if os.geteuid() != 0:
        pytest.fail("the end-to-end tests need root (they create real lab hosts)")
    started = time.monotonic()
    cli("lab", "up", "--hosts", "3", timeout=1200)
    print(f"lab up: {time.monotonic() - started:.1f} s")
    yield INVENTORY
    if os.environ.get("LLAMAFLEET_KEEP_LAB") != "1":
        cli("lab", "down", timeout=300)


@pytest.fixture(scope="session")
def deployed(lab):
    """The 3-host CPU lab deployed (compiles llama.cpp unless the controller's artifact cache has it), its clients'
    port served by the edge (Debian's HAProxy, on by default: the lab inventory leaves llamafleet_edge unset).

    ``lab up --hosts 3`` first: after test_mixed_vulkan.py it boots lab1 and lab3 again as Debian 12 CPU hosts
    (bare hosts, deployed from here); on a lab that already has that shape it changes nothing."""
    started = time.monotonic()
    cli("lab", "up", "--hosts", "3", timeout=1200)
    run = playbook("deploy.yml", timeout=5400)
    run.seconds = time.monotonic() - started
    assert run.rc == 0, f"deploy.yml failed:\n{run.output[-8000:]}"
    return run


@pytest.fixture(scope="session")
def fleet(deployed):
    from llamafleet.fleet import Fleet

    return Fleet.from_inventory(INVENTORY)


# The edge's unit (Debian's HAProxy, on the orchestrator by default) and the files the edge role writes.
EDGE_UNIT = "haproxy.service"
EDGE_FILES = f"/etc/haproxy/haproxy.cfg {constants.SYSTEMD_DIR}/{EDGE_UNIT}.d/llamafleet.conf"


def main_pids(fleet) -> dict[str, str]:
    """MainPID and start timestamp of the cluster's units on every host, the edge's last (a unit a host does not
    have shows 0 0), and the edge's processes (a reload keeps HAProxy's master and replaces its worker)."""
    pids = {}
    for name, res in fleet.run(
        f"for u in {constants.LLAMA_SERVER_UNIT} {constants.GATE_UNIT} {constants.RPC_SERVER_UNIT} "
        f"{constants.RPC_GUARD_UNIT} {EDGE_UNIT}; do "
        "systemctl show -p MainPID,ExecMainStartTimestampMonotonic --value $u 2>/dev/null | tr '\\n' ' '; echo; done; "
        "echo edge processes: $(pgrep -x haproxy | sort -n)"
    ).items():
        assert res.ok, f"{name}: {res.error or res.stderr}"
        pids[name] = res.stdout.strip()
    return pids


@contextmanager
def nothing_changes(fleet) -> Iterator[None]:
    """Asserts that what runs inside restarted no unit (main pids and start times) and reloaded no edge, changed no
    unit file nor the edge's configuration, and that the cluster still serves."""
    files = f"sha256sum /etc/systemd/system/llamafleet-*.service {EDGE_FILES} 2>/dev/null; true"
    before = main_pids(fleet)
    units_before = fleet.run(files)
    yield
    assert main_pids(fleet) == before, "a unit was restarted"
    units_after = fleet.run(files)
    assert {h: r.stdout for h, r in units_after.items()} == {h: r.stdout for h, r in units_before.items()}
    Endpoint.of(fleet).wait_healthy(timeout=30)


@pytest.fixture(scope="session")
def quiet_runs(deployed, fleet) -> quiet.Outcomes:
    """Every run registered in tests/e2e/quiet.py, together, on the converged CPU lab (see there)."""
    started = time.monotonic()
    outcomes = quiet.run_all(lambda: nothing_changes(fleet))
    print(f"quiet runs: {len(outcomes)} in {time.monotonic() - started:.0f} s, {quiet.WORKERS} at a time")
    return outcomes


# The label of the llama.cpp commit vendored in llama-cpp-python 0.3.35 (its changelog: ggml-org/llama.cpp@4df29be4f).
OTHER_LLAMACPP_COMMIT = "4df29be4f"


@pytest.fixture(scope="session")
def other_llamacpp_source(lab) -> dict[str, str]:
    """The llamacpp_build settings of a second llama.cpp source (llama-cpp-python 0.3.35's, RPC protocol 5 where
    the lab's has 7), published on the lab's mirror: the upgrade and the bench's builds side by side use it, so
    a fresh machine compiles it once for both (then the controller's artifact cache has it)."""
    from llamafleet.lab import LabPaths
    from llamafleet.lab.artifacts import LLAMA_CPP_OTHER_SOURCE, ensure_artifact, llama_cpp_archive_subdir
    from llamafleet.lab.mirror import publish

    path = ensure_artifact(LLAMA_CPP_OTHER_SOURCE, LabPaths.default().root)
    return {
        "llamacpp_build_archive_url": publish(path, LLAMA_CPP_OTHER_SOURCE.subdir),
        "llamacpp_build_archive_sha256": LLAMA_CPP_OTHER_SOURCE.sha256,
        "llamacpp_build_archive_subdir": llama_cpp_archive_subdir(LLAMA_CPP_OTHER_SOURCE),
        "llamacpp_build_version": OTHER_LLAMACPP_COMMIT,
    }
