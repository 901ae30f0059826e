# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Every fixed name and default of a llamafleet deployment, in one place.

Modules and module_utils import this file; the library imports it as
``llamafleet.core.constants``; roles and playbooks read it through the lookup
``llamafleet.cluster.constants`` (for example
``lookup('llamafleet.cluster.constants', 'llama_server_unit')``).  Role defaults
that users may override (ports, users, homes) repeat the value here so that
``ansible-doc`` can show it; ``tests/unit/roles/test_constants.py`` fails when
the two drift apart.
"""

from __future__ import annotations

from .backends import BACKENDS as _BACKENDS, build_packages as _build_packages, user_groups as _user_groups

# Inventory groups.
GROUP_FLEET = "llamafleet"
GROUP_ORCHESTRATOR = "llamafleet_orchestrator"
GROUP_WORKERS = "llamafleet_workers"
# The host(s) playbooks/monitoring.yml puts Prometheus (and Grafana) on (the monitoring role); any host, the
# orchestrator included.
GROUP_MONITORING = "llamafleet_monitoring"
# Groups that choose a backend: a host in llamafleet_backend_<backend> (say llamafleet_backend_cuda,
# whose group_vars set llamacpp_build_backend: cuda) builds for that backend; at most one per host.
GROUP_BACKEND_PREFIX = "llamafleet_backend_"
# Why a macOS host is refused (roles' preflight, module_utils/backend_checks.py, systemd_unit.py).
MACOS_UNSUPPORTED = ("macOS hosts are not supported as workers or orchestrator in this release: the rpc_server and "
                     "llama_server roles render systemd units and nftables rules, which are Linux only")

# systemd units. Every llamafleet unit's name starts with UNIT_PREFIX: playbooks/teardown.yml finds them by it
# (module_utils/teardown.py).
UNIT_PREFIX = "llamafleet-"
LLAMA_SERVER_UNIT = "llamafleet-llama-server.service"
RPC_SERVER_UNIT = "llamafleet-rpc-server.service"
# Every unit of a worker (rpc-server, one per device, its guard, firewall and metrics timer) starts with this.
RPC_UNIT_PREFIX = "llamafleet-rpc-"
# One rpc-server per device: the device's ggml name, lower-cased, goes in the middle.
RPC_SERVER_DEVICE_UNIT = "llamafleet-rpc-server-%s.service"
RPC_FIREWALL_UNIT = "llamafleet-rpc-firewall.service"
# The orchestrator's serving gate and watchdog (module_utils/serving_gate.py and its modules, run as a module): it
# owns the clients' port, forwards to llama-server on loopback, answers 503 at once while the
# cluster cannot serve, and restarts llama-server when a worker link stalls.
GATE_UNIT = "llamafleet-gate.service"
# Each worker's guard (the same entry point, ``serving_gate guard``, module_utils/rpc_guard.py): restarts an
# rpc-server that keeps the dead connection of a llama-server lost in a partition while the new one waits.
RPC_GUARD_UNIT = "llamafleet-rpc-guard.service"
# Its runtime folder (systemd RuntimeDirectory=) and the state file `llamafleet status` reads.
GATE_RUNTIME_DIR = "llamafleet-gate"
GATE_STATE_PATH = "/run/" + GATE_RUNTIME_DIR + "/state.json"
# Each worker's textfile metrics (module_utils/rpc_metrics.py run as a script by a oneshot service, started by its
# timer): rpc-server's liveness and cache facts for node_exporter's textfile collector (rpc_server_textfile_metrics).
RPC_METRICS_UNIT = "llamafleet-rpc-metrics.service"
RPC_METRICS_TIMER = "llamafleet-rpc-metrics.timer"
# playbooks/bench.yml: one transient latency proxy (llamafleet/bench/rpcproxy.py) per worker
# endpoint, numbered from 0, and the runtime folder on the orchestrator that holds them.
BENCH_PROXY_UNIT = "llamafleet-bench-proxy-%d.service"
BENCH_RUN_DIR = "/run/llamafleet-bench"

# Ports (role defaults llama_server_port and rpc_server_port).
LLAMA_SERVER_PORT = 8080
# llama-server itself listens on the orchestrator's loopback at this port (role default
# llama_server_backend_port); clients reach it through the edge and the gate on LLAMA_SERVER_PORT.
LLAMA_SERVER_BACKEND_PORT = 18080
# The gate's port on the orchestrator's loopback behind the edge (role defaults llama_server_gate_port and the edge
# role's edge_gate_port); with the edge off (EDGE_KIND none) the gate serves LLAMA_SERVER_PORT itself.
LLAMA_SERVER_GATE_PORT = 18081
RPC_SERVER_PORT = 50052
# Debian's prometheus and prometheus-node-exporter listen here by default (role defaults
# monitoring_prometheus_port and monitoring_node_exporter_port).
PROMETHEUS_PORT = 9090
NODE_EXPORTER_PORT = 9100

# Service users and their homes (role defaults).
LLAMA_SERVER_USER = "llamafleet"
LLAMA_SERVER_HOME = "/var/lib/llamafleet"
RPC_SERVER_USER = "llamafleet-rpc"
RPC_SERVER_HOME = "/var/lib/llamafleet-rpc"
# rpc-server's weight cache lives in $LLAMA_CACHE/rpc; the unit sets LLAMA_CACHE to this, under the home.
RPC_CACHE_SUBDIR = "cache"

# Where builds are installed: <root>/<build id>/bin, and <root>/current -> the build in use.
LLAMACPP_ROOT = "/opt/llamafleet/llama.cpp"
MODEL_DIR = "/var/lib/llamafleet/models"
# llama.cpp backends the llamacpp_build role knows (role default llamacpp_build_backend: cpu); its preflight
# refuses metal (macOS, see MACOS_UNSUPPORTED). Each is described once, in module_utils/backends.py.
LLAMACPP_BACKENDS = tuple(_BACKENDS)
# For the roles, from that table: the service user's groups per backend (roles/_common/tasks/user.yml), and the
# build packages per OS family and backend (roles/llamacpp_build/tasks/packages.yml).
BACKEND_USER_GROUPS = _user_groups()
BACKEND_BUILD_PACKAGES = _build_packages()

# Files the roles write and the CLI reads.
SYSTEMD_DIR = "/etc/systemd/system"
CONFIG_DIR = "/etc/llamafleet"
# The orchestrator's last split plan (rpc_plan's result), as JSON.
PLAN_PATH = CONFIG_DIR + "/plan.json"
# llama-server's API key (given or generated on the first deploy), service user 0600.
API_KEY_PATH = CONFIG_DIR + "/llama-server.key"
# The chat template file shipped from the controller (llama_server_chat_template_file), llama-server's
# --chat-template-file.
CHAT_TEMPLATE_PATH = CONFIG_DIR + "/chat-template.jinja"
# The deployment record (module_utils/deployment_record.py): what the roles made on this host (units, ports,
# paths, users, build, plan, endpoint), versioned JSON; the CLI, bench and teardown read it instead of constants.
DEPLOYMENT_RECORD_PATH = CONFIG_DIR + "/deployment.json"
DEPLOYMENT_RECORD_SCHEMA = 1
# The stamp a whole deploy leaves on each host (module_utils/deploy_stamp.py), root only: the next deploy with the same
# inputs checks it with one module run a host and, when every host is in sync, adds them all to GROUP_IN_SYNC, which
# the deploy's plays leave out (lookup llamafleet.cluster.deploy_hosts).
STAMP_PATH = CONFIG_DIR + "/stamp.json"
GROUP_IN_SYNC = "_llamafleet_in_sync"
# This collection's version (galaxy.yml, pyproject.toml and llamafleet.__version__ agree; a unit test checks).
COLLECTION_VERSION = "0.4.0"
# The workers' nftables rules (rpc_server_firewall).
RPC_FIREWALL_RULES = CONFIG_DIR + "/rpc-firewall.nft"
# Their nftables table, family and name (templates/rpc-firewall.nft.j2 and rpc-firewall.service.j2).
RPC_FIREWALL_TABLE = "inet llamafleet_rpc"
# Where firewalld or ufw also filters (rpc_server_host_firewall, module_utils/host_firewall.py): the rules
# the rpc_server role added there (JSON), so it can remove them, and the comment its ufw rules carry.
HOST_FIREWALL_STATE = CONFIG_DIR + "/host-firewall.json"
HOST_FIREWALL_COMMENT = "llamafleet-rpc"
# The edge (roles/edge): what serves the clients' port in front of the gate when the inventory does not say
# (llamafleet_edge): Debian's HAProxy. The one place this default is written: the edge role (edge_kind) and the
# llama_server role (which puts the gate on loopback behind it) both read it through the lookup. EDGE_KINDS are the
# values llamafleet_edge may take; none is the opt-out (the gate serves the clients' port itself).
EDGE_KIND = "haproxy"
EDGE_KINDS = ("haproxy", "none")
# The folder of the edge's root-only copies of the API key and certificate. It marks an edge the role configured:
# while it exists the llama_server role's preflight lets HAProxy hold the clients' port, and the edge role stops that
# HAProxy when the edge is turned off (llamafleet_edge: none).
EDGE_CONFIG_DIR = "/etc/haproxy/llamafleet"
# The module_utils files that run on the hosts (stdlib only) are installed as the package HOST_PACKAGE
# in LIBEXEC_DIR, the HOST_SCRIPTS of it, and run as modules: HOST_PYTHON + [module, arguments...].
# So they import each other relatively there as they do here (rpc_metrics uses host_observation's parsers).
# GATE_SCRIPTS are the serving gate's modules: serving_gate.py (the entry point of the gate, the guard and the plan
# switch) and the modules it imports, one per concern. The llama_server and rpc_server roles install them with one
# loop over this list, so a new module of the gate is shipped once it is named here (a unit test checks the list).
LIBEXEC_DIR = "/usr/local/libexec/llamafleet"
HOST_PACKAGE = "llamafleet_host"
HOST_PACKAGE_DIR = LIBEXEC_DIR + "/" + HOST_PACKAGE
GATE_SCRIPTS = ("serving_gate.py", "gate_config.py", "http_wire.py", "gate_metrics.py", "host_observation.py",
                "link_state.py", "gate_decision.py", "gate_proxy.py", "gate_watchdog.py", "rpc_guard.py",
                "plan_switch.py", "atomic_file.py", "gate_budget.py")
HOST_SCRIPTS = GATE_SCRIPTS + ("systemd_show.py", "rpc_proto.py", "rpc_metrics.py")
HOST_PYTHON = ("/usr/bin/env", "PYTHONPATH=" + LIBEXEC_DIR, "/usr/bin/python3", "-m")
# The gate's configuration (JSON, written by the llama_server role) and its program.
GATE_CONFIG_PATH = CONFIG_DIR + "/gate.json"
GATE_MODULE = HOST_PACKAGE + ".serving_gate"
# The RPC HELLO client (module_utils/rpc_proto.py) and its wrapper, the llama-server unit's
# ExecStartPre: ``llamafleet-rpc-wait [--timeout S] HOST:PORT ...``.
RPC_WAIT_HELPER = "/usr/local/libexec/llamafleet-rpc-wait"
# The RPC HELLO client itself (the gate probes a lost worker with it, ``--timeout S HOST:PORT``).
RPC_PROBE_MODULE = HOST_PACKAGE + ".rpc_proto"
# The workers' textfile metrics writer (module_utils/rpc_metrics.py; it imports host_observation's parsers).
RPC_METRICS_MODULE = HOST_PACKAGE + ".rpc_metrics"
# node_exporter's textfile collector directory in Debian's prometheus-node-exporter (role defaults
# rpc_server_textfile_dir and monitoring_node_exporter_textfile_dir), and the file the workers write there.
NODE_EXPORTER_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
RPC_METRICS_FILE = "llamafleet_rpc.prom"
# Prometheus jobs of the monitoring role (its file_sd files are named after them; the dashboard selects by them).
PROMETHEUS_JOB_LLAMA_SERVER = "llamafleet-llama-server"
PROMETHEUS_JOB_NODE = "llamafleet-node"
# The serving gate's own metrics (state, restarts, the last model load's duration): a path the gate answers itself
# (gate_metrics.GATE_METRICS_PATH; a test keeps the two equal), scraped on the llama-server targets with the key.
PROMETHEUS_JOB_GATE = "llamafleet-gate"
GATE_METRICS_PATH = "/llamafleet/metrics"
# Degraded mode (llama_server_degrade): the plans without one worker host, each a drop-in for llama-server's unit
# (written by the llama_server role, DEGRADED_PLANS_DIR/without-HOST.conf); the gate asks for one (or "full") in
# PLAN_REQUEST_PATH, and the root switch service (started by its path unit) puts it in place as a runtime
# drop-in, gone at the next boot or deploy, and restarts llama-server.
DEGRADED_PLANS_DIR = CONFIG_DIR + "/plans"
PLAN_REQUEST_PATH = "/run/" + GATE_RUNTIME_DIR + "/plan-request.json"
PLAN_DROPIN_PATH = "/run/systemd/system/" + LLAMA_SERVER_UNIT + ".d/50-llamafleet-plan.conf"
PLAN_SWITCH_UNIT = "llamafleet-plan-switch.service"
PLAN_SWITCH_PATH_UNIT = "llamafleet-plan-switch.path"

# The rpc-server binary (and its CMake target) was renamed over time; newest first.
RPC_SERVER_BINARIES = ("ggml-rpc-server", "rpc-server", "llama-rpc-server")

# llama.cpp's RPC_HASH_THRESHOLD of the sources we know (ggml-rpc.cpp): tensors larger than this
# are announced by hash first.  The build reads the real value from the source it compiled; this
# is only the fallback when nothing was recorded.
RPC_HASH_THRESHOLD = 10 * 1024 * 1024

# Devices a single llama-server can address besides the CPU (GGML_SCHED_MAX_BACKENDS - 1).
MAX_DEVICES = 15


def rpc_cache_dir(home: str = RPC_SERVER_HOME) -> str:
    """rpc-server's cache directory for a service home (``$LLAMA_CACHE/rpc``)."""
    return "%s/%s/rpc" % (home.rstrip("/"), RPC_CACHE_SUBDIR)


def rpc_server_unit(device: str | None = None) -> str:
    """The unit name of the host's rpc-server, or of the one serving ``device``."""
    return RPC_SERVER_DEVICE_UNIT % device.lower() if device else RPC_SERVER_UNIT


def as_dict() -> dict:
    """Every constant by lower-case name (what the lookup plugin serves)."""
    return {name.lower(): value for name, value in globals().items()
            if name.isupper() and not name.startswith("_")}
