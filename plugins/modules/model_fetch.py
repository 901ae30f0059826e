#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_fetch
short_description: Fetch pinned GGUF model files, resumably, verified by sha256
version_added: "0.1.0"
description:
  - Downloads each model file (a single GGUF or every shard of a split GGUF) from its URL into O(dest),
    through a C(.part) file that a later run resumes with an HTTP range request.
  - Verifies every file against its pinned sha256. A file already in place is verified where it lies
    and never downloaded again; a marker next to it lets later runs skip the hash.
  - Checks that the URLs answer and that the destination has room for what is missing before anything
    is written, so bad input fails before the host changes.
  - Before that, reads the start of every file it must fetch with HTTP range requests (growing the range until
    the GGUF tensor table is parsed, at most 64 MiB) and refuses a file that is not GGUF (a login or error page
    served with 200, named by its media type and first bytes), one shorter than its header says (truncated at the
    source, which a sha256 pinned for that file does not catch) and an architecture the planner does not know.
  - Every request (the HEAD, the header check's ranges, the download and its resumes) carries O(token) and
    O(headers). They go to the host of the file's URL only; a redirect to another host (Hugging Face sends
    downloads to a CDN with a signed URL) gets neither unless O(auth_redirect_hosts) names that host, and
    none goes from https to plain http. Neither appears in the result or in an error.
  - Connection errors, timeouts, a dropped connection, HTTP 429 and HTTP 5xx (except 501, 505 and 511) are retried
    O(retries) times with a backoff from O(retry_delay) (doubled each time, at most 60 s) or the server's
    C(Retry-After) (at most 300 s; a server asking for longer fails the task). A download continues from the
    bytes already written, and an attempt that fetched 1 MiB or more starts the count again. Other HTTP errors
    fail at once, naming the server, the URL (without its password or query string) and the setting to fix.
author: llamafleet maintainers (@llamafleet)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - llamafleet.cluster.attributes
  - llamafleet.cluster.attributes.files
