#!/bin/bash
# Wheels `lmstack api` and bench/serve_bench.py need that the H200 image lacks (FastAPI stack, the
# openai client, pydantic), for Python 3.12 / manylinux x86_64, into the git-ignored .whl/serve (~7 MB).
# Run from the repo root on this (CPU) machine: bash bench/fetch_serve_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/serve
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/serve fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 openai==3.57.0 \
  httpx==0.28.1 httpcore==1.0.9 anyio==4.16.0 sniffio==1.3.1 idna==3.20 certifi==2026.10.19.post1 distro==1.9.0 \
  jiter==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 annotated-doc==0.0.7 tqdm httpx2==2.16.2 httpcore2==2.16.2 truststore opentelemetry-api importlib-metadata zipp
du -sh .whl/serve
