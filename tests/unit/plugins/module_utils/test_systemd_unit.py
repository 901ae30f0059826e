"""systemd_unit: quoting, the one unit renderer of rpc-server and llama-server, and each backend's device policy."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from llamafleet.core.constants import (
    GATE_CONFIG_PATH,
    GATE_RUNTIME_DIR,
    GATE_MODULE,
    HOST_PYTHON,
    GATE_UNIT,
    LLAMA_SERVER_UNIT,
    RPC_FIREWALL_UNIT,
)
from llamafleet.core.llama_flags import FlagError
from llamafleet.core.systemd_unit import (
    BACKEND_DEVICE_NODES,
    GATE_LIMIT_NOFILE,
    HARDENING,
    UnitError,
    device_policy,
    hardening,
    memory_limit,
    render_gate_unit,
    render_rpc_guard_unit,
    render_rpc_server_unit,
    render_systemd_unit,
    systemd_exec,
    systemd_quote,
)
from tests.unit.needs import needs

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
BIN = "/opt/llamafleet/llama.cpp/b1/bin/llama-server"
MODEL = "/var/lib/llamafleet/models/m.gguf"
WORKERS = ["10.77.0.11:50052", "10.77.0.12:50052"]
LLAMA_ARGV = [BIN, "-m", MODEL, "--rpc", ",".join(WORKERS), "-ngl", "33", "-sm", "layer", "-ts", "11,8,14",
              "--fit", "off", "-c", "8192", "-np", "2", "--host", "10.77.0.11", "--port", "8080"]
RPC_BIN = "/opt/llamafleet/llama.cpp/b1/bin/ggml-rpc-server"
RPC_ARGV = [RPC_BIN, "-H", "10.77.0.12", "-p", "50052", "-c"]
WAIT_HELPER = "/usr/local/libexec/llamafleet-rpc-wait"
LINUX_BACKENDS = ("cpu", "cuda", "rocm", "vulkan")


def _unquote_like_systemd(value: str) -> list[str]:
    """Split an ExecStart value back into words: continuations, %% and $$, then double quotes with \\ and \"
    (for arguments without newlines or tabs POSIX shell splitting treats these exactly like systemd)."""
    joined = value.replace(" \\\n", " ").replace("%%", "%").replace("$$", "$")
    return shlex.split(joined, posix=True)


def directives(unit: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment, continuation lines joined, comments left out."""
    found: list[tuple[str, str, str]] = []
    section = ""
    for line in unit.replace("\\\n", "").splitlines():
        if line.startswith(("#", ";")) or not line.strip():
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, value = line.split("=", 1)
        found.append((section, key, value))
    return found


def rpc_unit(backend: str, firewall: bool = True) -> str:
    return render_rpc_server_unit(RPC_ARGV, backend, 50052, build_id="b1-" + backend, firewall=firewall,
                                  header="# Managed by Ansible (role llamafleet.cluster.rpc_server)")


def llama_unit(backend: str | None) -> str:
    return render_systemd_unit(LLAMA_ARGV, header="# Managed by Ansible", user="llamafleet", backend=backend,
                               working_directory="/var/lib/llamafleet", read_write_paths=["/var/lib/llamafleet"],
                               exec_start_pre=[[WAIT_HELPER] + WORKERS], timeout_start_sec=900)


SERVICES = {"rpc-server": rpc_unit, "llama-server": llama_unit}


# --- quoting -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arg, quoted", [
    ("/opt/llama/bin/llama-server", "/opt/llama/bin/llama-server"),
    ("10.0.0.1:50052,10.0.0.2:50052", "10.0.0.1:50052,10.0.0.2:50052"),
    ("my model.gguf", '"my model.gguf"'),
    ("", '""'),
    ("100%", '"100%%"'),
    ("$HOME", '"$$HOME"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("a\\b", '"a\\\\b"'),
    ("line\nbreak", '"line\\nbreak"'),
    ("it's", '"it\'s"'),
])
def test_systemd_quote(arg: str, quoted: str) -> None:
    assert systemd_quote(arg) == quoted


