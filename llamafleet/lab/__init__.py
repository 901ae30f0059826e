"""The lab: real Debian hosts (systemd-nspawn containers booting systemd) on this one machine.

Public API::

    from llamafleet.lab import Lab, ssh, shape, publish, lab_group_vars

    lab = Lab(hosts=3)
    lab.up()                          # lab1..lab3 at 10.77.0.11.., inventory written
    lab.ssh("lab2", "uname -r")       # CompletedProcess; raises LabError on failure
    shape("lab2", "30mbit")           # tbf both ways on lab2's link; shape("lab2", None) clears
    url = publish("/tmp/x.gguf", "models")   # -> http://10.77.0.1:8089/models/x.gguf
    lab.status(); lab.down()
"""

from .artifacts import LLAMA_CPP_COMMIT, LLAMA_CPP_SOURCE, MODEL, MODEL_NAME
from .core import HostStatus, Lab, LabStatus, leftovers, shape, ssh
from .inventory import lab_group_vars
from .mirror import MIRROR_URL, publish
from .net import BRIDGE, GATEWAY, LabHost
from .paths import LabPaths
from .proxy import PROXY_URL
from .system import LabError

__all__ = [
    "BRIDGE", "GATEWAY", "LLAMA_CPP_COMMIT", "LLAMA_CPP_SOURCE", "MIRROR_URL", "MODEL", "MODEL_NAME", "PROXY_URL",
    "HostStatus", "Lab", "LabError", "LabHost", "LabPaths", "LabStatus",
    "lab_group_vars", "leftovers", "publish", "shape", "ssh",
]
