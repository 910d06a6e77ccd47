# shellcheck shell=bash
# Shared by the benchmark suites (source it): `run NAME COMMAND...` runs one benchmark into
# $out/NAME.log under a time limit (LIMIT seconds, default 300; SIGABRT so Python prints its
# stacks), then prints its exit code, duration and the log's tail (TAIL lines, default 12).
out=${out:?set out (the output folder) before sourcing suite_lib.sh}
export PYTHONFAULTHANDLER=1
run() {
  local name=$1; shift
  local began=$SECONDS
  timeout -s ABRT "${LIMIT:-300}" "$@" >"$out/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - began)) s: $*"
  grep -v "capturing a CUDA graph" "$out/$name.log" | tail -n "${TAIL:-12}"
}
