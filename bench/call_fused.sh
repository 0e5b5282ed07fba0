#!/bin/bash
# One H200 call for issue 19's fused LoRA: GPU tests of the fused kernel, its micro-benchmark, then the
# tuned 0.5B set (LF tuned as its users tune it next to lmstack with fused and PEFT LoRA). carry: .whl
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_lm \
  .whl/lm/*.whl >/tmp/pip_lm.log 2>&1 || { echo "lm wheels failed"; tail -3 /tmp/pip_lm.log; }
echo "wheels $(( $(date +%s)-T0 ))s"
[ -n "${SKIP_MICRO:-}" ] || PYTHONPATH=/tmp/site_lm:src timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_lora_gpu.py 2>&1 | tail -5
[ -n "${SKIP_MICRO:-}" ] || PYTHONPATH=/tmp/site_lm:src timeout 150 python3 bench/fused_lora_bench.py --layers 24 --out "$O/fused_lora.jsonl" 2>&1 | tail -16
echo "micro $(( $(date +%s)-T0 ))s"
bash bench/run_bench.sh "${1:-tuned05}" $(( 560 - ($(date +%s)-T0) - 60 )) 2>&1 | grep -v "^\[" | tail -25
cp bench/results/speed.jsonl "$O/speed_all.jsonl" 2>/dev/null
echo "done $(( $(date +%s)-T0 ))s"
