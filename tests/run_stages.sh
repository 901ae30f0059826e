#!/usr/bin/env bash
# Runs make's test stages, prints the time of each as it ends and a table at the end.
# Usage: tests/run_stages.sh MAKE [--first "STAGE..."] [--beside "STAGE..."] [--nice "STAGE..."] STAGE...
# The --first stages run in order before anything else starts (make check: the unit tests that bound wall-clock
# times, which others running beside would starve); a failure there stops everything.
# The STAGEs run in order; the first failure stops them. The --beside stages (those that need neither the lab nor a
# llama.cpp build: the fast tier) run at the same time, one after another, while the lab stages mostly wait on
# hosts; each writes its output to a log that is printed when it ends. The exit status is the first failure's, if any.
# The --nice stages run at the lowest CPU priority (nice 19): the lab stages (the longest path, CPU-bound on a 2-core
# machine) lose little to them. Stages with timing-sensitive tests (unit: the rpcproxy's rate cap) are not niced:
# starved, they measure the starving, not the code.
# The virtual environment is ready before this runs (make test: venv), so the stages do not install into it again
# (two installs at once into one environment could break it).
set -u
make_cmd=$1; shift
first=""
beside=""
niced=""
while :; do
  case "${1:-}" in
    --first) first=$2; shift 2 ;;
    --beside) beside=$2; shift 2 ;;
    --nice) niced=$2; shift 2 ;;
    *) break ;;
  esac
done
export LLAMAFLEET_VENV_READY=1
started=$(date +%s)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# run_stage STAGE: runs it (at nice 19 when it is one of --nice), prints its time, records "STAGE SECONDS RC" in
# $logs/times; returns its status
run_stage() {
  local stage=$1 t rc mark="" prefix=()
  case " $niced " in *" $stage "*) prefix=(nice -n 19) ;; esac
  t=$(date +%s)
  if "${prefix[@]}" "$make_cmd" --no-print-directory "$stage"; then rc=0; else rc=$?; fi
  [ "$rc" = 0 ] || mark="  FAILED"
  echo "==> $stage: $(( $(date +%s) - t )) s$mark"
  echo "$stage $(( $(date +%s) - t )) $rc" >> "$logs/times"
  return "$rc"
}

# print_times: the table of every stage's time so far, and the time in all
print_times() {
  local stage took stage_rc mark
  echo "==> time per stage:"
  while read -r stage took stage_rc; do
    mark=""
    [ "$stage_rc" = 0 ] || mark="  FAILED"
    printf '   %-20s %5d s%s\n' "$stage" "$took" "$mark"
  done < "$logs/times"
  printf '   %-20s %5d s\n' "in all" $(( $(date +%s) - started ))
}

for stage in $first; do
  run_stage "$stage" || { rc=$?; print_times; exit "$rc"; }
done

if [ -n "$beside" ]; then
  (
    for stage in $beside; do
      run_stage "$stage" > "$logs/beside-$stage.log" 2>&1
      rc=$?
      echo "==> $stage (beside the others) ended: its output"
      cat "$logs/beside-$stage.log"
      [ "$rc" = 0 ] || exit "$rc"
    done
  ) &
  beside_pid=$!
fi

rc=0
for stage in "$@"; do
  run_stage "$stage" || { rc=$?; break; }
done
if [ -n "$beside" ]; then
  wait "$beside_pid"
  beside_rc=$?
  [ "$rc" != 0 ] || rc=$beside_rc
fi

print_times
exit "$rc"
