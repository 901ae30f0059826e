#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: await_progress
short_description: Wait for an async job or an HTTP answer on a host, with a progress line instead of retries
version_added: "0.4.0"
description:
  - Runs on the controller (an action plugin, no module of its own on the host). It waits until the async job
    O(jid) on the host has finished, or until O(url), fetched on the host, answers with one of O(status_code).
  - "Every O(every) seconds it prints one line, C(HOST: WHAT: PHASE, 3m20s elapsed, about 4m20s left) and the
    time the last run took, in place of a task's C(FAILED - RETRYING) lines. The phase is the last line of
    O(phase_log) that starts with O(phase_marker), with the build's progress after it (cmake's C([ 45%]) or Ninja's C([12/345]));
    for a job that keeps a progress file (O(progress_file), as M(llamafleet.cluster.model_fetch) does), its bytes
    done of the total, its rate and which file of how many; for a URL, the last answer (its status and error
    message). The estimate is O(estimate), or the newest of the JSON records O(history) whose values equal
    O(history_match)."
  - After O(timeout) seconds it fails with a message that names the host, the work and the variable O(timeout_var)
    that sets the timeout, with the output of O(diagnose). A job that failed is reported the same way, with its
    return code; the task then fails.
  - The job is Ansible's own (a task with C(async) and C(poll) 0); Ansible stops it at its own C(async) time,
    which should equal O(timeout).
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
attributes:
  check_mode:
    support: full
    details: Waits for nothing and reports the task skipped.
  diff_mode:
    support: none
  action:
    description: Indicates this has a corresponding action plugin, so some parts of the work run on the controller.
    support: full
    details: Runs on the controller; the host runs async_status or uri for it.
options:
  what:
    description: The work, as the progress lines and errors name it.
    type: str
    required: true
  jid:
    description: The async job to wait for (C(ansible_job_id) of the task that started it).
    type: str
  url:
    description: The URL to fetch on the host until it answers with one of O(status_code).
    type: str
  status_code:
    description: The HTTP status codes that end the wait.
    type: list
    elements: int
    default: [200]
  validate_certs:
    description: Whether to check the URL's TLS certificate.
    type: bool
    default: true
  request_timeout:
    description: Seconds each request may take.
    type: int
    default: 10
  timeout:
    description: Seconds to wait before failing.
    type: int
    required: true
  timeout_var:
    description: The variable that sets O(timeout), named in the error.
    type: str
    default: ""
  poll:
    description: Seconds between two checks.
    type: int
    default: 5
  every:
    description: Seconds between two progress lines.
    type: int
    default: 30
  phase_log:
    description: A log on the host whose marked lines say the phase of the work.
    type: str
  phase_marker:
    description: What a phase line of O(phase_log) starts with.
    type: str
    default: "==> "
  progress_file:
    description:
      - A JSON file on the host that the job rewrites as it goes (M(llamafleet.cluster.model_fetch)'s
        O(llamafleet.cluster.model_fetch#module:progress)), read before each progress line; C(done), C(total) and
        C(rate) (bytes, bytes per second), C(index) and
        C(count) (files), C(phase) and C(note). Before the job writes it, and after it removes it, O(phase_log)
        says the phase.
    type: str
  host:
    description: How the lines and errors name the host (V(controller) for a task delegated to it); by default the
      host the task runs on (the delegated one).
    type: str
  estimate:
    description: Seconds the work took last time (else read from O(history)).
    type: float
  history:
    description: A glob of JSON records of earlier runs on the host (letters, digits and C(_./*?@+-); with other
      characters there is no estimate).
    type: str
  history_match:
    description: The values a record of O(history) must have to count.
    type: dict
    default: {}
  history_key:
    description: The key of a record that holds its duration in seconds (the newest record by C(built_at) counts).
    type: str
    default: build_seconds
  diagnose:
    description: A command (argv) run on the host on a timeout or failure; its output ends the error message.
    type: list
    elements: str
  hint:
    description: A sentence added to the error message.
    type: str
    default: ""
seealso:
  - module: ansible.builtin.async_status
  - module: ansible.builtin.uri
"""

EXAMPLES = r"""
- name: Compile, in the background
  ansible.builtin.command:
    argv: [bash, /var/cache/llamafleet/build/build.sh]
  async: 7200
  poll: 0
  register: job

- name: Wait for the compile, with its phase and an estimate from the last build
  llamafleet.cluster.await_progress:
    what: compile llama.cpp
    jid: "{{ job.ansible_job_id }}"
    timeout: 7200
    timeout_var: llamacpp_build_timeout
    phase_log: /var/cache/llamafleet/build/build.log
    history: /opt/llamafleet/llama.cpp/*/BUILDINFO.json
    history_match: {backend: cpu}
    diagnose: [tail, -n, "40", /var/cache/llamafleet/build/build.log]

- name: Wait for the model to load
  llamafleet.cluster.await_progress:
    what: llama-server loading the model
    url: http://127.0.0.1:8080/health
    timeout: 900
    timeout_var: llama_server_health_timeout
    poll: 3
    every: 15
"""

RETURN = r"""
elapsed:
  description: Seconds waited.
  returned: success
  type: float
estimate:
  description: The estimate the progress lines used (null without one).
  returned: success
  type: float
status:
  description: The URL's last HTTP status.
  returned: with O(url)
  type: int
rc:
  description: The job's return code (with the rest of its result, as async_status returns it).
  returned: with O(jid)
  type: int
"""
