#!/usr/bin/env bash
# Here (not on the device): the wheels the device lacks, and .stage/base = main's tree.
set -euo pipefail
[ -d .whl ] || { mkdir -p .whl && .venv/bin/pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d .whl annotated-doc==0.0.7 annotated-types==0.8.0 fastapi==0.165.0 \
  gguf==0.19.0 opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5 \
  starlette==1.10.0 typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0; }
# the engine's HTTP parser and event loop (uvicorn takes them when importable; the device lacks them)
ls .whl/uvloop-* .whl/httptools-* >/dev/null 2>&1 || .venv/bin/pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl uvloop==0.23.0 \
  httptools==0.9.0
rm -rf .stage && mkdir -p .stage/base
git archive main engine gateway operator bench cli | tar -x -C .stage/base
du -sh .whl .stage
