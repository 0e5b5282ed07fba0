#!/bin/bash
# One H200 call per 7B row of issue 19 with every peer on the same assets, one run_id:
#   bash bench/call_peers7.sh peers7_bs8     (LF tuned, Unsloth, lmstack fused, lmstack fp8)
#   bash bench/call_peers7.sh peers7_24g     (LF use_unsloth_gc, Unsloth offloaded gc, lmstack ckpt /
#                                             use_unsloth_gc + fp8 / use_unsloth inside Unsloth's env)
# carry: .whl (bench/fetch_wheels.sh: lf, liger, lm, bnb, ao, uns). Each system in its own --target.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
export TORCH_CUDA_ARCH_LIST=9.0
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
pip_t() { t=$1; shift; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $t "$@" >/tmp/pip_$(basename $t).log 2>&1 || { echo "install $t failed"; tail -5 /tmp/pip_$(basename $t).log; }; }
pip_t /tmp/site .whl/lf/*.whl .whl/liger/*.whl
pip_t /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl .whl/ao/*.whl
pip_t /tmp/site_uns .whl/uns/*.whl .whl/bnb/*.whl .whl/ao/*.whl
echo "wheels $(( $(date +%s)-T0 ))s"
python3 bench/make_assets.py /tmp/assets qwen2.5-7b 2>&1 | grep -v Writing | tail -1
echo "assets $(( $(date +%s)-T0 ))s"
python3 bench/lmstack_bench.py all --assets /tmp/assets --set "${1:-peers7_bs8}" --systems llamafactory,lmstack,unsloth \
  --budget $(( 575 - ($(date +%s)-T0) )) --logs /tmp/bench_logs 2>&1 | grep -v "^\[" | tail -30
cp bench/results/speed.jsonl "$O/speed_all.jsonl" 2>/dev/null
echo "done $(( $(date +%s)-T0 ))s"