options:
  files:
    description: Model files in shard order.
    type: list
    elements: dict
    required: true
    suboptions:
      url:
        description: Where to download the file from (a Hugging Face resolve URL, a mirror, ...).
        type: str
        required: true
      sha256:
        description: The file's sha256, 64 hex digits.
        type: str
        required: true
      name:
        description: File name in O(dest); defaults to the last component of the URL path.
        type: str
  dest:
    description: Directory for the model files; created if missing.
    type: path
    required: true
  owner:
    description: Owner of the files.
    type: str
  group:
    description: Group of the files.
    type: str
  mode:
    description: Mode of the files.
    type: raw
    default: "0644"
  free_margin_mib:
    description: Free space to leave on the destination's file system beyond the model.
    type: int
    default: 1024
  timeout:
    description: Network timeout in seconds for each request.
    type: int
    default: 60
  label:
    description: How errors name O(files), e.g. V(model_files) gives C(model_files[0]).
    type: str
    default: files
  token:
    description:
      - "A bearer token sent as C(Authorization: Bearer <token>) (a Hugging Face access token for a gated or
        private repository). A value that starts with C(Bearer ) is taken as is."
      - Never logged; sent to the URL's host (and O(auth_redirect_hosts)) only.
    type: str
  headers:
    description:
      - Extra HTTP headers for every request, name to value (for example an API key header of a private mirror).
      - Never logged; sent like O(token). C(Range), C(Host), C(Content-Length), C(Transfer-Encoding) and
        C(Connection) are the download's own; an C(Authorization) header here excludes O(token).
    type: dict
    default: {}
  auth_redirect_hosts:
    description:
      - Host names that a redirect may take O(token) and O(headers) to, besides the host of each file's URL.
        Empty by default, so a redirect to another host (a CDN) never receives them.
    type: list
    elements: str
    default: []
  retries:
    description: How many times a transient failure is retried, in a row, before the task fails (0 never retries).
    type: int
    default: 5
  retry_delay:
    description: Seconds before the first retry; each further one waits twice as long (at most 60 s).
    type: float
    default: 5
  progress:
    description:
      - A file to keep the download's progress in while it runs (JSON, rewritten at most once a second, removed
        when the module ends), with the bytes done and to fetch, the recent rate, which file of how many and a retry
        it waits for; never a URL or a credential. For a task run with C(async), awaited by M(llamafleet.cluster.await_progress)
        with its O(llamafleet.cluster.await_progress#module:progress_file). Not written in check mode, nor when
        every file is in place.
    type: path
    version_added: "0.4.0"
  facts:
    description:
      - Also return RV(model_facts), what the split planner needs to know about the model, from the GGUF headers (a
        file in place and verified is read on this host, the others over HTTP ranges, checked as every file to fetch is).
      - The model role's preflight asks for them, so that the orchestrator's fit check runs before the model is fetched.
    type: bool
    default: false
    version_added: "0.4.0"
  labels:
    description:
      - How errors name the settings to fix, for callers with other names (the model role passes its variables).
        Keys V(token), V(headers), V(auth_redirect_hosts), V(retries); a missing key names the option itself.
    type: dict
    default: {}
"""

EXAMPLES = r"""
- name: Fetch a split model
  llamafleet.cluster.model_fetch:
    dest: /var/lib/llamafleet/models/big
    files:
      - url: https://huggingface.co/org/repo/resolve/0123abc/model-00001-of-00002.gguf
        sha256: "5d1cf0b2ad0fa8c7c3dd0bd1d1a8f4c4c0e21aa6f7f9a8f4bfae9a1c0f1e2d3a"
      - url: https://huggingface.co/org/repo/resolve/0123abc/model-00002-of-00002.gguf
        sha256: "9a3e8c1d7f2b4a6e0c5d8f1a3b7e9c2d4f6a8b0c1e3d5f7a9b2c4e6f8a0b1c3d"

- name: Fetch a gated model with a Hugging Face token (from a vault), retrying a flaky link longer
  llamafleet.cluster.model_fetch:
    dest: /var/lib/llamafleet/models/gated
    files:
      - url: https://huggingface.co/org/gated/resolve/0123abc/model.gguf
        sha256: "5d1cf0b2ad0fa8c7c3dd0bd1d1a8f4c4c0e21aa6f7f9a8f4bfae9a1c0f1e2d3a"
    token: "{{ vault_hf_token }}"
    retries: 10

- name: Fetch in the background, keeping a progress file
  llamafleet.cluster.model_fetch:
    dest: /var/lib/llamafleet/models/big
    files: "{{ model_files }}"
    progress: /var/lib/llamafleet/models/big/.fetch-progress.json
  async: 86400
  poll: 0
  register: fetch_job

- name: Wait for it, with a line of bytes and rate every 15 s
  llamafleet.cluster.await_progress:
    what: model big
    jid: "{{ fetch_job.ansible_job_id }}"
    timeout: 86400
    progress_file: /var/lib/llamafleet/models/big/.fetch-progress.json
    every: 15
  register: fetched
"""

RETURN = r"""
paths:
  description: Absolute paths of the model files, in shard order.
  returned: always
  type: list
  elements: str
fetched:
  description: Names of the files downloaded (or, in check mode, that would be).
  returned: always
  type: list
  elements: str
bytes_needed:
  description: Bytes that had to be (or would be) downloaded.
  returned: always
  type: int
free_bytes:
  description: Free bytes on the destination before downloading.
  returned: always
  type: int
model_facts:
  description:
    - The split planner's facts about the model (C(model_facts) of C(module_utils/gguf_facts.py)), what
      M(llamafleet.cluster.rpc_plan) takes as O(llamafleet.cluster.rpc_plan#module:model_facts).
  returned: when O(facts) is true
  type: dict
retried:
  description: One line per retry of a transient failure (the file, its URL without secrets, what failed, the wait).
  returned: always
  type: list
  elements: str
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llamafleet.cluster.plugins.module_utils.fetch import (
    FetchError,
    FileSpec,
    Http,
    check_headers,
    check_space,
    download,
    header_facts,
    plan,
)
from ansible_collections.llamafleet.cluster.plugins.module_utils.fetch_policy import Names
from ansible_collections.llamafleet.cluster.plugins.module_utils.fetch_progress import ProgressFile


def http_of(params: dict) -> Http:
    """The requests' settings from the module's parameters; FetchError for bad headers or labels."""
    try:
        names = Names.of(params["label"], params["labels"])
    except ValueError as exc:
        raise FetchError(str(exc)) from None
    return Http(timeout=params["timeout"], token=params["token"] or "", headers=params["headers"] or {},
                auth_redirect_hosts=tuple(params["auth_redirect_hosts"] or ()), retries=max(0, params["retries"]),
                retry_delay=max(0.0, params["retry_delay"]), names=names)


def run(module: AnsibleModule) -> dict:
    params = module.params
    dest = params["dest"]
    http = None
    try:
        http = http_of(params)
        specs = [FileSpec(url=f["url"], sha256=f["sha256"], name=f.get("name") or "") for f in params["files"]]
        if not specs:
            raise FetchError("no model files given")
        states = plan(specs, dest, http, record=not module.check_mode)
        facts = header_facts(states, http) if params["facts"] else check_headers(states, http)
        needed, free = check_space(states, dest, params["free_margin_mib"] * 1024 * 1024)
    except FetchError as exc:
        module.fail_json(msg=str(exc), retried=http.notes if http else [])
    todo = [s for s in states if s.action != "none"]
    result = {
        "changed": bool(todo),
        "paths": [s.path for s in states],
        "fetched": [s.spec.name for s in todo],
        "bytes_needed": needed,
        "free_bytes": free,
        "retried": http.notes,
        **({"model_facts": facts} if params["facts"] else {}),
        "warnings_": [n for s in states for n in s.notes],
        "diff": {
            "before": "".join(f"{s.spec.name}: {'verified' if s.verified else 'missing'}\n" for s in states),
            "after": "".join(f"{s.spec.name}: {s.spec.sha256}\n" for s in states),
        },
    }
    if module.check_mode:
        return result
    if todo and not os.path.isdir(dest):
        os.makedirs(dest, mode=0o755, exist_ok=True)
    progress = ProgressFile(params["progress"], [s.remote_size for s in todo]) if params["progress"] and todo else None
    if progress:
        http.sleep = lambda delay: (progress.waiting("retrying in %g s" % delay), time.sleep(delay))[1]
    try:
        for state in todo:
            if progress:
                progress.begin(state.spec.name, state.partial_bytes if state.action == "resume" else 0)
            try:
                download(state, http, report=progress.update if progress else lambda size: None)
            except FetchError as exc:
                module.fail_json(msg=str(exc), fetched=[s.spec.name for s in todo if os.path.isfile(s.path)],
                                 retried=http.notes)
            if progress:
                progress.end(os.path.getsize(state.path))
    finally:
        if progress:
            progress.close()
    for state in states:
        file_args = module.load_file_common_arguments(
            {"path": state.path, "owner": params["owner"], "group": params["group"], "mode": params["mode"]}
        )
        result["changed"] = module.set_fs_attributes_if_different(file_args, result["changed"])
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            files=dict(
                type="list",
                elements="dict",
                required=True,
                options=dict(
                    url=dict(type="str", required=True),
                    sha256=dict(type="str", required=True, no_log=False),
                    name=dict(type="str"),
                ),
            ),
            dest=dict(type="path", required=True),
            owner=dict(type="str"),
            group=dict(type="str"),
            mode=dict(type="raw", default="0644"),
            free_margin_mib=dict(type="int", default=1024),
            timeout=dict(type="int", default=60),
            label=dict(type="str", default="files"),
            token=dict(type="str", no_log=True),
            headers=dict(type="dict", default={}, no_log=True),
            auth_redirect_hosts=dict(type="list", elements="str", default=[]),
            retries=dict(type="int", default=5),
            retry_delay=dict(type="float", default=5),
            labels=dict(type="dict", default={}),
            progress=dict(type="path"),
            facts=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    result = run(module)
    for note in result.pop("warnings_"):
        module.warn(note)
    if not module._diff:
        result.pop("diff")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
