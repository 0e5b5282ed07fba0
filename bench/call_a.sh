#!/bin/bash
# One H200 call (2026-12-01 session): FSDP1 + LoRA diagnosis (fused vs PEFT LoRA kernel), the Unsloth
# GPU tests (in Unsloth's own env), serving on 0.5B (batch 32 vs one at a time), Qwen2.5-VL-3B image SFT
# with the planner's prediction, then the planner accuracy runs with what is left. carry: .whl
set -u
T0=$(date +%s)
el() { echo $(( $(date +%s)-T0 )); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TORCH_CUDA_ARCH_LIST=9.0
O=${OUT:-/tmp/out_local}; mkdir -p "$O"
pip_t() { t=$1; shift; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $t "$@" >/tmp/pip_$(basename $t).log 2>&1 || { echo "install $t failed"; tail -5 /tmp/pip_$(basename $t).log; }; }
pip_t /tmp/site_lm .whl/lm/*.whl .whl/bnb/*.whl .whl/ao/*.whl
pip_t /tmp/site_uns .whl/uns/*.whl .whl/bnb/*.whl .whl/ao/*.whl
pip_t /tmp/site_serve .whl/serve/*.whl
echo "wheels $(el)s"
LM=/tmp/site_lm:$PWD/src
# 1. FSDP1 + LoRA through accelerate: the fused LoRA kernel vs PEFT's
PYTHONPATH=$LM python3 -m lmstack.cli tiny-model /tmp/tiny >/dev/null 2>&1
for k in fused peft; do
  printf 'model_name_or_path: /tmp/tiny\ntemplate: qwen\nstage: sft\ndo_train: true\nfinetuning_type: lora\nlora_target: all\ndataset: alpaca_en_demo\ndataset_dir: %s/data\ncutoff_len: 128\noutput_dir: /tmp/fsdp_%s\nper_device_train_batch_size: 4\nlearning_rate: 0.005\nmax_steps: 6\nlogging_steps: 1\nsave_strategy: "no"\nreport_to: none\nbf16: true\nlora_kernel: %s\n' "$PWD" $k $k > /tmp/fsdp_$k.yaml
  PYTHONPATH=$LM timeout 90 python3 -m accelerate.commands.launch --config_file examples/accelerate/fsdp_config.yaml \
    --num_processes 1 -m lmstack.cli train /tmp/fsdp_$k.yaml > "$O/fsdp_$k.log" 2>&1
  echo "fsdp1 lora_kernel=$k rc=$? $(el)s"; grep -E "Error|error" "$O/fsdp_$k.log" | grep -v "error_file\|elastic" | tail -3
done
# 1b. FP8: the kernels and a short training run (tests/gpu/test_fp8_gpu.py)
PYTHONPATH=$LM timeout 150 python3 -m pytest -p no:cacheprovider -q -rf tests/gpu/test_fp8_gpu.py tests/gpu/test_fused_lora_gpu.py \
  > "$O/fp8_tests.log" 2>&1; echo "fp8 tests rc=$? $(el)s"; tail -8 "$O/fp8_tests.log" | grep -v "^\s*$"
# 2. Unsloth: lmstack's use_unsloth path and packed-document isolation, in Unsloth's env
PYTHONPATH=/tmp/site_uns:$PWD/src timeout 150 python3 -m pytest -p no:cacheprovider -q -rf tests/gpu/test_unsloth_gpu.py \
  > "$O/unsloth_tests.log" 2>&1; echo "unsloth tests rc=$? $(el)s"; tail -15 "$O/unsloth_tests.log" | grep -v "^\s*$"
# 3. serving, 0.5B: continuous batching (32 concurrent) vs one at a time
python3 bench/make_assets.py /tmp/assets qwen2.5-0.5b 2>&1 | grep -v Writing | tail -1
printf 'model_name_or_path: /tmp/assets/qwen2.5-0.5b\ntemplate: qwen\ndo_sample: false\nmax_new_tokens: 256\ninfer_dtype: bfloat16\n' > /tmp/s05.yaml
SP=/tmp/site_serve:$LM
PYTHONPATH=$SP timeout 120 python3 bench/serve_bench.py /tmp/s05.yaml --requests 32 --concurrency 32 --max-tokens 128 \
  --name qwen2.5-0.5b-hf-batch32 --results "$O/serve.jsonl" --log "$O/server-b32.log" --api-arg=--max-batch=32 | tail -1
PYTHONPATH=$SP timeout 90 python3 bench/serve_bench.py /tmp/s05.yaml --requests 8 --concurrency 8 --max-tokens 128 \
  --name qwen2.5-0.5b-hf-batch1 --results "$O/serve.jsonl" --log "$O/server-b1.log" --api-arg=--max-batch=1 | tail -1
echo "serve $(el)s"
# 4. Qwen2.5-VL-3B image SFT (LoRA), and the planner's prediction of the same run
PYTHONPATH=$LM timeout 90 python3 bench/vlm_bench.py assets /tmp/vlm 2>&1 | tail -1
PYTHONPATH=$LM python3 bench/vlm_bench.py yaml /tmp/vlm lora > /tmp/vlm_lora.yaml
PYTHONPATH=$LM timeout 60 python3 -m lmstack.cli plan /tmp/vlm_lora.yaml --json > "$O/vlm_plan.json" 2>"$O/vlm_plan.err"; echo "vlm plan rc=$?"
PYTHONPATH=$LM timeout 170 python3 bench/vlm_bench.py run /tmp/vlm lora > "$O/vlm_lora.log" 2>&1; echo "vlm rc=$? $(el)s"
grep '^RESULT ' "$O/vlm_lora.log" | tee "$O/vlm.jsonl"; grep -E "Error" "$O/vlm_lora.log" | tail -3
# 5. planner accuracy with what is left
BUDGET=$(( 575 - $(el) )) timeout $(( 580 - $(el) )) bash bench/plan_accuracy_call.sh 2>&1 | tail -25
echo "done $(el)s"
