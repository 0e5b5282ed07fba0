#!/bin/bash
# Wheels the H200 image lacks, for Python 3.12 / manylinux x86_64, into git-ignored .whl/ folders:
#   .whl/lm   lmstack's runtime extras (pydantic stack, trl, datasets, liger-kernel, torchao, deepspeed built as a
#             pure-Python wheel with DS_BUILD_OPS=0, hjson)        ~8 MB
#   .whl/bnb  bitsandbytes, slimmed to its CUDA 13 + CPU libraries (~7 MB)
#   .whl/lf, .whl/liger  LLaMA-Factory 0.9.5 and its pins (bench/lf/fetch_lf_wheels.sh)
#   .whl/uns  Unsloth 2026.10.9 and its pins (../shared/bench/unsloth/wheels.txt; its web-app `studio/`
#             dropped: 27 -> 2 MiB); installed with .whl/bnb and .whl/ao in its own --target   ~11 MB
#   .whl/ao   torchao 0.17.0 (torch 2.11 on the device): lmstack's fp8 and Unsloth's pin      ~3 MB
# Run from the repo root on this (CPU) machine: bash bench/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
   --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
mkdir -p .whl/lm .whl/bnb
python3 -m pip download -q $P -d .whl/lm trl==1.16.0 datasets==5.2.0 dill==0.3.8 multiprocess==0.70.16 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection "typing_extensions>=4.16" hjson \
  liger-kernel==0.8.5 torchao==0.18.0
python3 -m pip download -q $P -d .whl/bnb bitsandbytes==0.50.2
# keep only the CUDA 13 (the H200 image's torch is cu130) and CPU libraries: 41 MiB -> 7 MiB, so every
# wheel set fits one call's 64 MiB carry
python3 bench/tools/slim_wheel.py .whl/bnb/bitsandbytes-*.whl 'cuda13[0-9]' '_cpu'
if ! ls .whl/lm/deepspeed-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
  tar xzf "$tmp"/deepspeed-0.19.8.tar.gz -C "$tmp"
  (cd "$tmp"/deepspeed-0.19.8 && DS_BUILD_OPS=0 "$OLDPWD"/.venv/bin/pip wheel -q --no-deps --no-build-isolation \
    -w "$OLDPWD"/.whl/lm .)
  rm -rf "$tmp"
fi
mkdir -p .whl/uns .whl/ao
python3 -m pip download -q $P -d .whl/ao torchao==0.17.0
python3 -m pip download -q $P -d .whl/uns unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 \
  cut_cross_entropy==25.1.1 dill==0.3.8 multiprocess==0.70.16 docstring_parser==0.18.0 fsspec==2026.2.0 \
  json5==0.17.3 msgspec==0.23.0 nest_asyncio==1.6.0 pydantic==2.14.4 pydantic-core==2.50.5 shtab==1.13.0 \
  structlog==26.1.0 typeguard==4.6.1 typing_extensions==4.16.0 typing-inspection==0.4.5 tyro==1.0.17 \
  annotated-types==0.8.0
python3 bench/tools/slim_wheel.py .whl/uns/unsloth-2026.10.9-py3-none-any.whl --drop-prefix studio/
bash bench/lf/fetch_lf_wheels.sh
du -sh .whl/*
