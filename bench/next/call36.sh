#!/usr/bin/env bash
# Device call 36 (land34: no compile while serving, ~6 min): call 35's CompileWatch saw the
# prompt split's merge kernel compiled at each new split count (3, 5, 6, 9, 17) and the LM
# head's one-row GEMV and the vocabulary race at each engine's first request. Now the merge
# takes any count in one variant and both tail kernels compile at startup. Call 35 again, with
# prompt attention's GPU test against torch beside the no-compile test (which now watches from
# the first request on).
TESTS="tests/gpu/test_engine_cuda.py tests/gpu/test_triton_cuda.py" \
  TESTS_K="no_kernel_compiles or kernels_match_torch" exec bash bench/next/call35.sh
