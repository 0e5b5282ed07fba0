#!/bin/bash
# One H200 call: 32 concurrent chats against `lmstack api` on random-init Qwen2.5 0.5B and 7B (real
# shapes, bench/make_assets.py), transformers backend (continuous batching, --max-batch 32, and
# --max-batch 1 for the one-at-a-time baseline), then infer_backend=vllm when vllm is importable.
# Lines go to $OUT/serve.jsonl (copy them to bench/results/serve.jsonl), server logs to $OUT.
# Needs .whl/serve (bash bench/fetch_serve_wheels.sh) carried. Usage: bash bench/serve_h200.sh [ARCHS]
set -uo pipefail
ARCHS=${1:-qwen2.5-0.5b,qwen2.5-7b}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f /tmp/site_serve/.done ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_serve .whl/serve/*.whl
export PYTHONPATH=/tmp/site_serve:/tmp/site_lm:$PWD/src HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CUDA_VISIBLE_DEVICES=0 python3 bench/make_assets.py /tmp/assets "$ARCHS" 2>&1 | grep -v Writing | tail -3
VLLM=$(python3 -c 'import vllm' 2>/dev/null && echo yes || echo no)
for arch in ${ARCHS//,/ }; do
  printf 'model_name_or_path: /tmp/assets/%s\ntemplate: qwen\ndo_sample: false\nmax_new_tokens: 256\ninfer_dtype: bfloat16\n' \
    "$arch" > "/tmp/$arch.yaml"
  run() {  # name, then serve_bench arguments
    local name=$1; shift
    timeout 580 python3 bench/serve_bench.py "/tmp/$arch.yaml" --requests 32 --concurrency 32 --max-tokens 256 \
      --name "$arch-$name" --results "$OUT/serve.jsonl" --log "$OUT/server-$arch-$name.log" "$@" \
      || echo "$arch-$name failed: see $OUT/server-$arch-$name.log"
  }
  run hf-batch32 --api-arg=--max-batch=32
  run hf-batch1 --api-arg=--max-batch=1 --requests 8  # one at a time: 8 requests say its rate
  [ "$VLLM" = yes ] && run vllm infer_backend=vllm
done
cat "$OUT/serve.jsonl"
