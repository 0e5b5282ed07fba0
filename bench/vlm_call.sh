#!/bin/bash
# One H200 call (device kind nvidia-h200): Qwen2.5-VL-3B architecture (random weights), image SFT through
# lmstack train, LoRA then full (vision tower frozen). Carry: .whl/vlm (pydantic stack for Python 3.12:
# pip download --python-version 3.12 pydantic pydantic-core annotated-types typing-inspection
# typing_extensions pyyaml). Results: $OUT/vlm.jsonl (+ logs).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out_local}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site_vlm .whl/vlm/*.whl
export PYTHONPATH=/tmp/site_vlm:$PWD/src
python3 -c "import transformers, torch, peft; print('transformers', transformers.__version__, 'torch', torch.__version__, 'peft', peft.__version__)"
ROOT=/tmp/vlm_assets
python3 bench/vlm_bench.py assets $ROOT 2>&1 | tail -3
for name in ${RUNS:-lora full}; do
  timeout ${RUN_SECONDS:-220} python3 bench/vlm_bench.py run $ROOT $name "$@" > "$OUT/vlm_$name.log" 2>&1
  echo "$name rc=$?"; grep '^RESULT ' "$OUT/vlm_$name.log" | sed 's/^RESULT //' | tee -a "$OUT/vlm.jsonl"
  grep -E "Error|error:" "$OUT/vlm_$name.log" | tail -5
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
