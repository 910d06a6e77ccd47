#!/usr/bin/env bash
# Here (not on the device): SmolLM2's GGUF (98 MB, over one call's 64 MiB) in two parts under
# .stage/sm, for two device calls made back to back while the machine stays warm:
#   call 1, carry [".whl", ".stage/sm/part-aa"]:
#     mkdir -p $HOME/stage && cp .stage/sm/part-aa .stage/sm/kvfleet-model.json $HOME/stage/
#   call 2 at once, carry [".whl", ".stage/sm/part-ab"]:
#     bash bench/next/stage_smollm2.sh --assemble && bash bench/next/call68.sh
# (`--assemble`, on the device: the parts into $HOME/kvhome/models/smollm2, hash checked)
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "${1:-}" = --assemble ]; then
  dest=$HOME/kvhome/models/smollm2
  mkdir -p "$dest"
  cat "$HOME/stage/part-aa" .stage/sm/part-ab > "$dest/$NAME"
  cp "$HOME/stage/kvfleet-model.json" "$dest/"
  sha256sum "$dest/$NAME"
  exit 0
fi
src=${KVFLEET_HOME:-$PWD/.cache/kvfleet}/models/smollm2
[ -f "$src/$NAME" ] || KVFLEET_HOME=${KVFLEET_HOME:-$PWD/.cache/kvfleet} .venv/bin/kvfleet models fetch smollm2
rm -rf .stage/sm && mkdir -p .stage/sm
split -b 50M "$src/$NAME" .stage/sm/part-
cp "$src/kvfleet-model.json" .stage/sm/
sha256sum "$src/$NAME"
ls -la .stage/sm
