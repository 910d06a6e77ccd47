#!/usr/bin/env bash
# On the device machine: install carried wheels (.whl/), make kvfleet importable without
# installing it (its package-dir mapping, as symlinks), then run the given command.
#   bench/device_env.sh python3 -m pytest tests/gpu
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/src/kvfleet
for c in cli engine gateway operator bench; do ln -sfn "$PWD/$c" /tmp/src/kvfleet/$c; done
export PYTHONPATH=/tmp/src:/tmp/site KVFLEET_HOME=$HOME/kvhome PYTHONUNBUFFERED=1
"$@"