def test_systemd_exec_groups_options_with_values() -> None:
    assert systemd_exec(["/bin/x", "-m", "/m.gguf", "--metrics", "-ts", "1,2", "positional"]) == (
        "/bin/x \\\n    -m /m.gguf \\\n    --metrics \\\n    -ts 1,2 \\\n    positional")
    with pytest.raises(FlagError, match="absolute path"):
        systemd_exec(["llama-server"])


@pytest.mark.parametrize("argv", [
    ["/bin/x", "-m", "/models/my model.gguf", "--chat-template", "{% if x %}100%{% endif %}"],
    ["/bin/x", "--api-key-file", "/etc/k", "--host", "0.0.0.0", "--empty", ""],
    ["/bin/x", "--chat-template", 'a "quoted" \\path\\ $VAR %% done', "-x"],
])
def test_systemd_exec_round_trips(argv: list[str]) -> None:
    assert _unquote_like_systemd(systemd_exec(argv)) == argv


def test_systemd_252_really_passes_the_argv_through() -> None:
    """The quoting, recorded as started by a real systemd (see the fixture's "about"): the lines that carry
    quoted values must be rendered exactly as they were then (a change must be re-verified against systemd)."""
    recorded = json.loads((FIXTURES / "systemd252_unit_argv_roundtrip_real.json").read_text())
    argv = ["/out/printargs", "-m", "/models/my model.gguf",
            "--chat-template", "{% if x %}100% \"q\" \\ $HOME ${USER} it's{% endif %}",
            "--empty", "", "--tab", "a\tb", "--nl", "line1\nline2", "--semi", ";",
            "--plain", "10.0.0.1:50052,10.0.0.2:50052"]
    environment = {"LF_A": "x y %h $Z", "LF_B": 'q"uote\\'}
    unit = render_systemd_unit(argv, header="# test", user="root", read_write_paths=["/out"],
                               environment=environment,
                               exec_start_pre=[["/out/pre", "10.0.0.1:50052", "10.0.0.2:50052"]])

    def quoted(text: str) -> list[tuple[str, str, str]]:
        return [d for d in directives(text) if d[1] in ("Environment", "ExecStartPre", "ExecStart")]

    assert quoted(unit) == quoted(recorded["unit"]) and len(quoted(unit)) == 4
    assert recorded["exec_start_argv_seen"] == argv[1:]
    assert recorded["exec_start_pre_argv_seen"] == ["10.0.0.1:50052", "10.0.0.2:50052"]
    assert recorded["environment_seen"] == environment


# --- the unit --------------------------------------------------------------------------------------------

def test_unit_text() -> None:
    argv = LLAMA_ARGV + ["--chat-template", "{{ bos }} 50% $X"]
    unit = render_systemd_unit(argv, header="#\n# Ansible managed\n#", description="llamafleet llama-server",
                               user="llamafleet", read_write_paths=["/var/lib/llamafleet"],
                               environment={"LLAMA_CACHE": "/var/lib/llamafleet/cache"},
                               exec_start_pre=[[WAIT_HELPER] + WORKERS],
                               comments=["llama.cpp build b1"], limit_memlock_infinity=True, timeout_start_sec=600)
    lines = unit.splitlines()
    assert lines[:5] == ["#", "# Ansible managed", "#", "# llama.cpp build b1", "[Unit]"]
    for directive in ("User=llamafleet", "Group=llamafleet", "Restart=on-failure", "NoNewPrivileges=yes",
                      "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "ReadWritePaths=/var/lib/llamafleet",
                      "CapabilityBoundingSet=", "LimitMEMLOCK=infinity", "TimeoutStartSec=600",
                      'Environment="LLAMA_CACHE=/var/lib/llamafleet/cache"', "WantedBy=multi-user.target"):
        assert directive in lines, directive
    assert '--chat-template "{{ bos }} 50%% $$X"' in unit
    assert lines.index("ExecStartPre=%s \\" % WAIT_HELPER) < [
        i for i, line in enumerate(lines) if line.startswith("ExecStart=")][0]


