#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: link_rtt
short_description: Measure the round trip from this host to each RPC worker's host
version_added: "0.3.0"
description:
  - Sends O(count) ICMP echo requests, one at a time, to the host of every endpoint in O(endpoints) and adds the
    median round trip as C(rtt_ms) to each endpoint, the input M(llamafleet.cluster.rpc_plan) takes for its
    O(llamafleet.cluster.rpc_plan#module:policy=balanced) to weigh extra network hops against what they give.
  - Each host is pinged once, however many endpoints it has.
  - ICMP, not the rpc port, because rpc-server serves one client at a time with a backlog of one, and probe
    connections would queue behind a connected llama-server.
  - A host that answers no echo gets C(rtt_ms=null) (the planner then treats its link as unmeasured) and a
    warning; nothing fails.
  - Needs a raw ICMP socket (root, CAP_NET_RAW) or a group in C(net.ipv4.ping_group_range).
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.read_only
options:
  endpoints:
    description:
      - Worker endpoints, as the rpc_server role publishes them (C(rpc_server_endpoints)); each needs C(address),
        the other keys are returned as they came.
    type: list
    elements: dict
    required: true
  count:
    description: Echo requests per host; the median of those answered is the figure.
    type: int
    default: 5
  timeout:
    description: Seconds to wait for each answer.
    type: float
    default: 1.0
seealso:
  - module: llamafleet.cluster.rpc_plan
"""

EXAMPLES = r"""
- name: Measure the links, then plan with them
  llamafleet.cluster.link_rtt:
    endpoints: "{{ groups['llamafleet_workers'] | map('extract', hostvars, 'rpc_server_endpoints') | flatten }}"
  register: links

- name: Plan
  llamafleet.cluster.rpc_plan:
    model: /var/lib/llamafleet/models/model.gguf
    workers: "{{ links.endpoints }}"
"""

RETURN = r"""
endpoints:
  description: O(endpoints), each with C(rtt_ms) added (the median round trip in ms, null when unmeasured).
  returned: always
  type: list
  elements: dict
  sample: [{"host": "lab2", "address": "10.77.0.12", "port": 50052, "rtt_ms": 0.06}]
hosts:
  description: Per address, C(rtt_ms), C(min_ms), C(max_ms), C(lost) and C(error) when no socket could be used.
  returned: always
  type: dict
  sample: {"10.77.0.12": {"rtt_ms": 0.06, "min_ms": 0.041, "max_ms": 0.093, "lost": 0}}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.link_rtt import measure_endpoints


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            endpoints=dict(type="list", elements="dict", required=True),
            count=dict(type="int", default=5),
            timeout=dict(type="float", default=1.0),
        ),
        supports_check_mode=True,
    )
    count, timeout = module.params["count"], module.params["timeout"]
    if count < 1:
        module.fail_json(msg="count is %d, expected at least 1 echo per host" % count)
    if not timeout > 0:
        module.fail_json(msg="timeout is %r, expected seconds > 0" % timeout)
    missing = [i for i, e in enumerate(module.params["endpoints"]) if not e.get("address")]
    if missing:
        module.fail_json(msg="endpoints %s have no address" % missing)
    endpoints, hosts = measure_endpoints(module.params["endpoints"], count, timeout)
    for address, figures in hosts.items():
        if figures["rtt_ms"] is None:
            module.warn("%s answered none of %d ICMP echoes%s: its round trip is unmeasured, so the planner will not "
                        "weigh it" % (address, count, " (%s)" % figures["error"] if "error" in figures else ""))
    module.exit_json(changed=False, endpoints=endpoints, hosts=hosts)


if __name__ == "__main__":
    main()
