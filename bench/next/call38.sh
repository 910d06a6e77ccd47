#!/usr/bin/env bash
# Device call 38 (~7 min): call 37 found the runtime split count's merge, 8 partials a load
# round, slower at 4,000 tokens (4.486 against 4.420 ms: 32 splits hold keys, four rounds);
# now one round of up to 32 loads, masked to the splits holding keys. Decode GPU tests, then
# batch 1 (4,000 and 128 tokens in) and batch 64 against main, two rounds each.
ROUNDS=2 CASES="b1-4k b1 b64" TESTS_K="no_kernel_compiles or decode or graph" \
  exec bash bench/next/call37.sh
