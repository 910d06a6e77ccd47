# Sourced by the device calls (bench/next/callNN.sh): the pieces they repeat.
#   gpu_tests FILES... -- K        the GPU tests FILES selected by -k K into $OUT/tests.txt
#   batch1_ab ROUNDS MODEL...      `bench latency` at batch 1, main (.stage/base) -> this tree,
#                                  ROUNDS rounds a model, into $OUT/MODEL and
#                                  $OUT/variants-MODEL.txt (`batch1_variants` of the two)
#                                  (AB_ARGS: more arguments, e.g. a quantization; AB_TAG: a
#                                  suffix of those names)
#   batch1_trace MODEL             a batch-1 step's trace into $OUT/trace-MODEL.json.gz
#   flag_on FILE NAME              `NAME = False` -> True in this copy's FILE (a flag built off,
#                                  A/B against .stage/base, where it stays off)
#   variant NAME FILE FLAG...      a copy of this tree at /tmp/var/NAME with those flags on
#                                  (FILE !FLAG: that one off)
#   batch1_variants ROUNDS MODEL [NAME=]TREE...
#                                  `bench latency` at batch 1 on each tree in turn (.stage/base,
#                                  /tmp/var/NAME, ...) into $OUT/MODEL/NAME-ROUND.json
gpu_tests() {
  local files=() limit=${TEST_LIMIT:-240}
  while [ "$1" != "--" ]; do files+=("$1"); shift; done
  timeout "$limit" bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib \
    -q "${files[@]}" -k "$2" > "$OUT/tests.txt" 2>&1
  grep -aE "^FAILED|passed|failed|error" "$OUT/tests.txt" | tail -8
}

batch1_ab() {
  local rounds=$1 m
  shift
  for m in "$@"; do
    batch1_variants "$rounds" "$m" after=. before=.stage/base
  done
}

batch1_trace() {
  timeout 150 bench/device_env.sh python3 bench/profile_decode.py --model "$1" \
    --batch-size 1 --trace "$OUT/trace-$1.json" > "$OUT/profile-$1.txt" 2>&1
  gzip -f "$OUT/trace-$1.json"
}

flag_on() {
  sed -i "s/^$2 = False/$2 = True/" "$1"
  grep -n "^$2 = " "$1" ".stage/base/$1"
}

variant() {
  local dir=/tmp/var/$1
  shift
  rm -rf "$dir" && mkdir -p "$dir" && cp -r cli engine gateway operator bench "$dir"/
  while [ $# -gt 0 ]; do
    if [ "${2#!}" != "$2" ]; then
      sed -i "s/^${2#!} = True/${2#!} = False/" "$dir/$1"
    else
      sed -i "s/^$2 = False/$2 = True/" "$dir/$1"
    fi
    grep -n "^${2#!} = " "$dir/$1"
    shift 2
  done
}

batch1_variants() {
  local rounds=$1 model=$2
  shift 2
  # shellcheck disable=SC2086
  timeout $((40 + 45 * rounds * $#)) bash bench/variants.sh "$rounds" "$OUT/$model${AB_TAG:-}" \
    "$@" -- bench latency --model "$model" --load-format dummy --batch-size 1 ${AB_ARGS:-} \
    > "$OUT/variants-$model${AB_TAG:-}.txt" 2>&1
}
