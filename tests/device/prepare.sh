#!/usr/bin/env bash
# Prepares what tests/device/cuda_rpc_check.sh needs on the lent machine, which reaches no network, within the
# device tool's 64 MiB: .devcheck/llama.cpp-src.tar.xz (the lab's pinned llama.cpp source from the controller's
# cache, without its models, docs and examples: about 7.6 MB; scripts/ holds the UI step llama-server builds
# with) and the gguf wheel. .devcheck is ignored by git (add "/.devcheck/" to .git/info/exclude) and carried by the
# call: carry [".devcheck"].
set -eu
cache=${LLAMAFLEET_CACHE:-/var/cache/llamafleet}
# the lab's pinned source (llamafleet/lab/artifacts.py), not whichever other version the cache also holds
version=$(python3 -c 'from llamafleet.lab.artifacts import LLAMA_CPP_PYTHON_VERSION as v; print(v)')
sdist="$cache/src/llama_cpp_python-$version.tar.gz"
[ -f "$sdist" ] || { echo "no $sdist: run make demo or make test once to fill the cache" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf .devcheck && mkdir -p .devcheck
tar -xzf "$sdist" -C "$tmp"
vendor=$(ls -d "$tmp"/*/vendor)
(cd "$vendor" && tar -cJf "$OLDPWD/.devcheck/llama.cpp-src.tar.xz" llama.cpp/CMakeLists.txt llama.cpp/app \
  llama.cpp/cmake llama.cpp/scripts llama.cpp/common llama.cpp/ggml llama.cpp/include llama.cpp/src \
  llama.cpp/tools llama.cpp/vendor llama.cpp/licenses \
  llama.cpp/LICENSE)
# the gguf of the project's lock (requirements/lock.txt), for the machine's Python
python3 -m pip download -q --no-deps --only-binary=:all: -d .devcheck "$(grep -E '^gguf==' requirements/lock.txt)"
ls -la .devcheck
