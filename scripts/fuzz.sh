#!/usr/bin/env bash
# Fuzzes every target of fuzz/ for FUZZ_SECONDS seconds each (default 60), one after the
# other, and fails if any of them found a crash, a hang or a leak. Expects the native
# targets built in build/fuzz (make fuzz builds them) and nebulite installed in .venv.
#
# Per target, under build/fuzz/:
#   corpus/<target>/    inputs libFuzzer found interesting, kept for the next run
#                       (fuzz/corpus/<target>/ holds the seeds, which are never written)
#   crashes/<target>/   the inputs that failed (crash-*, timeout-*, leak-*, oom-*)
#   <target>.log        libFuzzer's output
# To replay one: build/fuzz/manifest_fuzz build/fuzz/crashes/manifest_fuzz/crash-...
#            or: .venv/bin/python fuzz/agent_protocol_fuzz.py build/fuzz/crashes/agent_protocol_fuzz/crash-...
set -uo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}
out=build/fuzz
failed=()
for source in fuzz/*_fuzz.cc fuzz/*_fuzz.py; do
  target=$(basename "${source%.*}")
  case $source in
    *.py) cmd=(.venv/bin/python "$source") ;;  # atheris: libFuzzer for Python
    *) cmd=("$out/$target") ;;
  esac
  mkdir -p "$out/corpus/$target" "$out/crashes/$target"
  args=(-max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1
        -artifact_prefix="$out/crashes/$target/")
  [ -f "fuzz/$target.dict" ] && args+=(-dict="fuzz/$target.dict")
  start=$(date +%s)
  "${cmd[@]}" "${args[@]}" "$out/corpus/$target" "fuzz/corpus/$target" >"$out/$target.log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/$target.log" | tail -1)
  echo "fuzz: $target: ${runs:-?} inputs in $(($(date +%s) - start)) s, exit status $rc"
  if [ $rc -ne 0 ]; then
    failed+=("$target")
    tail -n 40 "$out/$target.log"
    echo "fuzz: $target failed; the input is in $out/crashes/$target/, the log in $out/$target.log"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: no crash in ${seconds} s of each target"
