#!/bin/bash
# This session's H200 calls (issues 19 and 20), one resumable script; PHASES picks what a call runs and each
# phase skips what this machine already made (a warm machine keeps /tmp between calls):
#   gputests  the marked GPU tests: partial/offloaded checkpointing, allocator, fused LoRA, FP8, batched greedy
#   parity15  issue 19's FP8 loss parity on the 1.5B (LoRA, then full), 200 steps (bench/fp8_parity.py)
#   plan      issue 20's round-4 stage runs, each predicted before it is measured (bench/plan_accuracy.py --set r4;
#             PLAN_SET=r5 for round 5, once the planner is fixed for what `snap` shows)
#   parity7   FP8 loss parity on the 7B LoRA (4 x 2048), 200 steps
#   peers24   the 24 GiB row again with LF and Unsloth, plus the planner's own choice on an emulated 24 GiB GPU
#   compile05 regional torch.compile on/off on the 0.5B rows, with LF (bench/lmstack_bench.py --set compile05)
#   snap      issue 20's largest errors again with a memory trace: who holds the peak (plan_accuracy.py --set snap)
#   (GPU_TESTS="file ..." narrows gputests; PLAN_SET picks plan's round: r4 | r5 | r6 | r7 | r8 | r9 | snap6 | snap8)
#   (PLAN_SET=snap6: round 6's accumulating runs traced next to the same step without accumulation)
#   (PLAN_SET=snap8: round 8's freeze-tuning head peak, the LoRA twin of it, the full DPO whose peak is the step)
#   (PLAN_SET=r9: round 9, predicted by the planner with round 8's fixes)
# The seventh session ran rounds 8 and 9 and snap8 (bench/README.md); not run yet: PHASES="peers24" ... 560
TOTAL=${1:-570}
PHASES=${PHASES:-gputests parity15 plan}
source "$(dirname "$0")/call_common.sh"  # T0, left, the environment, $O, has, pip_t
pip_t /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl .whl/ao/*.whl
{ has peers24 || has compile05; } && pip_t /tmp/site .whl/lf/*.whl .whl/liger/*.whl
has peers24 && pip_t /tmp/site_uns .whl/uns/*.whl .whl/bnb/*.whl .whl/ao/*.whl
asset() { [ -f "/tmp/assets/$1/config.json" ] || env PYTHONPATH=/tmp/site_lm python3 bench/make_assets.py /tmp/assets "$1" 2>&1 | grep -v Writing | tail -1; }
asset qwen2.5-0.5b
{ has parity15 || has plan; } && asset qwen2.5-1.5b
{ has parity7 || has peers24; } && asset qwen2.5-7b
echo "setup done, $(left)s left"
parity() {  # set, only
  env PYTHONPATH=/tmp/site_lm:$PWD/src python3 bench/fp8_parity.py --assets /tmp/assets --set "$1" --only "$2" \
    --steps 200 --budget $(( $(left) - 15 )) 2>&1 | tail -4
  cp bench/results/fp8_parity.jsonl "$O/" 2>/dev/null
  grep -q "\"$2\"" bench/results/fp8_parity.jsonl 2>/dev/null && touch "/tmp/parity_$2.done"
}
for ph in $PHASES; do
  case $ph in
  gputests)
    [ -f /tmp/gputests.done ] && continue
    env PYTHONPATH=/tmp/site_lm:$PWD/src timeout $(( $(left) - 30 )) python3 -m pytest -q -s -p no:cacheprovider -m gpu \
      ${GPU_TESTS:-tests/gpu/test_partial_ckpt_gpu.py tests/gpu/test_allocator_gpu.py tests/gpu/test_fused_lora_gpu.py \
      tests/gpu/test_fp8_gpu.py tests/unit/infer/test_batching_handoff.py} 2>&1 | grep -v "^\[" >"$O/gpu_tests.txt"
    tail -25 "$O/gpu_tests.txt"; touch /tmp/gputests.done ;;
  parity15)
    for w in 1.5b_lora 1.5b_full; do  # a workload already in the committed results is not run again
      grep -q "\"workload\": \"$w\"" bench/results/fp8_parity.jsonl 2>/dev/null && touch "/tmp/parity_$w.done"
      [ -f "/tmp/parity_$w.done" ] || { [ "$(left)" -gt 200 ] && parity small "$w"; }
    done ;;
  parity7)
    [ -f /tmp/parity_7b_lora.done ] || { [ "$(left)" -gt 260 ] && parity 7b 7b_lora; } ;;
  snap)
    [ "$(left)" -gt 100 ] || continue
    [ -f /tmp/plan_accuracy.json ] || cp bench/results/plan_accuracy.json /tmp/plan_accuracy.json
    env PYTHONPATH=/tmp/site_lm:$PWD/src python3 bench/plan_accuracy.py /tmp/assets --set snap --skip-done \
      --out /tmp/plan_accuracy.json --budget $(( $(left) - 15 )) 2>&1 | grep -v "^\[lmstack\]\|Writing model shards" | tail -8
    cp /tmp/plan_accuracy.json "$O/" ;;
  plan)
    [ "$(left)" -gt 100 ] || continue
    [ -f /tmp/plan_accuracy.json ] || cp bench/results/plan_accuracy.json /tmp/plan_accuracy.json
    env PYTHONPATH=/tmp/site_lm:$PWD/src python3 bench/plan_accuracy.py /tmp/assets --set "${PLAN_SET:-r4}" --skip-done \
      --out /tmp/plan_accuracy.json --budget $(( $(left) - 15 )) 2>&1 | grep -v "^\[lmstack\]\|Writing model shards" | tail -22
    cp /tmp/plan_accuracy.json "$O/"
    (cd /tmp/plan_acc && tar czf "$O/plan_acc_logs.tar.gz" ./*.log 2>/dev/null) ;;
  peers24|compile05)
    [ "$(left)" -gt 120 ] || continue
    set_name=$([ "$ph" = peers24 ] && echo peers7_24g_auto || echo compile05)
    python3 bench/lmstack_bench.py all --assets /tmp/assets --set "$set_name" --systems llamafactory,lmstack,unsloth \
      --run-id "${RID:-s4}-$ph" --skip-done --budget $(( $(left) - 20 )) --logs /tmp/bench_logs 2>&1 | grep -v "^\[" | tail -12
    cp /tmp/speed_done.jsonl "$O/speed_done.jsonl" 2>/dev/null
    (cd /tmp/bench_logs && tar czf "$O/bench_logs_$ph.tar.gz" . 2>/dev/null) ;;
  esac
  echo "phase $ph done, $(left)s left"
done
echo "done $(( $(date +%s) - T0 ))s"
