#!/usr/bin/env bash
# Here (not on the device): the wheels the device lacks, and .stage/base = main's tree (or the
# commit given: `bash bench/next/stage.sh a43d82e`).
# (uvloop and httptools: the engine's event loop and HTTP parser, which uvicorn takes when it
# can import them; pip skips the wheels already in .whl)
set -euo pipefail
mkdir -p .whl
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d .whl annotated-doc==0.0.7 \
  annotated-types==0.8.0 fastapi==0.165.0 gguf==0.19.0 httptools==0.9.0 \
  opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5 starlette==1.10.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0 uvloop==0.23.0
rm -rf .stage && mkdir -p .stage/base
git archive "${1:-main}" engine gateway operator bench cli | tar -x -C .stage/base
du -sh .whl .stage
