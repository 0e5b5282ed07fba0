#!/bin/bash
# One GPU call: install the carried wheels, build the shared assets, run LLaMA-Factory's best config
# and lmstack on the same models and data, append one JSON line per run to bench/results/speed.jsonl
# (and to $OUT/speed.jsonl, with the run logs in $OUT/bench_logs.tar.gz, refreshed after every run).
#
# Usage, on the GPU machine from the repo root, with .whl carried (.whl/lf, .whl/liger, .whl/lm):
#   bash bench/run_bench.sh [SET] [BUDGET_S]      SET: default | small | big | lmstack | smoke | compile | fp8 |
#                                                      fp8_compile (default: default)
# Wheels: .whl/lf + .whl/liger from bench/lf/fetch_lf_wheels.sh (LLaMA-Factory 0.9.5 and its pins);
# .whl/lm must hold pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions and
# liger_kernel for lmstack (which otherwise uses the machine's torch/transformers/peft/accelerate).
set -u
SET=${1:-default}
BUDGET=${2:-}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
T0=$(date +%s)
case "$SET" in lmstack|compile|fp8|fp8_compile) LF_RUNS=0 ;; *) LF_RUNS=1 ;; esac
if [ "$LF_RUNS" = 1 ]; then  # LLaMA-Factory 0.9.5 and its pinned versions, kept apart in /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/lf/*.whl .whl/liger/*.whl >/dev/null 2>&1 || { echo "LLaMA-Factory wheel install failed"; exit 1; }
fi
LM_WHEELS=$(ls .whl/lm/pydantic-*.whl .whl/lm/pydantic_core-*.whl .whl/lm/annotated_types-*.whl \
  .whl/lm/typing_inspection-*.whl .whl/lm/typing_extensions-*.whl .whl/lm/liger_kernel-*.whl \
  .whl/lm/torchao-*.whl 2>/dev/null)  # torchao: fp8 full fine-tuning (float8 training)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_lm \
  $LM_WHEELS >/dev/null 2>&1 || { echo "lmstack wheel install failed"; exit 1; }
echo "wheels installed in $(( $(date +%s) - T0 ))s"
case "$SET" in
  small|smoke|compile) ARCHS=qwen2.5-0.5b ;;
  big) ARCHS=qwen2.5-7b ;;
  *) ARCHS=qwen2.5-0.5b,qwen2.5-7b ;;
esac
python3 bench/make_assets.py /tmp/assets "$ARCHS" 2>&1 | grep -v Writing | tail -5
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
echo "assets ready after $(( $(date +%s) - T0 ))s"
[ -z "$BUDGET" ] && BUDGET=$(( 570 - ($(date +%s) - T0) ))  # the whole call stays under 10 minutes
echo "budget for the runs: ${BUDGET}s"
python3 bench/lmstack_bench.py all --assets /tmp/assets --set "$SET" --budget "$BUDGET" --logs /tmp/bench_logs
RC=$?
echo "total $(( $(date +%s) - T0 ))s"
exit $RC
