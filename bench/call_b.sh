#!/bin/bash
# Second H200 call of the 2026-12-01 session: serving on 0.5B (continuous batching vs one at a time),
# the Unsloth training test, then the FSDP GPU tests (the fused LoRA kernel now steps aside under FSDP).
set -u
T0=$(date +%s)
el() { echo $(( $(date +%s)-T0 )); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TORCH_CUDA_ARCH_LIST=9.0
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
pip_t() { t=$1; shift; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $t "$@" >/tmp/pip_$(basename $t).log 2>&1 || { echo "install $t failed"; tail -5 /tmp/pip_$(basename $t).log; }; }
[ -d /tmp/site_lm/trl ] || pip_t /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl .whl/ao/*.whl
[ -d /tmp/site_uns/unsloth ] || pip_t /tmp/site_uns .whl/uns/*.whl .whl/bnb/*.whl .whl/ao/*.whl
pip_t /tmp/site_serve .whl/serve/*.whl
LM=/tmp/site_lm:$PWD/src; SP=/tmp/site_serve:$LM
[ -f /tmp/assets/qwen2.5-0.5b/config.json ] || python3 bench/make_assets.py /tmp/assets qwen2.5-0.5b 2>&1 | grep -v Writing | tail -1
printf 'model_name_or_path: /tmp/assets/qwen2.5-0.5b\ntemplate: qwen\ndo_sample: false\nmax_new_tokens: 256\ninfer_dtype: bfloat16\n' > /tmp/s05.yaml
echo "setup $(el)s"
PYTHONPATH=$SP timeout 100 python3 bench/serve_bench.py /tmp/s05.yaml --requests 32 --concurrency 32 --max-tokens 128 \
  --name qwen2.5-0.5b-hf-batch32 --results "$O/serve.jsonl" --log "$O/server-b32.log" --api-arg=--max-batch=32 2>&1 | tail -2
PYTHONPATH=$SP timeout 80 python3 bench/serve_bench.py /tmp/s05.yaml --requests 8 --concurrency 8 --max-tokens 128 \
  --name qwen2.5-0.5b-hf-batch1 --results "$O/serve.jsonl" --log "$O/server-b1.log" --api-arg=--max-batch=1 2>&1 | tail -2
echo "serve $(el)s"
PYTHONPATH=/tmp/site_uns:$PWD/src timeout 110 python3 -m pytest -p no:cacheprovider -q -rf \
  "tests/gpu/test_unsloth_gpu.py::test_use_unsloth_trains_through_unsloth_and_saves_a_peft_adapter" > "$O/unsloth_train.log" 2>&1
echo "unsloth train rc=$? $(el)s"; tail -3 "$O/unsloth_train.log"
PYTHONPATH=$LM timeout $(( 300 - $(el) )) python3 -m pytest -p no:cacheprovider -q -rf tests/gpu/test_distributed_gpu.py -k fsdp \
  > "$O/fsdp_tests.log" 2>&1; echo "fsdp tests rc=$? $(el)s"; tail -6 "$O/fsdp_tests.log"
echo "done $(el)s"
