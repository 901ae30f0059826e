#!/usr/bin/env bash
# Runs make's test stages in order, prints the time of each as it ends and a table at the end (or at the first
# failure, which stops the run). Usage: tests/run_stages.sh MAKE STAGE...
set -u
make_cmd=$1; shift
table=""
started=$(date +%s)
summary() {
  echo "==> time per stage:"
  printf '%s' "$table"
  printf '   %-20s %5d s\n' "in all" $(( $(date +%s) - started ))
}
for stage in "$@"; do
  t=$(date +%s)
  if "$make_cmd" --no-print-directory "$stage"; then rc=0; else rc=$?; fi
  took=$(( $(date +%s) - t ))
  if [ "$rc" = 0 ]; then mark=""; else mark="  FAILED"; fi
  table+=$(printf '   %-20s %5d s%s' "$stage" "$took" "$mark")$'\n'
  echo "==> $stage: ${took} s${mark}"
  if [ "$rc" != 0 ]; then summary; exit "$rc"; fi
done
summary
