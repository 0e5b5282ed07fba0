#!/bin/bash
# One resumable H200 call for the open GPU measurements (issues 19, 20, 22); the same command again on a
# warm machine continues where the last stopped (each phase skips what it already made):
#   1. issue 19: both 7B rows with every peer, one run_id (bench/lmstack_bench.py --set peers7 --skip-done)
#   2. issue 22: 32 concurrent chats against `lmstack api` on the 0.5B (bench/serve_h200.sh), once
#   3. issue 20: the planner's predicted stage runs (bench/plan_accuracy.py --skip-done, its JSON kept in
#      /tmp so a re-sent tree does not reset it)
#   4. gputests: this session's marked GPU tests and bench/batcher_bench.py on the GPU
#   5. parity: issue 19's FP8 loss parity (bench/fp8_parity.py, 200 steps)
# Next session, e.g.: PHASES="gputests parity plan" bash bench/call_s3.sh 585 (carry .whl/lm .whl/bnb .whl/ao)
# carry: .whl (all of lf, liger, lm, bnb, ao, uns, serve: ~53 MB). Results under $OUT.
#   RID=... bash bench/call_s3.sh [TOTAL_S]
TOTAL=${1:-570}
PHASES=${PHASES:-speed serve plan}  # which of the phases below to run
RID=${RID:-s3-20261201}
source "$(dirname "$0")/call_common.sh"  # T0, left, the environment, $O, has, pip_t
has speed && pip_t /tmp/site .whl/lf/*.whl .whl/liger/*.whl
pip_t /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl .whl/ao/*.whl
has speed && pip_t /tmp/site_uns .whl/uns/*.whl .whl/bnb/*.whl .whl/ao/*.whl
has serve && pip_t /tmp/site_serve .whl/serve/*.whl
has speed && { [ -f /tmp/assets/qwen2.5-7b/config.json ] || python3 bench/make_assets.py /tmp/assets qwen2.5-7b 2>&1 | grep -v Writing | tail -1; }
[ -f /tmp/assets/qwen2.5-0.5b/config.json ] || python3 bench/make_assets.py /tmp/assets qwen2.5-0.5b 2>&1 | grep -v Writing | tail -1
echo "setup done, $(left)s left"

# 1. the 7B speed rows
if has speed && [ "$(left)" -gt 120 ]; then
  python3 bench/lmstack_bench.py all --assets /tmp/assets --set peers7 --systems llamafactory,lmstack,unsloth \
    --run-id "$RID" --skip-done --budget $(( $(left) - 20 )) --logs /tmp/bench_logs 2>&1 | grep -v "^\[" | tail -25
  cp /tmp/speed_done.jsonl "$O/speed_done.jsonl" 2>/dev/null
fi
echo "speed phase done, $(left)s left"

# 2. serving, 0.5B (transformers backend, batch 32 and one at a time)
if has serve && [ ! -f /tmp/serve05.done ] && [ "$(left)" -gt 200 ]; then
  OUT=/tmp/serve_out timeout $(( $(left) - 20 )) bash bench/serve_h200.sh qwen2.5-0.5b 2>&1 | tail -8
  grep -q hf-batch32 /tmp/serve_out/serve.jsonl 2>/dev/null && touch /tmp/serve05.done
  cp /tmp/serve_out/* "$O/" 2>/dev/null
fi
echo "serve phase done, $(left)s left"

# 3. planner accuracy, predicted before measured
if has plan && [ "$(left)" -gt 100 ]; then
  [ -f /tmp/plan_accuracy.json ] || cp bench/results/plan_accuracy.json /tmp/plan_accuracy.json
  PYTHONPATH=/tmp/site_lm:$PWD/src python3 bench/plan_accuracy.py /tmp/assets --skip-done --out /tmp/plan_accuracy.json \
    --budget $(( $(left) - 15 )) 2>&1 | grep -v "^\[lmstack\]\|Writing model shards" | tail -25
  cp /tmp/plan_accuracy.json "$O/"
  (cd /tmp/plan_acc && tar czf "$O/plan_acc_logs.tar.gz" ./*.log 2>/dev/null)
fi
# 4. the GPU tests written this session (allocator, partial checkpointing, batched bf16 greedy) and the batcher's
#    host time on the GPU (with and without the event loop), once
if has gputests && [ ! -f /tmp/gputests.done ] && [ "$(left)" -gt 150 ]; then
  PYTHONPATH=/tmp/site_lm:$PWD/src timeout $(( $(left) - 100 )) python3 -m pytest -q -s -p no:cacheprovider \
    tests/gpu/test_allocator_gpu.py tests/gpu/test_partial_ckpt_gpu.py tests/unit/infer/test_batching_handoff.py 2>&1 \
    | tail -15 | tee "$O/gpu_tests.txt" && touch /tmp/gputests.done
  for loop in "" --loop; do
    PYTHONPATH=/tmp/site_lm:$PWD/src timeout 45 python3 bench/batcher_bench.py /tmp/assets/qwen2.5-0.5b --batch 1 32 \
      --max-tokens 256 --repeat 1 $loop --results "$O/batcher_gpu.jsonl" --name "h200$loop" 2>&1 | tail -3
  done
fi
# 5. issue 19's FP8 loss parity: 200 steps, fp8 vs bf16 (bench/fp8_parity.py; 1.5B LoRA first)
if has parity && [ "$(left)" -gt 200 ]; then
  PYTHONPATH=/tmp/site_lm:$PWD/src python3 bench/make_assets.py /tmp/assets qwen2.5-1.5b 2>&1 | grep -v Writing | tail -1
  PYTHONPATH=/tmp/site_lm:$PWD/src python3 bench/fp8_parity.py --assets /tmp/assets --set small --only 1.5b_lora \
    --steps 200 --budget $(( $(left) - 15 )) 2>&1 | tail -6
  cp bench/results/fp8_parity.jsonl "$O/" 2>/dev/null
fi
echo "done $(( $(date +%s) - T0 ))s"
