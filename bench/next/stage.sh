#!/usr/bin/env bash
# Here (not on the device): the wheels the device lacks, and the trees the calls compare:
# .stage/base = main; .stage/no-norm, no-gated, no-merge, no-lmhead = this tree with one
# change off.
set -euo pipefail
[ -d .whl ] || { mkdir -p .whl && .venv/bin/pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d .whl annotated-doc==0.0.7 annotated-types==0.8.0 fastapi==0.165.0 \
  gguf==0.19.0 opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5 \
  starlette==1.10.0 typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0; }
rm -rf .stage && mkdir -p .stage/base
git archive main engine gateway operator bench cli | tar -x -C .stage/base
variant() {  # $1: name, $2: file, $3: the line to switch off
  mkdir -p ".stage/$1" && git archive HEAD engine gateway operator bench cli | tar -x -C ".stage/$1"
  grep -q "^$3 = True$" ".stage/$1/$2"
  sed -i "s/^$3 = True$/$3 = False/" ".stage/$1/$2"
}
variant no-norm engine/layers/linear.py NORM_IN_GEMV
variant no-gated engine/layers/linear.py GATED_GEMV
variant no-merge engine/attention/triton_decode.py FUSED_MERGE
variant no-lmhead engine/layers/linear.py LM_HEAD_GEMV
du -sh .whl .stage
