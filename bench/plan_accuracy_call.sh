#!/bin/bash
# One H200 call for issue 20's planner accuracy runs (bench/plan_accuracy.py's stage set: dpo, orpo, simpo,
# kto, rm, grpo on 0.5B-7B, unpacked SFT with the real length distribution, QLoRA), each predicted before
# it is measured. carry: .whl (bash bench/fetch_wheels.sh: .whl/lm + .whl/bnb). A second call continues
# where the first stopped (--skip-done). Results: $OUT/plan_accuracy.json (copy it over
# bench/results/plan_accuracy.json) and the run logs in $OUT/plan_acc_logs.tar.gz.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_lm \
  .whl/lm/*.whl .whl/bnb/*.whl >/tmp/pip_lm.log 2>&1 || { echo "wheels failed"; tail -3 /tmp/pip_lm.log; }
export PYTHONPATH=/tmp/site_lm:$PWD/src
A=/tmp/assets
[ -f "$A/qwen2.5-0.5b/config.json" ] || python3 bench/make_assets.py "$A" qwen2.5-0.5b 2>&1 | tail -2
echo "setup $(( $(date +%s)-T0 ))s"
python3 bench/plan_accuracy.py "$A" --skip-done --budget $(( ${BUDGET:-575} - ($(date +%s)-T0) )) "$@" 2>&1 \
  | grep -v "^\[lmstack\]\|Writing model shards"
cp bench/results/plan_accuracy.json "$O/"
(cd /tmp/plan_acc && tar czf "$O/plan_acc_logs.tar.gz" ./*.log 2>/dev/null)
echo "done $(( $(date +%s)-T0 ))s"