@pytest.mark.parametrize("kwargs, message", [
    ({"working_directory": "var/lib"}, "absolute path"),
    ({"environment": {"A B": "x"}}, "not valid"),
    ({"restart": "sometimes"}, "restart 'sometimes' is not one of"),
    ({"backend": "metal"}, "macOS, which has no systemd"),
    ({"backend": "opencl"}, "backend 'opencl' has no systemd device policy"),
])
def test_unit_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(UnitError, match=message):
        render_systemd_unit(["/bin/true"], **kwargs)


def test_metal_rpc_server_is_refused() -> None:
    with pytest.raises(FlagError, match="backend 'metal' builds run on macOS"):
        rpc_unit("metal")


# The template the rpc-server role rendered before this renderer (CPU build, firewall on), as directives.
OLD_RPC_SERVER_CPU_UNIT = {
    ("Unit", "Description", "llama.cpp RPC worker for the llamafleet cluster (port 50052)"),
    ("Unit", "After", "network-online.target llamafleet-rpc-firewall.service"),
    ("Unit", "Wants", "network-online.target"),
    ("Unit", "Requires", "llamafleet-rpc-firewall.service"),
    ("Service", "Type", "simple"), ("Service", "User", "llamafleet-rpc"), ("Service", "Group", "llamafleet-rpc"),
    ("Service", "Environment", "LLAMA_CACHE=/var/lib/llamafleet-rpc/cache"),
    ("Service", "ExecStart", RPC_BIN + " -H 10.77.0.12 -p 50052 -c"),
    ("Service", "Restart", "always"), ("Service", "RestartSec", "2"), ("Service", "UMask", "0077"),
    ("Service", "NoNewPrivileges", "yes"), ("Service", "ProtectSystem", "strict"), ("Service", "ProtectHome", "yes"),
    ("Service", "PrivateTmp", "yes"), ("Service", "ReadWritePaths", "/var/lib/llamafleet-rpc"),
    ("Service", "ProtectKernelTunables", "yes"), ("Service", "ProtectKernelModules", "yes"),
    ("Service", "ProtectKernelLogs", "yes"), ("Service", "ProtectControlGroups", "yes"),
    ("Service", "ProtectClock", "yes"), ("Service", "ProtectHostname", "yes"),
    ("Service", "RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX AF_NETLINK"),
    ("Service", "RestrictNamespaces", "yes"), ("Service", "RestrictRealtime", "yes"),
    ("Service", "RestrictSUIDSGID", "yes"), ("Service", "LockPersonality", "yes"),
    ("Service", "SystemCallArchitectures", "native"), ("Service", "CapabilityBoundingSet", ""),
    ("Service", "PrivateDevices", "yes"),
    ("Install", "WantedBy", "multi-user.target"),
}


def test_rpc_server_cpu_unit_is_the_one_the_template_rendered() -> None:
    unit = rpc_unit("cpu")
    rendered = {(section, key, " ".join(_unquote_like_systemd(value))) for section, key, value in directives(unit)}
    assert rendered - OLD_RPC_SERVER_CPU_UNIT == {("Service", "AmbientCapabilities", "")}  # no ambient: the default
    assert OLD_RPC_SERVER_CPU_UNIT - rendered == set()
    assert unit.splitlines()[:2] == ["# Managed by Ansible (role llamafleet.cluster.rpc_server)",
                                     "# llama.cpp build b1-cpu (cpu)"]


def test_rpc_server_environment_adds_to_the_cache_variable() -> None:
    unit = render_rpc_server_unit(RPC_ARGV, "vulkan", 50052, environment={"GGML_VK_VISIBLE_DEVICES": "0,1"})
    env = [value for section, key, value in directives(unit) if (section, key) == ("Service", "Environment")]
    assert sorted(env) == ['"GGML_VK_VISIBLE_DEVICES=0,1"', '"LLAMA_CACHE=/var/lib/llamafleet-rpc/cache"']
    with pytest.raises(UnitError, match="LLAMA_CACHE is set by the unit"):
        render_rpc_server_unit(RPC_ARGV, "vulkan", 50052, environment={"LLAMA_CACHE": "/tmp"})
    with pytest.raises(UnitError, match="not valid"):
        render_rpc_server_unit(RPC_ARGV, "vulkan", 50052, environment={"BAD NAME": "1"})


