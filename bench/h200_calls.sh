#!/bin/bash
# The GPU calls of a benchmark session on a 2 x H200 machine (device kind nvidia-h200-x2), one phase per
# call, each finishing inside the 10-minute call limit. Results land in $OUT (what comes back) as
# .jsonl lines and logs. Carry: .whl/lf .whl/liger .whl/lm .whl/bnb (bash bench/fetch_wheels.sh here).
#
#   bash bench/h200_calls.sh speed   # GPU0: LLaMA-Factory best config (0.5B full, 0.5B LoRA, 7B LoRA), then
#                                    #       QLoRA 4/8-bit vs bf16 LoRA on 7B;
#                                    # GPU1: lmstack on the same three, then stage_bench (DPO/SFT LoRA, auto)
#   bash bench/h200_calls.sh dist    # `lmstack env` all-reduce on both GPUs, then the 2-GPU matrix
#                                    # (bench/distributed_bench.py --nproc 2)
#   bash bench/h200_calls.sh rest ITEMS   # what an earlier call left: distributed items on NPROC (2) GPUs, e.g.
#        rest 7b_lora:z2,7b_lora:z3,7b_lora:z3_offload   |   NPROC=1 ... rest 0.5b_lora:z3_offload,0.5b_lora:fsdp
#   bash bench/h200_calls.sh single  # 0.5B only: 1-GPU DDP baseline then 2-GPU DDP/FSDP (scaling, one call);
#                                    # both GPUs as two 1-GPU streams: ZeRO-2/3/3+offload and FSDP x LoRA/full;
#                                    # the FSDP + LoRA checkpoint/resume GPU test on 2 ranks
#   bash bench/h200_calls.sh fix5    # GPU0: 1-GPU FSDP LoRA/full, ZeRO-3 full; GPU1: the FSDP GPU tests on one
#                                    # process; then the FSDP + LoRA checkpoint/resume test on 2 ranks
#   bash bench/h200_calls.sh seven   # 7B LoRA on 2 GPUs: ITEMS (default ZeRO-3, ZeRO-2, FSDP, ZeRO-3+offload)
#   bash bench/h200_calls.sh final   # GPU0: LF 0.5B full, GPU1: lmstack 0.5B full (same call: the ratio), then
#                                    # planner-accuracy runs split over both GPUs (bench/plan_accuracy.py
#                                    # --set small), then 2-GPU 7B LoRA DDP/FSDP/ZeRO-2 and 0.5B full DDP
# The two streams of `speed` run at the same time on separate GPUs of one host (32 cores): each
# system has a GPU of its own; they share the CPUs and the disk.
set -u
PHASE=${1:?phase: speed | dist | rest}
cd "$(dirname "$0")/.."
T0=$(date +%s)
END=$((T0 + ${CALL_SECONDS:-575}))
left() { echo $((END - $(date +%s))); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out_local}
mkdir -p "$OUT"
RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
export RUN_ID

