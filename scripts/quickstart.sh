#!/usr/bin/env bash
# Quickstart: install lmstack (CPU torch) into .venv, build the built-in tiny model, run a LoRA SFT.
# Offline after the install; about 1-2 minutes of training on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0          # the CPU build (a bare `torch` pulls a CUDA build)
.venv/bin/python -m pip install -q -e .
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -f .tiny/qwen2/config.json ] || .venv/bin/lmstack tiny-model .tiny/qwen2
.venv/bin/lmstack train examples/quickstart.yaml disable_tqdm=true
.venv/bin/python - <<'PY'
import json
rows = [json.loads(l) for l in open("saves/quickstart/trainer_log.jsonl") if '"loss"' in l]
print(f"\nloss: first {rows[0]['loss']:.3f} -> last {rows[-1]['loss']:.3f} over {rows[-1]['current_steps']} steps")
print("outputs in saves/quickstart/ (adapter_model.safetensors, trainer_log.jsonl, training_loss.png, checkpoint-*/)")
PY