def test_rpc_server_memory_limit_is_ram_only() -> None:
    unit = render_rpc_server_unit(RPC_ARGV, "cpu", 50052, memory_max_mib=2048)
    memory = [(key, value) for section, key, value in directives(unit) if key.startswith("Memory")]
    assert memory == [("MemoryMax", "2048M"), ("MemorySwapMax", "0")]
    # none asked: the unit is the one it always was
    assert render_rpc_server_unit(RPC_ARGV, "cpu", 50052, memory_max_mib=0) == render_rpc_server_unit(
        RPC_ARGV, "cpu", 50052)
    assert "Memory" not in render_rpc_server_unit(RPC_ARGV, "cpu", 50052)
    for bad in (-1, "2048", True):
        with pytest.raises(UnitError, match="memory_max_mib is"):
            memory_limit(bad)


def test_rpc_server_without_firewall_does_not_require_it() -> None:
    found = directives(rpc_unit("cpu", firewall=False))
    assert ("Unit", "After", "network-online.target") in found
    assert not [d for d in found if d[1] == "Requires"]


# --- device policy, by systemd's rules (systemd.exec(5), systemd.resource-control(5), systemd 252) ----------

# Concrete nodes each backend's llama.cpp opens (a CUDA host with one GPU, an AMD host with one card).
NODES = {
    "cuda": ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"],
    "rocm": ["/dev/kfd", "/dev/dri/card0", "/dev/dri/renderD128"],
    "vulkan": ["/dev/dri/card0", "/dev/dri/renderD128"],
}


def reachable(unit: str, node: str) -> bool:
    """Whether a process of the unit can open ``node``, by systemd's rules.

    PrivateDevices=yes gives the service a /dev without physical devices. Otherwise the device cgroup
    decides: DevicePolicy=closed/strict, and with the default auto any DeviceAllow= (ProtectClock=yes
    implies DeviceAllow=char-rtc r), allow only the listed devices (plus pseudo devices, never a GPU).
    """
    found = {(key, value) for section, key, value in directives(unit) if section == "Service"}
    if ("PrivateDevices", "yes") in found:
        return False
    allowed = [value.split()[0] for key, value in found if key == "DeviceAllow" and value]
    if ("ProtectClock", "yes") in found:
        allowed.append("char-rtc")
    policy = {value for key, value in found if key == "DevicePolicy"} or {"auto"}
    if policy == {"auto"} and not allowed:
        return True
    return any(entry.startswith("/dev/") and entry == node for entry in allowed)


@pytest.mark.parametrize("service", sorted(SERVICES))
@pytest.mark.parametrize("backend", ["cuda", "rocm", "vulkan"])
def test_gpu_nodes_stay_reachable(service: str, backend: str) -> None:
    unit = SERVICES[service](backend)
    for node in NODES[backend]:
        assert reachable(unit, node), (backend, node)
        # the unit's comment names the backend's nodes
        assert any(fnmatch.fnmatchcase(node, pattern) for pattern in BACKEND_DEVICE_NODES[backend]), node
    (comment,) = [line for line in unit.splitlines() if line.startswith("# Devices:")]
    assert all(pattern in comment for pattern in BACKEND_DEVICE_NODES[backend])
    # the rest of the hardening is the CPU unit's
    assert ("Service", "ProtectKernelLogs", "yes") in directives(unit)
    closing = {("Service", "PrivateDevices", "yes"), ("Service", "ProtectClock", "yes")}
    cpu = set(directives(SERVICES[service]("cpu"))) - closing
    assert {d for d in directives(unit) if d[1] != "ExecStart"} >= {d for d in cpu if d[1] != "ExecStart"}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_cpu_units_close_the_device_policy(service: str) -> None:
    unit = SERVICES[service]("cpu")
    found = directives(unit)
    assert ("Service", "PrivateDevices", "yes") in found and ("Service", "ProtectClock", "yes") in found
    assert not [node for nodes in NODES.values() for node in nodes if reachable(unit, node)]