install() {  # $1 = target, rest = wheel files
  local target=$1
  shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@" \
    >/dev/null 2>&1 || { echo "wheel install into $target failed"; exit 1; }
}
[ -d /tmp/site_lm/deepspeed ] || install /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl
LM_PATH=/tmp/site_lm:$PWD/src
if [ "$PHASE" = speed ] || [ "$PHASE" = final ] && [ ! -d /tmp/site/llamafactory ]; then install /tmp/site .whl/lf/*.whl .whl/liger/*.whl; fi
echo "wheels ready after $(($(date +%s) - T0))s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
case "$PHASE" in
final) ARCHS=qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b ;;
single | fix5) ARCHS=qwen2.5-0.5b ;;
seven) ARCHS=qwen2.5-7b ;;
*) ARCHS=qwen2.5-0.5b,qwen2.5-7b ;;
esac
for arch in ${ARCHS//,/ }; do
  if [ ! -f /tmp/assets/$arch/config.json ]; then
    CUDA_VISIBLE_DEVICES=0 python3 bench/make_assets.py /tmp/assets $ARCHS 2>&1 | grep -v Writing | tail -4
    break
  fi
done
echo "assets ready after $(($(date +%s) - T0))s"

dist() {  # $1 = GPUs per run, $2 = items, rest = extra arguments
  local n=$1 items=$2
  shift 2
  PYTHONPATH=$LM_PATH python3 bench/distributed_bench.py all --assets /tmp/assets --nproc "$n" --steps "${STEPS:-20}" \
    --run-id "$RUN_ID" --only "$items" "$@"
}
gpu_tests() {  # $1 = processes, $2 = pytest -k expression
  LMSTACK_GPU_NPROC=$1 PYTHONPATH=$LM_PATH timeout $(($(left) - 10)) python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_distributed_gpu.py -k "$2" 2>&1 | tail -4
}

case "$PHASE" in
speed)
  (
    B=$(($(left) - 200))  # LF's three runs, then QLoRA in what is left
    CUDA_VISIBLE_DEVICES=0 python3 bench/lmstack_bench.py all --systems llamafactory --set default --budget $B \
      --run-id "$RUN_ID" --logs /tmp/logs_lf
    Q=$(($(left) - 10))
    [ $Q -gt 90 ] && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$LM_PATH timeout $Q python3 bench/qlora_bench.py \
      --assets /tmp/assets --runs nf4,int8,bf16 --steps 20 --timeout 110
  ) >"$OUT/stream_gpu0.log" 2>&1 &
  (
    B=$(($(left) - 200))
    CUDA_VISIBLE_DEVICES=1 python3 bench/lmstack_bench.py all --systems lmstack --set default --budget $B \
      --run-id "$RUN_ID" --logs /tmp/logs_lm
    S=$(($(left) - 10))
    [ $S -gt 60 ] && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$LM_PATH python3 bench/stage_bench.py --assets /tmp/assets \
      --runs dpo_lora_0.5b,sft_lora_0.5b,auto_lora_7b,auto_full_0.5b --steps 20 --budget $S
  ) >"$OUT/stream_gpu1.log" 2>&1 &
  wait
  ;;
final)
  PLAN_A=0.5b_full_mb2_s1024,0.5b_full_mb4_s2048_ckpt,0.5b_full_mb8_s2048_liger,0.5b_lora_mb8_s2048_ckpt,0.5b_full_mb4_z2,0.5b_full_mb4_z3_offload,1.5b_full_mb2_s2048,1.5b_full_mb8_liger,1.5b_lora_mb8_ckpt
  PLAN_B=0.5b_lora_mb2_s4096,0.5b_full_mb4_s2048,0.5b_lora_mb4_s2048,0.5b_full_mb8_s2048_ckpt,0.5b_full_mb4_z3,0.5b_lora_mb4_z3,1.5b_full_mb4_s2048_ckpt,1.5b_lora_mb4_s2048,1.5b_full_mb4_z2
  A_END=$(($(date +%s) + $(left) - 300))  # both GPUs to themselves until 300 s before the end
  (
    CUDA_VISIBLE_DEVICES=0 python3 bench/lmstack_bench.py all --systems llamafactory --set full05 --budget 150 \
      --run-id "$RUN_ID" --logs /tmp/logs_lf
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$LM_PATH timeout $((A_END - $(date +%s))) python3 bench/plan_accuracy.py \
      /tmp/assets "$OUT/plan_runs_gpu0.json" --set small --only $PLAN_A --timeout 90
  ) >/tmp/stream_gpu0.log 2>&1 &
  (
    CUDA_VISIBLE_DEVICES=1 python3 bench/lmstack_bench.py all --systems lmstack --set full05 --budget 170 \
      --run-id "$RUN_ID" --logs /tmp/logs_lm
    CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$LM_PATH timeout $((A_END - $(date +%s))) python3 bench/plan_accuracy.py \
      /tmp/assets "$OUT/plan_runs_gpu1.json" --set small --only $PLAN_B --timeout 90
  ) >/tmp/stream_gpu1.log 2>&1 &
  wait
  PYTHONPATH=$LM_PATH python3 bench/distributed_bench.py all --assets /tmp/assets --nproc 2 --steps 20 \
    --budget $(($(left) - 15)) --run-id "$RUN_ID" --only 7b_lora:ddp,0.5b_full:ddp,7b_lora:fsdp,7b_lora:z2 2>&1 |
    tee /tmp/dist.log | grep -v "^\s*$" | tail -8
  tail -3 /tmp/stream_gpu0.log /tmp/stream_gpu1.log
  ;;
single)
  # scaling, 1 -> 2 GPUs, same harness and call; nothing else runs meanwhile
  CUDA_VISIBLE_DEVICES=0 dist 1 0.5b_full:ddp --budget 120 >/tmp/dist.log 2>&1
  dist 2 0.5b_full:ddp,0.5b_full:fsdp --budget 200 >>/tmp/dist.log 2>&1
  B=$(($(left) - 100))
  CUDA_VISIBLE_DEVICES=0 dist 1 0.5b_lora:z3_offload,0.5b_full:z2,0.5b_lora:z2,0.5b_full:fsdp --budget $B \
    --work /tmp/dist_bench/gpu0 >/tmp/stream_gpu0.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 dist 1 0.5b_lora:fsdp,0.5b_full:z3_offload,0.5b_lora:z3,0.5b_full:z3 --budget $B \
    --work /tmp/dist_bench/gpu1 >/tmp/stream_gpu1.log 2>&1 &
  wait
  # FSDP + LoRA on 2 ranks through the Trainer: checkpoint adapter non-empty, resume continues the run
  gpu_tests 2 fsdp_lora_checkpoint | tee "$OUT/fsdp_resume_test.txt"
  grep -h "status\|gpu " /tmp/dist.log /tmp/stream_gpu*.log | grep -v "^{" | tail -14
  cp /tmp/dist_bench/gpu*/*.log /tmp/dist_bench/ 2>/dev/null
  ;;
