#!/usr/bin/env bash
# Device call 109 (main f259ceb or later): the bf16 o GEMV merging decode attention's splits
# (Llama-3-8B's and Qwen3-8B's o took 14.0 us on the batch-1 path for 33.5 MB, floor ~8: call
# 96's traces) with its next weight tile loaded ahead (`triton_gemv.SPLITS_AHEAD`) and the
# splits' rows loaded with their lse (`SPLITS_EAGER`), each and both, beside main; Qwen3-8B
# also at session 43's tree (234cf9a: 4.33 ms then, 4.50 in call 108's rounds). Stage here
# first: `bash bench/next/stage.sh && mkdir -p .stage/s43 && git archive 234cf9a engine
# gateway operator bench cli | tar -x -C .stage/s43` (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
F=engine/layers/triton_gemv.py
variant ahead $F SPLITS_AHEAD
variant eager $F SPLITS_EAGER
variant both $F SPLITS_AHEAD $F SPLITS_EAGER
flag_on $F SPLITS_AHEAD && flag_on $F SPLITS_EAGER  # (this copy: the GPU tests with both)
TEST_LIMIT=150 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "splits_merged_by_the_o_gemv or splits_left_to_the_o"
batch1_variants 2 llama-3-8b .stage/base /tmp/var/ahead /tmp/var/eager /tmp/var/both
batch1_variants 2 qwen3-8b .stage/base /tmp/var/both .stage/s43
batch1_variants 1 qwen3-30b-a3b .stage/base /tmp/var/eager
python3 bench/next/summary.py "$OUT"