def test_llama_server_without_backend_keeps_devices_reachable() -> None:
    unit = llama_unit(None)
    assert all(reachable(unit, node) for nodes in NODES.values() for node in nodes)
    assert "every device node (backend not given)" in unit


def test_the_reachability_rules_catch_a_closed_policy() -> None:
    """The rules above are not vacuous: the directives that close the policy make GPUs unreachable."""
    unit = llama_unit("cuda")
    for closing in ("ProtectClock=yes", "PrivateDevices=yes", "DeviceAllow=/dev/nvidiactl rw"):
        assert not reachable(unit.replace("ProtectHostname=yes", "ProtectHostname=yes\n" + closing), "/dev/nvidia0")
    assert reachable(unit.replace("ProtectHostname=yes", "ProtectHostname=yes\nDeviceAllow=/dev/nvidia0 rw"),
                     "/dev/nvidia0")


# --- what systemd itself says ------------------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@needs(SYSTEMD_ANALYZE, "systemd-analyze (systemd)")
@pytest.mark.parametrize("service", sorted(SERVICES))
@pytest.mark.parametrize("backend", LINUX_BACKENDS)
def test_systemd_analyze_verifies_the_unit(tmp_path: Path, service: str, backend: str) -> None:
    unit = tmp_path / ("llamafleet-%s.service" % service)
    text = SERVICES[service](backend)
    for program in (BIN, RPC_BIN, WAIT_HELPER):
        text = text.replace(program, "/bin/true")
    unit.write_text(text)
    # verify looks for the units this one requires next to it
    (tmp_path / RPC_FIREWALL_UNIT).write_text("[Service]\nType=oneshot\nExecStart=/bin/true\n")
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True,
                          check=False)
    problems = [line for line in done.stderr.splitlines() if unit.name in line
                and "Special user" not in line and "is not a valid user" not in line]
    assert not problems, done.stderr


def exposure(tmp_path: Path, name: str, text: str) -> float:
    """systemd-analyze's overall exposure of a unit file (0 safest, 10 worst)."""
    unit = tmp_path / name
    unit.write_text(text)
    done = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
                          capture_output=True, text=True, check=False)
    match = re.search(r"Overall exposure level for %s: (\d+\.\d+)" % re.escape(name), done.stdout)
    assert match, done.stdout + done.stderr
    return float(match.group(1))


@needs(SYSTEMD_ANALYZE, "systemd-analyze (systemd)")
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_systemd_analyze_security(tmp_path: Path, service: str) -> None:
    scores = {b: exposure(tmp_path, "llamafleet-%s-%s.service" % (service, b), SERVICES[service](b))
              for b in LINUX_BACKENDS}
    assert scores["cpu"] <= 4.0, scores
    # GPU units give up only the device protections: open /dev, and the clock (which would close it)
    assert all(scores["cpu"] < scores[b] <= scores["cpu"] + 0.6 for b in ("cuda", "rocm", "vulkan")), scores


@needs(SYSTEMD_ANALYZE, "systemd-analyze (systemd)")
def test_systemd_analyze_takes_the_memory_limit(tmp_path: Path) -> None:
    unit = tmp_path / "llamafleet-rpc-server.service"
    unit.write_text(render_rpc_server_unit(["/bin/true"], "cpu", 50052, firewall=False, memory_max_mib=2048))
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True,
                          check=False)
    problems = [line for line in done.stderr.splitlines() if unit.name in line
                and "Special user" not in line and "is not a valid user" not in line]
    assert not problems, done.stderr


# --- the serving gate ---------------------------------------------------------------------------------------