fix5)
  CUDA_VISIBLE_DEVICES=0 dist 1 0.5b_lora:fsdp,0.5b_full:fsdp,0.5b_full:z3,0.5b_lora:z2 --budget $(($(left) - 130)) \
    --work /tmp/dist_bench/gpu0 >/tmp/stream_gpu0.log 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    echo "== 1 process: FSDP1/FSDP2 x LoRA/full SFT, FSDP + LoRA checkpoint/resume"
    END1=$(($(date +%s) + $(left) - 130))
    left() { echo $((END1 - $(date +%s))); }
    gpu_tests 1 "fsdp_sft_through or fsdp_lora_checkpoint"
  ) >"$OUT/fsdp_gpu_tests.txt" 2>&1 &
  wait
  echo "== 2 processes: FSDP + LoRA checkpoint/resume" >>"$OUT/fsdp_gpu_tests.txt"
  gpu_tests 2 fsdp_lora_checkpoint >>"$OUT/fsdp_gpu_tests.txt" 2>&1
  cat "$OUT/fsdp_gpu_tests.txt"
  grep -h "tok/s" /tmp/stream_gpu*.log
  cp /tmp/dist_bench/gpu*/*.log /tmp/dist_bench/ 2>/dev/null
  if [ "$(left)" -gt 220 ]; then  # what time is left: the first 7B LoRA item on both GPUs
    CUDA_VISIBLE_DEVICES=0 python3 bench/make_assets.py /tmp/assets qwen2.5-7b 2>&1 | grep built
    dist 2 7b_lora:fsdp --budget $(($(left) - 15)) 2>&1 | tee /tmp/dist.log | grep "tok/s"
  fi
  ;;
seven)
  dist 2 "${ITEMS:-7b_lora:z3,7b_lora:z2,7b_lora:fsdp,7b_lora:z3_offload}" --budget $(($(left) - 15)) 2>&1 |
    tee /tmp/dist.log | grep -v "^\s*$" | tail -8
  ;;
dist | rest)
  if [ "$PHASE" = dist ]; then
    PYTHONPATH=$LM_PATH timeout 60 python3 -m lmstack.cli env 2>&1 | tee "$OUT/env.txt" | tail -3
    # ZeRO-3 + LoRA across both GPUs: every saved adapter tensor non-empty, reload gives the same logits
    LMSTACK_GPU_NPROC=2 PYTHONPATH=$LM_PATH timeout 150 python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_distributed_gpu.py -k zero3_lora 2>&1 | tee -a "$OUT/env.txt" | tail -3
    ITEMS=""
  else
    ITEMS=${2:?items}
  fi
  PYTHONPATH=$LM_PATH python3 bench/distributed_bench.py all --assets /tmp/assets --nproc "${NPROC:-2}" --steps 20 \
    --budget $(($(left) - 15)) --run-id "$RUN_ID" ${ITEMS:+--only $ITEMS} 2>&1 | tee "$OUT/dist.log" | grep -v "^\s*$" | tail -20
  ;;
esac
# at most 8 files come back: one tarball of every log replaces the per-stream ones written during the runs
tar czf "$OUT/logs.tar.gz" /tmp/logs_lf /tmp/logs_lm /tmp/dist_bench/*.log /tmp/stage_bench/*.log /tmp/stream_gpu*.log \
  /tmp/dist.log 2>/dev/null
[ -s "$OUT/logs.tar.gz" ] && rm -f "$OUT"/bench_logs_*.tar.gz
echo "phase $PHASE done after $(($(date +%s) - T0))s"
ls "$OUT"
