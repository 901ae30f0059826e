#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rpc_hello
short_description: Check that a llama.cpp rpc-server answers, and which RPC protocol it speaks
version_added: "0.1.0"
description:
  - Connects to a llama.cpp rpc-server, sends the RPC protocol's HELLO command, reads the protocol
    version it answers (major.minor.patch) and closes the connection at once.
  - rpc-server serves one client at a time, so the probe holds the connection for as short a time as
    possible. While a llama-server is connected to the rpc-server, probes wait and time out; the failure
    message says so. A probe that gives up resets its connection instead of closing it, because
    rpc-server would otherwise answer the abandoned HELLO later and die of SIGPIPE.
  - Retries refused connections and timeouts until O(timeout) seconds have passed, so it can follow the
    start of the service. A peer that answers something other than a HELLO answer fails at once.
  - Runs wherever the task runs; delegate it to the orchestrator to test the path llama-server will use.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.read_only
options:
  host:
    description: Address of the rpc-server (numeric IPv4, as rpc-server binds, or a name).
    type: str
    required: true
  port:
    description: TCP port of the rpc-server.
    type: int
    default: 50052
  timeout:
    description: Seconds to keep trying before failing.
    type: float
    default: 30
  expect_major:
    description:
      - Fail unless the server speaks this RPC protocol major version (llama.cpp requires the client's and
        the server's majors to be equal; in practice build both from the same llama.cpp revision).
      - The roles pass the major the build read from its source (C(llamacpp_build_info.rpc_protocol));
        omitted or V(null), the version is not compared.
    type: int
seealso:
  - module: llamafleet.cluster.rpc_cache_seed
"""

EXAMPLES = r"""
- name: Wait for the workers' rpc-server, probing from the orchestrator
  llamafleet.cluster.rpc_hello:
    host: "{{ hostvars[item].llamafleet_cluster_address }}"
    port: 50052
    timeout: 60
    # the RPC protocol major version the llamacpp_build role read from the source it built
    expect_major: "{{ llamacpp_build_info.rpc_protocol }}"
  delegate_to: "{{ groups['llamafleet_orchestrator'][0] }}"
  loop: "{{ groups['llamafleet_workers'] }}"
"""

RETURN = r"""
version:
  description: The RPC protocol version the server speaks, C(major.minor.patch).
  returned: success
  type: str
  sample: "7.0.0"
major:
  description: Protocol major version.
  returned: success
  type: int
  sample: 7
minor:
  description: Protocol minor version.
  returned: success
  type: int
  sample: 0
patch:
  description: Protocol patch version.
  returned: success
  type: int
  sample: 0
endpoint:
  description: The probed C(host:port).
  returned: always
  type: str
  sample: "10.77.0.11:50052"
attempts:
  description: Probes made until the server answered.
  returned: success
  type: int
  sample: 1
elapsed:
  description: Seconds spent until the server answered.
  returned: success
  type: float
  sample: 0.002
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.constants import RPC_SERVER_PORT
from ansible_collections.llamafleet.cluster.plugins.module_utils.rpc_proto import (
    RPCError,
    format_endpoint,
    wait_for_hello,
)


def run(module: AnsibleModule) -> None:
    """Probe the server and exit the module."""
    host = module.params["host"]
    port = module.params["port"]
    endpoint = format_endpoint(host, port)
    if not 0 < port < 65536:
        module.fail_json(msg="port %d is not a TCP port" % port, endpoint=endpoint)
    try:
        answer = wait_for_hello(host, port, timeout=module.params["timeout"])
    except RPCError as exc:
        module.fail_json(msg="rpc-server at %s did not answer HELLO: %s" % (endpoint, exc.reason), endpoint=endpoint)
    major, minor, patch = answer.version
    version = "%d.%d.%d" % answer.version
    expect = module.params["expect_major"]
    if expect is not None and major != expect:
        module.fail_json(
            msg="rpc-server at %s speaks RPC protocol %s, expected major version %d: build the workers and the "
                "orchestrator from the same llama.cpp revision" % (endpoint, version, expect),
            endpoint=endpoint, version=version, major=major, minor=minor, patch=patch,
        )
    module.exit_json(changed=False, endpoint=endpoint, version=version, major=major, minor=minor, patch=patch,
                     attempts=answer.attempts, elapsed=round(answer.elapsed, 3))


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            host=dict(type="str", required=True),
            port=dict(type="int", default=RPC_SERVER_PORT),
            timeout=dict(type="float", default=30.0),
            expect_major=dict(type="int"),
        ),
        supports_check_mode=True,
    )
    run(module)


if __name__ == "__main__":
    main()
