#!/usr/bin/env bash
# Device call 135 (session 49's build, on branch gpu-next34): the vocabulary race drawing four
# columns' noise from one Philox evaluation (engine/sample/gumbel_race.py; sm_90 compiled here:
# 3,080 SASS instructions a thread against 4,064 on 4 warps). `bash bench/next/stage.sh main`
# first (the race before), then run on the branch: the sampler's GPU tests, then bench/race.py
# under main's race and the branch's (~3 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=${TEST_LIMIT:-150} gpu_tests tests/gpu/test_sampler_cuda.py -- "draws or seeded or greedy"
grep -aE "^E  " "$OUT/tests.txt" | head -8
here=$PWD
(cd .stage/base && ln -sfn "$here/.whl" .whl && timeout 120 bash bench/device_env.sh \
  python3 "$here/bench/race.py") > "$OUT/race-before.txt" 2>&1
timeout 120 bash bench/device_env.sh python3 bench/race.py > "$OUT/race-after.txt" 2>&1
tail -n 5 "$OUT"/race-*.txt