def test_gate_unit_runs_the_gate_as_llama_servers_user_with_a_runtime_folder() -> None:
    unit = render_gate_unit(user="llm", header="# managed")
    found = directives(unit)
    assert ("Service", "User", "llm") in found
    assert ("Service", "RuntimeDirectory", GATE_RUNTIME_DIR) in found
    assert ("Service", "Restart", "always") in found
    assert ("Unit", "After", "network-online.target " + LLAMA_SERVER_UNIT) in found
    (start,) = [value for section, key, value in found if key == "ExecStart"]
    assert start.split() == [*HOST_PYTHON, GATE_MODULE, "--config", GATE_CONFIG_PATH]
    # no device at all: the CPU policy
    assert not [node for nodes in NODES.values() for node in nodes if reachable(unit, node)]
    assert unit.startswith("# managed\n")


def test_gate_unit_sets_its_open_files_on_purpose() -> None:
    """LimitNOFILE well above systemd's default soft limit (1024, which ran out near 1,000 idle connections), with
    the reason in the unit itself; the other units keep systemd's default."""
    unit = render_gate_unit()
    assert ("Service", "LimitNOFILE", str(GATE_LIMIT_NOFILE)) in directives(unit) and GATE_LIMIT_NOFILE >= 16 * 1024
    assert "# Limits, on purpose. LimitNOFILE=%d:" % GATE_LIMIT_NOFILE in unit
    assert not [key for _section, key, _value in directives(unit) if key in ("MemoryMax", "TasksMax")]
    assert "LimitNOFILE" not in render_rpc_guard_unit({50052: "u.service"})
    assert "LimitNOFILE" not in render_systemd_unit(["/bin/true"])


@pytest.mark.parametrize("name", ["../etc", "a/b", "", "x y"])
def test_runtime_directory_is_one_folder_name(name: str) -> None:
    if not name:
        assert "RuntimeDirectory" not in render_systemd_unit(["/bin/true"], runtime_directory=name)
        return
    with pytest.raises(UnitError, match="runtime_directory"):
        render_systemd_unit(["/bin/true"], runtime_directory=name)


@needs(SYSTEMD_ANALYZE, "systemd-analyze (systemd)")
def test_gate_unit_verifies_and_scores_like_the_cpu_units(tmp_path: Path) -> None:
    text = render_gate_unit(python=["/bin/true"])
    unit = tmp_path / GATE_UNIT
    unit.write_text(text)
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True,
                          check=False)
    problems = [line for line in done.stderr.splitlines() if unit.name in line
                and "Special user" not in line and "is not a valid user" not in line]
    assert not problems, done.stderr
    assert exposure(tmp_path, "gate-" + GATE_UNIT, text) <= 4.0


def test_rpc_guard_unit_watches_every_rpc_server_of_the_host() -> None:
    unit = render_rpc_guard_unit({50053: "llamafleet-rpc-server-vulkan1.service",
                                  50052: "llamafleet-rpc-server-vulkan0.service"}, stale=25, user="rpcu")
    found = directives(unit)
    (start,) = [value for section, key, value in found if key == "ExecStart"]
    assert shlex.split(start.replace("\\\n", " ")) == [
        *HOST_PYTHON, GATE_MODULE, "guard", "--stale", "25",
        "50052=llamafleet-rpc-server-vulkan0.service", "50053=llamafleet-rpc-server-vulkan1.service"]
    assert ("Service", "User", "rpcu") in found and ("Service", "Restart", "always") in found
    assert not [node for nodes in NODES.values() for node in nodes if reachable(unit, node)]
    with pytest.raises(UnitError, match="at least one rpc-server"):
        render_rpc_guard_unit({})


# --- degraded mode's plan switch ----------------------------------------------------------------------------

