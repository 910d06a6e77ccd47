#!/usr/bin/env bash
# Device call 40 (~6 min): issue 32's online and shared-prefix rows, rounds 2 and 3 (call39.sh).
SKIP_TESTS=1 ROUNDS_LIST="2 3" exec bash bench/next/call39.sh
