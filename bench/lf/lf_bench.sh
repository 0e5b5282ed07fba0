#!/bin/bash
# Copied from the team kit (../shared/bench); make_assets.py is bench/make_assets.py (same data, same seed).
# Usage on the GPU machine, from a repo root holding .whl/ (see fetch_lf_wheels.sh): bash PATH/lf_bench.sh ARCHS RUNSET
# To use from the project: copy this folder into a git-ignored folder of the checkout and take it along with .whl.
# Installs the carried LLaMA-Factory wheel set, builds assets, runs the named LLaMA-Factory configs.
set -u
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/lf/*.whl .whl/liger/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site
A=/tmp/assets
python3 $D/../make_assets.py $A "$1" 2>&1 | grep -v Writing | tail -5
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 - "$2" <<'PY' > /tmp/runs.txt
import json, sys
A = "/tmp/assets"
base = dict(template="qwen", stage="sft", do_train=True, dataset="synth", dataset_dir=f"{A}/data", cutoff_len=2048,
            max_samples=3000, preprocessing_num_workers=8, logging_steps=10, save_strategy="no", overwrite_output_dir=True,
            learning_rate=1e-4, lr_scheduler_type="cosine", warmup_ratio=0.05, bf16=True, report_to="none",
            include_effective_tokens_per_second=True, flash_attn="sdpa", seed=42, overwrite_cache=True)
lora = dict(finetuning_type="lora", lora_target="all", lora_rank=8, lora_alpha=16)
full = dict(finetuning_type="full")
best = dict(packing=True, enable_liger_kernel=True)
sets = {
 "small": [("lf_0.5b_lora_bs8", "qwen2.5-0.5b", {**lora, "per_device_train_batch_size": 8, "max_steps": 60}),
           ("lf_0.5b_lora_pack_liger", "qwen2.5-0.5b", {**lora, **best, "per_device_train_batch_size": 4, "max_steps": 60}),
           ("lf_0.5b_full_bs8", "qwen2.5-0.5b", {**full, "per_device_train_batch_size": 8, "max_steps": 60}),
           ("lf_0.5b_full_pack_liger", "qwen2.5-0.5b", {**full, **best, "per_device_train_batch_size": 4, "max_steps": 60})],
 "big":   [("lf_7b_lora_bs8", "qwen2.5-7b", {**lora, "per_device_train_batch_size": 8, "max_steps": 30}),
           ("lf_7b_lora_pack_liger", "qwen2.5-7b", {**lora, **best, "per_device_train_batch_size": 4, "max_steps": 30})],
}
for name, arch, extra in sets[sys.argv[1]]:
    print(name + "\t" + json.dumps({**base, **extra, "model_name_or_path": f"{A}/{arch}", "output_dir": f"/tmp/out/{name}"}))
PY
while IFS=$'\t' read -r name args; do
  timeout 420 python3 $D/lf_run.py "$args" "$name" > ${OUT:-/tmp}/$name.log 2>&1
  echo "rc=$? $(grep -h RESULT ${OUT:-/tmp}/$name.log || tail -3 ${OUT:-/tmp}/$name.log)"
done < /tmp/runs.txt
