#!/bin/bash
# The one GPU-machine harness: install the carried wheels, build the assets a phase needs, run the
# phases named in PHASES in order, each inside what is left of TOTAL seconds. Results go to $OUT.
#
#   PHASES="plan parity" bash bench/device.sh [TOTAL_S]        (from the repo root; carry .whl)
#
# Phases (their knobs in brackets; bench/README.md says what each measures):
#   speed     LLaMA-Factory vs lmstack, one set of bench/lmstack_bench.py      [SPEED_SET=default, SYSTEMS]
#   peers     the same with Unsloth too, one run id, resumable (--skip-done)   [PEERS_SET=peers7, RID]
#   defaults  0.5B full + LoRA: LF tuned, lmstack as an LF user writes the YAML (the plan's fast
#             defaults), the same YAML with LF's default optim/workers written, lmstack tuned; one
#             run id, resumable (--skip-done)                                [RID]
#   fused     the fused LoRA kernel's GPU tests and micro-benchmark
#   probe     FP8 GEMM probe (bench/probe_fp8.py) and Unsloth's env import
#   gputests  every GPU-marked test (names, outcomes, times in gpu_tests.xml)  [GPU_TESTS]
#   unsloth   the Unsloth GPU tests, in Unsloth's own env
#   fsdp1     FSDP1 + LoRA through accelerate, fused vs PEFT LoRA kernel
#   fsdpresume  FSDP1 + LoRA checkpoint then resume; a hung run's Python stacks in its log
#   parity    FP8 vs bf16 loss parity, 200 steps (bench/fp8_parity.py)       [PARITY_SET=small, PARITY_ONLY=1.5b_lora]
#   plan      planner accuracy: each run predicted, then measured            [PLAN_SET=r4]
#   serve     32 concurrent chats against `lmstack api`, batch 32 vs 1 (+vllm) [SERVE_ARCHS=qwen2.5-0.5b]
#   batcher   the batcher's host time on the GPU, with and without the event loop
#   vlm       Qwen2.5-VL-3B image SFT and the planner's prediction of it     [VLM_RUNS="lora full"]
#   qlora     QLoRA 4/8-bit vs bf16 LoRA on the 7B
#   stages    DPO/SFT LoRA and `auto` runs (bench/stage_bench.py)           [STAGE_RUNS]
#   env       `lmstack env` all-reduce and the ZeRO-3 + LoRA test on NPROC GPUs
#   rl        GRPO LoRA, lmstack vs TRL defaults (bench/rl_bench.py)          [RL_ARCHS, RL_STEPS=3]
#   rltask    0.5B arithmetic: SFT warm start, GRPO 100 steps (bench/rl_task.py) [RL_SFT_STEPS=60]
#   dist      the multi-GPU matrix (bench/distributed_bench.py)             [NPROC=2, DIST_ITEMS]
# A warm machine keeps /tmp between calls: installs, assets and plan/speed results carry over, so the
# same command again continues where the last call stopped.
set -u
cd "$(dirname "$0")/.."
TOTAL=${1:-570}
PHASES=${PHASES:?PHASES: one or more of speed peers defaults fused probe gputests unsloth fsdp1 fsdpresume parity plan serve batcher vlm qlora stages env dist}
T0=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - T0))); }
has() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
RID=${RID:-$(date -u +%Y%m%dT%H%M%SZ)}
pip_t() {  # target, wheels: once per machine (a marker per target)
  local t=$1; shift
  [ -f "$t/.done" ] && return
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$t" "$@" \
    >"/tmp/pip_$(basename "$t").log" 2>&1 && touch "$t/.done" || { echo "install $t failed"; tail -5 "/tmp/pip_$(basename "$t").log"; }
}
asset() { [ -f "/tmp/assets/$1/config.json" ] || env PYTHONPATH=/tmp/site_lm python3 bench/make_assets.py /tmp/assets "$1" 2>&1 | grep -v Writing | tail -1; }
LM=/tmp/site_lm:$PWD/src
pip_t /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl .whl/ao/*.whl
{ has speed || has peers || has defaults; } && pip_t /tmp/site .whl/lf/*.whl .whl/liger/*.whl
{ has peers || has unsloth || has probe; } && pip_t /tmp/site_uns .whl/uns/*.whl .whl/bnb/*.whl .whl/ao/*.whl
has serve && pip_t /tmp/site_serve .whl/serve/*.whl
asset qwen2.5-0.5b
{ has plan || has parity || has rl; } && asset qwen2.5-1.5b
{ has peers || has qlora || has stages || has dist || has rl; } && asset qwen2.5-7b
has speed && [ "${SPEED_SET:-default}" != small ] && asset qwen2.5-7b
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
echo "setup done, $(left)s left"
plan_json() { [ -f /tmp/plan_accuracy.json ] || cp bench/results/plan_accuracy.json /tmp/plan_accuracy.json; }
for ph in $PHASES; do
  [ "$(left)" -gt 60 ] || { echo "no time left for $ph"; break; }
  case $ph in
  speed)
    python3 bench/lmstack_bench.py all --assets /tmp/assets --set "${SPEED_SET:-default}" ${SYSTEMS:+--systems $SYSTEMS} \
      --run-id "$RID" --budget $(($(left) - 20)) --logs /tmp/bench_logs 2>&1 | grep -v "^\[" | tail -25
    cp bench/results/speed.jsonl "$O/speed_all.jsonl" 2>/dev/null ;;
  peers)
    python3 bench/lmstack_bench.py all --assets /tmp/assets --set "${PEERS_SET:-peers7}" --systems llamafactory,lmstack,unsloth \
      --run-id "$RID" --skip-done --budget $(($(left) - 20)) --logs /tmp/bench_logs 2>&1 | grep -v "^\[" | tail -25
    cp /tmp/speed_done.jsonl "$O/speed_done.jsonl" 2>/dev/null
    (cd /tmp/bench_logs && tar czf "$O/bench_logs_$ph.tar.gz" . 2>/dev/null) ;;
  defaults)
    python3 bench/lmstack_bench.py all --assets /tmp/assets --set as_written05 --run-id "$RID" --skip-done \
      --budget $(($(left) - 20)) --logs /tmp/bench_logs 2>&1 | grep -v "^\[" | tail -25
    cp /tmp/speed_done.jsonl "$O/speed_done.jsonl" 2>/dev/null
    (cd /tmp/bench_logs && tar czf "$O/bench_logs_$ph.tar.gz" . 2>/dev/null) ;;
  fused)
    PYTHONPATH=$LM timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_lora_gpu.py 2>&1 | tail -5
    PYTHONPATH=$LM timeout 150 python3 bench/fused_lora_bench.py --layers 24 --out "$O/fused_lora.jsonl" 2>&1 | tail -16 ;;
  probe)
    PYTHONPATH=$LM timeout 100 python3 bench/probe_fp8.py 2>&1 | tee "$O/probe_fp8.jsonl" | tail -12
    PYTHONPATH=/tmp/site_uns timeout 90 python3 -c "import unsloth, importlib.metadata as m; print('unsloth import ok', m.version('unsloth'))" 2>&1 | tail -3 ;;
  gputests)  # every GPU-marked test unless GPU_TESTS names some; each test's name, outcome and time in the xml
    PYTHONPATH=$LM timeout $(($(left) - 30)) python3 -m pytest -p no:cacheprovider -m gpu -v -rfEs --durations=40 --continue-on-collection-errors \
      --junitxml="$O/gpu_tests.xml" ${GPU_TESTS:-tests} >"$O/gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?"; grep -E "passed|failed|error" "$O/gpu_tests.txt" | tail -30 ;;
  unsloth)
    PYTHONPATH=/tmp/site_uns:$PWD/src timeout $(($(left) - 20)) python3 -m pytest -p no:cacheprovider -q -rf \
      tests/gpu/test_unsloth_gpu.py >"$O/unsloth_tests.log" 2>&1; echo "unsloth tests rc=$?"; tail -15 "$O/unsloth_tests.log" ;;
  fsdp1)
    PYTHONPATH=$LM python3 -m lmstack.cli tiny-model /tmp/tiny >/dev/null 2>&1
    for k in fused peft; do
      printf 'model_name_or_path: /tmp/tiny\ntemplate: qwen\nstage: sft\ndo_train: true\nfinetuning_type: lora\nlora_target: all\ndataset: alpaca_en_demo\ndataset_dir: %s/data\ncutoff_len: 128\noutput_dir: /tmp/fsdp_%s\nper_device_train_batch_size: 4\nlearning_rate: 0.005\nmax_steps: 6\nlogging_steps: 1\nsave_strategy: "no"\nreport_to: none\nbf16: true\nlora_kernel: %s\n' "$PWD" $k $k >/tmp/fsdp_$k.yaml
      PYTHONPATH=$LM timeout 90 python3 -m accelerate.commands.launch --config_file examples/accelerate/fsdp_config.yaml \
        --num_processes 1 -m lmstack.cli train /tmp/fsdp_$k.yaml >"$O/fsdp_$k.log" 2>&1
      echo "fsdp1 lora_kernel=$k rc=$?"
    done ;;
  fsdpresume)  # FSDP1 + LoRA: 20 steps saving checkpoint-10, then a resume from it; a run alive after 150 s
    # gets SIGABRT, and faulthandler writes every thread's Python stack into its log
    PYTHONPATH=$LM python3 -m lmstack.cli tiny-model /tmp/tiny >/dev/null 2>&1
    base='model_name_or_path: /tmp/tiny\ntemplate: qwen\nstage: sft\ndo_train: true\nfinetuning_type: lora\nlora_target: all\ndataset: alpaca_en_demo\ndataset_dir: %s/data\ncutoff_len: 128\nper_device_train_batch_size: 4\nlearning_rate: 0.005\nmax_steps: 20\nlogging_steps: 1\nreport_to: none\nbf16: true\n'
    printf "${base}output_dir: /tmp/fr_whole\nsave_strategy: steps\nsave_steps: 10\n" "$PWD" >/tmp/fr_whole.yaml
    printf "${base}output_dir: /tmp/fr_resumed\nsave_strategy: \"no\"\nresume_from_checkpoint: /tmp/fr_whole/checkpoint-10\n" "$PWD" >/tmp/fr_resumed.yaml
    for run in whole resumed; do
      PYTHONFAULTHANDLER=1 PYTHONPATH=$LM python3 -m accelerate.commands.launch --config_file examples/accelerate/fsdp_config.yaml \
        --num_processes 1 -m lmstack.cli train /tmp/fr_$run.yaml >"$O/fsdp_resume_$run.log" 2>&1 &
      pid=$!; waited=0
      while kill -0 $pid 2>/dev/null && [ $waited -lt "${FSDP_WAIT:-150}" ]; do sleep 1; waited=$((waited + 1)); done
      if kill -0 $pid 2>/dev/null; then
        echo "fsdp $run still running after ${waited}s: stacks in fsdp_resume_$run.log"
        pkill -ABRT -f "[l]mstack.cli train /tmp/fr_$run.yaml"; sleep 5; pkill -9 -f "[l]mstack.cli train /tmp/fr_$run.yaml"
      else
        wait $pid; echo "fsdp $run rc=$? in ${waited}s"
      fi
    done ;;
  parity)
    for w in ${PARITY_ONLY:-1.5b_lora}; do
      [ "$w" = 7b_lora ] && asset qwen2.5-7b
      PYTHONPATH=$LM python3 bench/fp8_parity.py --assets /tmp/assets --set "${PARITY_SET:-small}" --only "$w" \
        --steps 200 --budget $(($(left) - 15)) 2>&1 | tail -4
    done
    cp bench/results/fp8_parity.jsonl "$O/" 2>/dev/null ;;
  plan)
    plan_json
    PYTHONPATH=$LM python3 bench/plan_accuracy.py /tmp/assets --set "${PLAN_SET:-r4}" --skip-done \
      --out /tmp/plan_accuracy.json --budget $(($(left) - 15)) 2>&1 | grep -v "^\[lmstack\]\|Writing model shards" | tail -22
    cp /tmp/plan_accuracy.json "$O/"
    (cd /tmp/plan_acc && tar czf "$O/plan_acc_logs.tar.gz" ./*.log 2>/dev/null) ;;
  serve)
    VLLM=$(PYTHONPATH=/tmp/site_serve:$LM python3 -c 'import vllm' 2>/dev/null && echo yes || echo no)
    for arch in ${SERVE_ARCHS:-qwen2.5-0.5b}; do
      asset "$arch"
      printf 'model_name_or_path: /tmp/assets/%s\ntemplate: qwen\ndo_sample: false\nmax_new_tokens: 256\ninfer_dtype: bfloat16\n' "$arch" >"/tmp/$arch.yaml"
      serve() {  # name, then serve_bench arguments
        local name=$1; shift
        PYTHONPATH=/tmp/site_serve:$LM timeout $(($(left) - 10)) python3 bench/serve_bench.py "/tmp/$arch.yaml" --requests 32 \
          --concurrency 32 --max-tokens 256 --name "$arch-$name" --results "$O/serve.jsonl" --log "$O/server-$arch-$name.log" "$@" \
          | tail -1 || echo "$arch-$name failed: see $O/server-$arch-$name.log"
      }
      serve hf-batch32 --api-arg=--max-batch=32
      serve hf-batch1 --api-arg=--max-batch=1 --requests 8  # one at a time: 8 requests say its rate
      [ "$VLLM" = yes ] && serve vllm infer_backend=vllm
    done ;;
  batcher)
    for loop in "" --loop; do
      PYTHONPATH=$LM timeout 45 python3 bench/batcher_bench.py /tmp/assets/qwen2.5-0.5b --batch 1 32 \
        --max-tokens 256 --repeat 1 $loop --results "$O/batcher_gpu.jsonl" --name "h200$loop" 2>&1 | tail -3
    done ;;
  vlm)
    PYTHONPATH=$LM timeout 90 python3 bench/vlm_bench.py assets /tmp/vlm 2>&1 | tail -1
    PYTHONPATH=$LM python3 bench/vlm_bench.py yaml /tmp/vlm lora >/tmp/vlm_lora.yaml
    PYTHONPATH=$LM timeout 60 python3 -m lmstack.cli plan /tmp/vlm_lora.yaml --json >"$O/vlm_plan.json" 2>"$O/vlm_plan.err"
    for name in ${VLM_RUNS:-lora full}; do
      PYTHONPATH=$LM timeout $(($(left) - 10)) python3 bench/vlm_bench.py run /tmp/vlm "$name" >"$O/vlm_$name.log" 2>&1
      echo "vlm $name rc=$?"; grep '^RESULT ' "$O/vlm_$name.log" | sed 's/^RESULT //' | tee -a "$O/vlm.jsonl"
    done ;;
  qlora)
    PYTHONPATH=$LM timeout $(($(left) - 10)) python3 bench/qlora_bench.py --assets /tmp/assets --runs nf4,int8,bf16 \
      --steps 20 --timeout 110 2>&1 | tail -6 ;;
  stages)
    PYTHONPATH=$LM python3 bench/stage_bench.py --assets /tmp/assets \
      --runs "${STAGE_RUNS:-dpo_lora_0.5b,sft_lora_0.5b,auto_lora_7b,auto_full_0.5b}" --steps 20 --budget $(($(left) - 10)) 2>&1 | tail -8 ;;
  rl)  # GRPO LoRA step time, lmstack vs TRL's defaults, 1.5B and 7B shapes (bench/rl_bench.py)
    PYTHONPATH=$LM python3 bench/rl_bench.py --assets /tmp/assets --archs "${RL_ARCHS:-qwen2.5-1.5b,qwen2.5-7b}" \
      --steps "${RL_STEPS:-3}" --budget $(($(left) - 10)) --run-id "$RID" 2>&1 | grep '^LINE\|Error' | cut -c1-400 ;;
  rltask)  # the 0.5B arithmetic task: SFT warm start, then GRPO 100 steps, accuracy per step (bench/rl_task.py)
    PYTHONPATH=$LM python3 bench/rl_task.py --assets /tmp/assets --sft-steps "${RL_SFT_STEPS:-60}" --budget $(($(left) - 10)) 2>&1 | tail -12 ;;
  env)
    PYTHONPATH=$LM timeout 60 python3 -m lmstack.cli env 2>&1 | tee "$O/env.txt" | tail -3
    LMSTACK_GPU_NPROC=${NPROC:-2} PYTHONPATH=$LM timeout 150 python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_distributed_gpu.py -k zero3_lora 2>&1 | tee -a "$O/env.txt" | tail -3 ;;
  dist)
    PYTHONPATH=$LM python3 bench/distributed_bench.py all --assets /tmp/assets --nproc "${NPROC:-2}" --steps "${STEPS:-20}" \
      --budget $(($(left) - 15)) --run-id "$RID" ${DIST_ITEMS:+--only $DIST_ITEMS} 2>&1 | tee "$O/dist.log" | grep -v "^\s*$" | tail -20 ;;
  *) echo "unknown phase: $ph" ;;
  esac
  echo "phase $ph done, $(left)s left"
done
echo "done $(($(date +%s) - T0))s"
