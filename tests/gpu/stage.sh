# shellcheck shell=bash
# `stage NAME LIMIT_S COMMAND...`: run COMMAND under a time limit (TERM, then KILL 10 s later),
# print it as it goes and log it to $out/NAME.log, and keep the worst status in $status.
# Sourced by tests/gpu/run.sh; tests/test_benchmarks.py runs it on its own.
out="${out:-bench-output}"
status="${status:-0}"
started="${started:-$SECONDS}"
stage() {
  local name=$1 limit=$2
  shift 2
  mkdir -p "$out"
  echo "== $name (limit ${limit}s, at +$((SECONDS - started))s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "== $name: ran past its ${limit}s limit"
  echo "== $name: exit $rc after +$((SECONDS - started))s"
  [ "$rc" -eq 0 ] || status=$rc
}