def test_plan_switch_units() -> None:
    from llamafleet.core import constants
    from llamafleet.core.systemd_unit import render_plan_switch_units

    service, path = render_plan_switch_units(header="# managed")
    found = directives(service)
    assert ("Service", "Type", "oneshot") in found
    # writes only the runtime drop-ins, talks to systemd over its private socket, no network
    assert ("Service", "ReadWritePaths", "-/run/systemd/system") in found
    assert ("Service", "PrivateNetwork", "yes") in found and ("Service", "RestrictAddressFamilies", "AF_UNIX") in found
    # not ordered after llama-server: its start job may wait for a lost worker, and the switch's job would wait
    assert not [value for section, key, value in found if key in ("After", "Requires", "BindsTo")]
    (start,) = [value for section, key, value in found if key == "ExecStart"]
    assert start.split() == [*constants.HOST_PYTHON, constants.GATE_MODULE, "switch", "--request",
                             constants.PLAN_REQUEST_PATH, "--plans", constants.DEGRADED_PLANS_DIR, "--dropin",
                             constants.PLAN_DROPIN_PATH, "--unit", LLAMA_SERVER_UNIT]
    assert ("Path", "PathChanged", constants.PLAN_REQUEST_PATH) in directives(path)
    assert ("Path", "Unit", constants.PLAN_SWITCH_UNIT) in directives(path)
    assert service.startswith("# managed\n") and path.startswith("# managed\n")


# The plan switch's [Service] as deployed orchestrators have it (llama_server_degrade): it reads the one list
# with its own differences, and a change of these lines would change the unit on every orchestrator.
PLAN_SWITCH_HARDENING_DEPLOYED = [
    "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "PrivateDevices=yes",
    "PrivateNetwork=yes", "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectControlGroups=yes",
    "RestrictAddressFamilies=AF_UNIX", "RestrictNamespaces=yes", "LockPersonality=yes",
    "SystemCallArchitectures=native", "CapabilityBoundingSet=",
    "ReadWritePaths=-/run/systemd/system", "UMask=0022", ""]


def test_plan_switch_hardening_is_the_deployed_one() -> None:
    from llamafleet.core.systemd_unit import render_plan_switch_units  # as test_plan_switch_units does

    service, _path = render_plan_switch_units()
    lines = service.split("\n")
    assert lines[lines.index("NoNewPrivileges=yes"):] == PLAN_SWITCH_HARDENING_DEPLOYED


def test_hardening_is_one_list_with_a_units_differences() -> None:
    assert hardening() == ["%s=%s" % setting for setting in HARDENING]
    changed = hardening({"UMask": "0022", "ProtectHostname": None}, after={"NoNewPrivileges": ["A=1", "B=2"],
                                                                           "ProtectHostname": ["C=3"]})
    assert changed[:4] == ["NoNewPrivileges=yes", "A=1", "B=2", "ProtectSystem=strict"]
    assert "ProtectHostname=yes" not in changed and changed[changed.index("C=3") + 1] == "RestrictSUIDSGID=yes"
    assert changed[-1] == "UMask=0022" and len(changed) == len(HARDENING) + 2
    with pytest.raises(UnitError, match="not a hardening setting: ProtectSystm"):
        hardening({"ProtectSystm": "full"})
    with pytest.raises(UnitError, match="not a hardening setting: Nope"):
        hardening(after={"Nope": ["X=1"]})


@pytest.mark.parametrize("backend", ["cpu", "cuda", None])
def test_service_units_take_the_list_whole_with_their_device_policy(backend: str | None) -> None:
    lines = render_systemd_unit(["/opt/llama-server"], backend=backend, protect_home="read-only").splitlines()
    start = lines.index("NoNewPrivileges=yes")
    expected = hardening({"ProtectHome": "read-only"}, after={"PrivateTmp": device_policy(backend)})
    assert lines[start:start + len(expected)] == expected


def test_exec_dropin_resets_then_replaces_the_start_commands() -> None:
    from llamafleet.core.systemd_unit import render_exec_dropin

    text = render_exec_dropin(["/opt/llama-server", "--rpc", "10.0.0.2:50052"], [["/usr/bin/wait", "10.0.0.2:50052"]],
                              comments=["degraded"])
    assert [(key, " ".join(value.split())) for section, key, value in directives(text)] == [
        ("ExecStartPre", ""), ("ExecStartPre", "/usr/bin/wait 10.0.0.2:50052"), ("ExecStart", ""),
        ("ExecStart", "/opt/llama-server --rpc 10.0.0.2:50052")]
    assert text.startswith("# degraded\n[Service]\n")
