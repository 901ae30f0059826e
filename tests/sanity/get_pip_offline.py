"""Stand-in for ansible-test's pip bootstrap script, for machines that reach PyPI but not ci-files.testing.ansible.com.

ansible-test creates each sanity virtual environment without pip and runs
``python get_pip.py --disable-pip-version-check pip==X [--no-setuptools] [--no-wheel]``
with a script it downloads from ci-files.testing.ansible.com.  This script does
the same job with the interpreter's own ``ensurepip`` and then PyPI:
``make sanity`` copies it to ``~/.ansible/test/cache/get_pip_<version>.py``.
"""

import subprocess
import sys

args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade", "--default-pip"])
subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", *args])
