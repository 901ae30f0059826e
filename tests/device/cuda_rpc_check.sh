#!/usr/bin/env bash
# The CUDA check a session runs when it is lent an NVIDIA machine (the device tool's run; nothing here runs in
# make test, which has no GPU). From the repository root, in one call:
#   OUT=DIR [PHASES="run serve"] tests/device/cuda_rpc_check.sh
# It builds llama.cpp's CUDA backend for that GPU alone with the CMake arguments the llamacpp_build role renders
# (module_utils/llamacpp_build.cmake_args: CUDA on, native, CMAKE_CUDA_ARCHITECTURES of the GPU), then
# tests/device/cuda_rpc_check.py probes the devices as gpu_facts does, starts rpc-server with the argv the
# rpc_server role renders, and loads a synthetic model through it. It writes to OUT: nvidia-smi.txt,
# nvidia-smi_query_nounits.txt (gpu_probe's query), ggml-rpc-server_help.txt, rpc-server_listing.txt (its device
# listing, as gpu_probe reads it), report.json, llama-bench.txt, rpc-server.log and build.log (phase run); serve.json
# and llama-server-SHAPE.log (phase serve: the planned split served by llama-server through that rpc-server, for
# an orchestrator without a GPU and one with its own).
# Needs, carried (.devcheck, ignored by git: see the README's "A lent GPU"): llama.cpp-src.tar.xz, the lab's
# llama.cpp source without its models and docs, and the gguf wheel (the synthetic model's writer).
set -u
out=${OUT:?set OUT to the folder for the results}
work=/tmp/llamafleet-cuda
log() { printf '[%s] %s\n' "$(date +%T)" "$*"; }
rm -rf "$work" && mkdir -p "$work"
export PYTHONPATH=$PWD:/tmp/llamafleet-site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/llamafleet-site .devcheck/gguf-*.whl || exit 1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=index,name,memory.total,memory.free,uuid --format=csv,noheader,nounits \
  > "$out/nvidia-smi_query_nounits.txt"
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '. ')
log "GPU compute capability $cap, $(nproc) CPUs; nvcc: $(nvcc --version | tail -n 1)"
for t in .devcheck/llama.cpp-src*.tar.xz; do tar -xJf "$t" -C "$work"; done
mapfile -t args < <(python3 -m tests.device.cuda_rpc_check args "$cap")
log "cmake ${args[*]}"
cmake -S "$work/llama.cpp" -B "$work/build" -G Ninja "${args[@]}" > "$out/build.log" 2>&1 \
  || { tail -n 40 "$out/build.log"; exit 1; }
phases=${PHASES:-run serve}
targets=(ggml-rpc-server)
case " $phases " in *" run "*) targets+=(llama-bench) ;; esac
case " $phases " in *" serve "*) targets+=(llama-server) ;; esac
log "building ${targets[*]}"
started=$(date +%s)
timeout "${BUILD_TIMEOUT:-450}" cmake --build "$work/build" -j "$(nproc)" --target "${targets[@]}" \
  >> "$out/build.log" 2>&1 || { log "build failed or timed out"; tail -n 30 "$out/build.log"; exit 1; }
log "built in $(( $(date +%s) - started )) s"
bin=$work/build/bin
"$bin/ggml-rpc-server" -d __llamafleet_probe__ > "$out/rpc-server_listing.txt" 2>&1
cat "$out/rpc-server_listing.txt"
rc=0
for phase in $phases; do
  timeout 400 python3 -m tests.device.cuda_rpc_check "$phase" "$bin" "$out" "$work" || rc=$?
done
log "done (rc=$rc)"
exit $rc
