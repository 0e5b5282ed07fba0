"""Planner accuracy on the GPU: short real `lmstack train` runs, each *predicted before it is measured*,
the planner's per-GPU breakdown next to the measured `torch.cuda.max_memory_allocated()` /
`max_memory_reserved()`, merged into bench/results/plan_accuracy.json as `basis: "predicted"` rows with
the planner version that predicted them (a hash of src/lmstack/plan/*.py and src/lmstack/memory/*.py).

    python3 bench/plan_accuracy.py ASSETS [--set stages|small|big|all] [--only NAME,...] [--out JSON]
                                   [--budget S] [--skip-done] [--steps N]
        ASSETS: bench/make_assets.py's folder (models + synth data); the preference / KTO sets and the
        GRPO reward function are derived from synth here. Each run is a child process (`--child`) so
        peaks never leak between runs; runs are skipped once less than MIN_LEFT_S of --budget is left
        (--skip-done continues a set in a second call).
    python3 bench/plan_accuracy.py --dry-run [--only ...] [--out JSON]
        CPU: the same runs on lmstack's tiny model (predicted, then trained one step on the CPU where
        they can be; QLoRA only predicted), written to --out (never to bench/results).
One GPU call (wheels, assets, the stage set): PHASES=plan PLAN_SET=... bash bench/device.sh.
The prediction compared is the planner's `allocated` figure (its total without the fragmentation and
CUDA-context margins, which max_memory_allocated does not see); `reserved` is compared with
max_memory_reserved.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Z2, Z3, Z3OFF = (
    f"{REPO}/examples/deepspeed/ds_z2_config.json",
    f"{REPO}/examples/deepspeed/ds_z3_config.json",
    f"{REPO}/examples/deepspeed/ds_z3_offload_config.json",
)

# name, arch, overrides (all runs: packing on, bf16, sdpa unless said, 4 steps)
SMALL = [
    (
        "0.5b_full_mb2_s1024",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=2, cutoff_len=1024),
    ),
    ("0.5b_full_mb4_s2048", "qwen2.5-0.5b", dict(finetuning_type="full", per_device_train_batch_size=4)),
    (
        "0.5b_full_mb4_s2048_ckpt",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, gradient_checkpointing=True),
    ),
    (
        "0.5b_full_mb8_s2048_ckpt",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=8, gradient_checkpointing=True),
    ),
    (
        "0.5b_full_mb8_s2048_liger",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=8, enable_liger_kernel=True),
    ),
    ("0.5b_lora_mb4_s2048", "qwen2.5-0.5b", dict(per_device_train_batch_size=4)),
    (
        "0.5b_lora_mb8_s2048_ckpt",
        "qwen2.5-0.5b",
        dict(per_device_train_batch_size=8, gradient_checkpointing=True),
    ),
    ("0.5b_lora_mb2_s4096", "qwen2.5-0.5b", dict(per_device_train_batch_size=2, cutoff_len=4096)),
    (
        "0.5b_full_mb4_z2",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z2),
    ),
    (
        "0.5b_full_mb4_z3",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z3),
    ),
    (
        "0.5b_full_mb4_z3_offload",
        "qwen2.5-0.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z3OFF),
    ),
    ("0.5b_lora_mb4_z3", "qwen2.5-0.5b", dict(per_device_train_batch_size=4, deepspeed=Z3)),
    ("1.5b_full_mb2_s2048", "qwen2.5-1.5b", dict(finetuning_type="full", per_device_train_batch_size=2)),
    (
        "1.5b_full_mb4_s2048_ckpt",
        "qwen2.5-1.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, gradient_checkpointing=True),
    ),
    (
        "1.5b_full_mb8_liger",
        "qwen2.5-1.5b",
        dict(finetuning_type="full", per_device_train_batch_size=8, enable_liger_kernel=True),
    ),
    ("1.5b_lora_mb4_s2048", "qwen2.5-1.5b", dict(per_device_train_batch_size=4)),
    ("1.5b_lora_mb8_ckpt", "qwen2.5-1.5b", dict(per_device_train_batch_size=8, gradient_checkpointing=True)),
    (
        "1.5b_full_mb4_z2",
        "qwen2.5-1.5b",
        dict(finetuning_type="full", per_device_train_batch_size=4, deepspeed=Z2),
    ),
]
BIG = [
    ("7b_lora_mb2_ckpt", "qwen2.5-7b", dict(per_device_train_batch_size=2, gradient_checkpointing=True)),
    ("7b_lora_mb4", "qwen2.5-7b", dict(per_device_train_batch_size=4)),
    ("7b_lora_mb8_ckpt", "qwen2.5-7b", dict(per_device_train_batch_size=8, gradient_checkpointing=True)),
    ("7b_lora_mb4_liger", "qwen2.5-7b", dict(per_device_train_batch_size=4, enable_liger_kernel=True)),
]


def base_config(assets: str, arch: str, name: str, overrides: dict) -> dict:
    cfg = dict(
        model_name_or_path=f"{assets}/{arch}",
        template="qwen",
        stage="sft",
        do_train=True,
        finetuning_type="lora",
        lora_target="all",
        lora_rank=8,
        lora_alpha=16,
        dataset="synth",
        dataset_dir=f"{assets}/data",
        cutoff_len=2048,
        max_samples=1500,
        packing=True,
        preprocessing_num_workers=8,
        output_dir=f"/tmp/plan_acc/{name}",
        overwrite_output_dir=True,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-5,
        max_steps=4,
        bf16=True,
        flash_attn="sdpa",
        gradient_checkpointing=False,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    cfg.update(overrides)
    return cfg


def predict(
    cfg_dict: dict,
    gpu_gib: float,
    gpus: int = 1,
    fsdp: bool = False,
    seq_len: int | None = None,
    prompt_len: int | None = None,
) -> dict:
    """The planner's per-GPU breakdown of the configured setup; `seq_len` / `prompt_len` replace the
    data-aware lengths (recomputing a run whose data is not at hand)."""
    import dataclasses

    from lmstack.config.load import build_config
    from lmstack.memory import plan
    from lmstack.plan.whatif import request_from_config

    req = request_from_config(build_config(cfg_dict), gpus, gpu_gib)
    if fsdp:
        req = dataclasses.replace(req, fsdp=True)
    if seq_len:
        req = dataclasses.replace(req, seq_len=seq_len)
    if prompt_len:
        req = dataclasses.replace(req, prompt_len=prompt_len)
    result = plan(req)
    if result.configured is None:
        raise ValueError("the planner found no estimate for the configured setup")
    parts = result.configured.estimate.gpu.to_dict()
    parts["allocated_equiv"] = parts["allocated"]  # the figure torch.cuda.max_memory_allocated() measures
    return parts


# ---- the stage set: every stage's own terms, unpacked rows with their real lengths, QLoRA ------------
LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=8, lora_alpha=16)
UNPACKED = dict(packing=False, cutoff_len=2048)
PAIR = dict(dataset="synth_pref", packing=False, cutoff_len=1024, pref_beta=0.1)
S05, S15, S7 = "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"
GRPO = dict(stage="grpo", dataset="synth", packing=False, cutoff_len=512, max_new_tokens=256, num_generations=4,
            reward_funcs="REWARD", pref_beta=0.04, temperature=1.0)  # fmt: skip
# name, arch, overrides, runs on a CPU in --dry-run; ordered by what matters most if the budget runs out
STAGES = [
    (
        "sft_unpacked_0.5b_lora_mb8",
        S05,
        dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=8),
        True,
    ),
    (
        "dpo_0.5b_lora_mb4",
        S05,
        dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=4),
        True,
    ),
    (
        "kto_0.5b_lora_mb4",
        S05,
        dict(
            stage="kto",
            dataset="synth_kto",
            **LORA,
            packing=False,
            cutoff_len=1024,
            per_device_train_batch_size=4,
        ),
        True,
    ),  # fmt: skip
    ("rm_0.5b_lora_mb4", S05, dict(stage="rm", **LORA, **PAIR, per_device_train_batch_size=4), True),
    (
        "orpo_0.5b_lora_mb4",
        S05,
        dict(stage="dpo", pref_loss="orpo", **LORA, **PAIR, per_device_train_batch_size=4),
        True,
    ),
    (
        "simpo_0.5b_lora_mb4",
        S05,
        dict(stage="dpo", pref_loss="simpo", **LORA, **PAIR, per_device_train_batch_size=4),
        True,
    ),
    ("grpo_0.5b_lora_mb8", S05, dict(**GRPO, **LORA, per_device_train_batch_size=8), True),
    (
        "dpo_7b_lora_mb2",
        S7,
        dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=2),
        True,
    ),
    (
        "sft_unpacked_7b_lora_mb4",
        S7,
        dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=4),
        True,
    ),
    (
        "qlora4_unpacked_0.5b_mb8",
        S05,
        dict(stage="sft", **LORA, **UNPACKED, quantization_bit=4, per_device_train_batch_size=8),
        False,
    ),  # fmt: skip
    (
        "sft_unpacked_0.5b_lora_mb8_alloc",
        S05,
        dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=8),
        True,
    ),  # sft_unpacked_0.5b_lora_mb8 again, now with plan.allocator (expandable segments): the reserved peak
    (
        "dpo_0.5b_full_mb4",
        S05,
        dict(
            stage="dpo",
            pref_loss="sigmoid",
            finetuning_type="full",
            **PAIR,
            per_device_train_batch_size=4,
            learning_rate=1e-6,
        ),
        True,
    ),  # fmt: skip
    (
        "sft_unpacked_0.5b_full_mb4",
        S05,
        dict(stage="sft", finetuning_type="full", **UNPACKED, per_device_train_batch_size=4),
        True,
    ),  # fmt: skip
    ("fp8_7b_lora_mb4", S7, dict(stage="sft", **LORA, per_device_train_batch_size=4, fp8=True), False),
    (
        "kto_7b_lora_mb2",
        S7,
        dict(
            stage="kto",
            dataset="synth_kto",
            **LORA,
            packing=False,
            cutoff_len=1024,
            per_device_train_batch_size=2,
        ),
        True,
    ),  # fmt: skip
    ("grpo_7b_lora_mb4", S7, dict(**GRPO, **LORA, per_device_train_batch_size=4), True),
    (
        "qlora4_unpacked_7b_mb4",
        S7,
        dict(stage="sft", **LORA, **UNPACKED, quantization_bit=4, per_device_train_batch_size=4),
        False,
    ),  # fmt: skip
    (
        "dpo_1.5b_lora_mb4",
        S15,
        dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=4),
        True,
    ),
]
# Round 4 (this session's planner, each run new to it): every run is exactly one epoch of its data
# (`_epoch`: max_samples = the rows max_steps draws), so the batch that holds the data's longest row is formed
# and the data-aware bound is the row length the run really reaches -- the error is the memory model's own.
# `_steps` replaces --steps for one run (the 7B GRPO generates for most of its step).
EPOCH = {"_epoch": True}
STAGES_R4 = [
    ("r4_dpo_0.5b_lora_mb8", S05, dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=8, **EPOCH), True),
    ("r4_simpo_0.5b_lora_mb2_c2048", S05, dict(stage="dpo", pref_loss="simpo", **LORA, **{**PAIR, "cutoff_len": 2048},
                                                per_device_train_batch_size=2, **EPOCH), True),
    ("r4_orpo_0.5b_full_mb2", S05, dict(stage="dpo", pref_loss="orpo", finetuning_type="full", **PAIR,
                                         per_device_train_batch_size=2, learning_rate=1e-6, **EPOCH), True),
    ("r4_kto_0.5b_lora_mb8", S05, dict(stage="kto", dataset="synth_kto", **LORA, packing=False, cutoff_len=1024,
                                        per_device_train_batch_size=8, **EPOCH), True),
    ("r4_rm_0.5b_full_mb4", S05, dict(stage="rm", finetuning_type="full", **PAIR, per_device_train_batch_size=4,
                                       learning_rate=1e-6, **EPOCH), True),
    ("r4_grpo_0.5b_lora_mb8_g8", S05, dict(**{**GRPO, "num_generations": 8, "max_new_tokens": 128}, **LORA,
                                            per_device_train_batch_size=8, **EPOCH), True),
    ("r4_sft_unpacked_0.5b_lora_mb16", S05, dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=16, **EPOCH), True),
    ("r4_dpo_1.5b_lora_mb4", S15, dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=4, **EPOCH), True),
    ("r4_kto_1.5b_lora_mb4", S15, dict(stage="kto", dataset="synth_kto", **LORA, packing=False, cutoff_len=1024,
                                        per_device_train_batch_size=4, **EPOCH), True),
    ("r4_rm_1.5b_lora_mb8", S15, dict(stage="rm", **LORA, **PAIR, per_device_train_batch_size=8, **EPOCH), True),
    ("r4_qlora4_unpacked_1.5b_mb8", S15, dict(stage="sft", **LORA, **UNPACKED, quantization_bit=4,
                                               per_device_train_batch_size=8, **EPOCH), False),
    ("r4_sft_unpacked_1.5b_full_mb4", S15, dict(stage="sft", finetuning_type="full", **UNPACKED,
                                                 per_device_train_batch_size=4, **EPOCH), True),
    ("r4_fp8_1.5b_full_mb8", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=8, fp8=True), False),
    ("r4_dpo_7b_lora_mb4", S7, dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=4, **EPOCH), True),
    ("r4_simpo_7b_lora_mb2", S7, dict(stage="dpo", pref_loss="simpo", **LORA, **PAIR, per_device_train_batch_size=2, **EPOCH), True),
    ("r4_qlora4_unpacked_7b_mb4", S7, dict(stage="sft", **LORA, **UNPACKED, quantization_bit=4,
                                            per_device_train_batch_size=4, **EPOCH), False),
    ("r4_grpo_7b_lora_mb4", S7, dict(**{**GRPO, "max_new_tokens": 64}, **LORA, per_device_train_batch_size=4,
                                      _steps=3, **EPOCH), True),
]  # fmt: skip
# Round 5 (next): runs new to the planner, weighted to round 4's weak spot -- full fine-tunes with an unfused
# loss head (round 4's worst, ORPO on a full 0.5B, +12.3%) -- run after `--set snap` has shown where their
# peak is and the planner is fixed for it; one epoch each, as round 4 (the 7B runs its budget left moved to round 6)
STAGES_R5 = [
    ("r5_orpo_1.5b_full_mb2", S15, dict(stage="dpo", pref_loss="orpo", finetuning_type="full", **PAIR,
                                         per_device_train_batch_size=2, learning_rate=1e-6, **EPOCH), True),
    ("r5_dpo_1.5b_full_mb2", S15, dict(stage="dpo", pref_loss="sigmoid", finetuning_type="full", **PAIR,
                                        per_device_train_batch_size=2, learning_rate=1e-6, **EPOCH), True),
    ("r5_kto_0.5b_full_mb4", S05, dict(stage="kto", dataset="synth_kto", finetuning_type="full", packing=False,
                                        cutoff_len=1024, per_device_train_batch_size=4, learning_rate=1e-6, **EPOCH), True),
    ("r5_rm_1.5b_full_mb2", S15, dict(stage="rm", finetuning_type="full", **PAIR, per_device_train_batch_size=2,
                                       learning_rate=1e-6, **EPOCH), True),
    ("r5_sft_unpacked_0.5b_full_mb8", S05, dict(stage="sft", finetuning_type="full", **UNPACKED,
                                                 per_device_train_batch_size=8, **EPOCH), True),
    ("r5_sft_1.5b_full_mb4_ckpt", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=4,
                                             gradient_checkpointing=True), True),
    ("r5_simpo_1.5b_lora_mb4", S15, dict(stage="dpo", pref_loss="simpo", **LORA, **PAIR, per_device_train_batch_size=4,
                                          **EPOCH), True),
]  # fmt: skip
# Round 6 (next): runs new to the planner after round 5's fixes (estimate.gradients_at_peak, the foreach AdamW
# step, the partial-checkpointing backward start) at their edges -- the fused AdamW next to the foreach one,
# gradient accumulation (gradients alive through the next forward), SimPO and rm full fine-tunes -- and round
# 5's runs its budget left (the 7B ones; the GRPO 1.5B with fewer tokens, it timed out at 19.6 s a step)
STAGES_R6 = [
    ("r6_sft_1.5b_full_mb4_ckpt_fused", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=4,
                                                   gradient_checkpointing=True, optim="adamw_torch_fused"), True),
    ("r6_orpo_0.5b_full_mb2_ga2", S05, dict(stage="dpo", pref_loss="orpo", finetuning_type="full", **PAIR,
                                             per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                             learning_rate=1e-6, **EPOCH), True),
    ("r6_simpo_1.5b_full_mb2", S15, dict(stage="dpo", pref_loss="simpo", finetuning_type="full", **PAIR,
                                          per_device_train_batch_size=2, learning_rate=1e-6, **EPOCH), True),
    ("r6_rm_0.5b_full_mb8", S05, dict(stage="rm", finetuning_type="full", **PAIR, per_device_train_batch_size=8,
                                       learning_rate=1e-6, **EPOCH), True),
    ("r6_sft_0.5b_full_mb4_ga4", S05, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=4,
                                            gradient_accumulation_steps=4), True),
    ("r6_sft_1.5b_full_mb8_ckpt", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=8,
                                             gradient_checkpointing=True), True),
    ("r6_kto_7b_lora_mb4", S7, dict(stage="kto", dataset="synth_kto", **LORA, packing=False, cutoff_len=1024,
                                     per_device_train_batch_size=4, **EPOCH), True),
    ("r6_orpo_7b_lora_mb2", S7, dict(stage="dpo", pref_loss="orpo", **LORA, **PAIR, per_device_train_batch_size=2,
                                      **EPOCH), True),
    ("r6_sft_unpacked_7b_lora_mb8_ckpt", S7, dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=8,
                                                   gradient_checkpointing=True, **EPOCH), True),
    ("r6_grpo_1.5b_lora_mb8", S15, dict(**{**GRPO, "max_new_tokens": 128}, **LORA, per_device_train_batch_size=8,
                                         _steps=3, **EPOCH), True),
]  # fmt: skip
# Round 7 (next): runs new to the planner after round 6's fixes -- gradient accumulation under classic AMP
# (memory.ACCUMULATING_CLASSIC_AMP_MARGIN_BYTES) at another size and on every stage's loss path, and full
# checkpointing with transformers' own SwiGLU (memory.stock_recompute_backward_bytes_per_token) packed,
# unpacked and under TRL's loss heads; ordered by what matters most if the budget runs out (the four its
# budget left moved to round 8)
STAGES_R7 = [
    ("r7_sft_1.5b_full_mb2_ga4", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=2,
                                            gradient_accumulation_steps=4), True),
    ("r7_dpo_0.5b_full_mb2_ga2", S05, dict(stage="dpo", pref_loss="sigmoid", finetuning_type="full", **PAIR,
                                            per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                            learning_rate=1e-6, **EPOCH), True),
    ("r7_sft_1.5b_lora_mb8_ckpt", S15, dict(stage="sft", **LORA, per_device_train_batch_size=8,
                                             gradient_checkpointing=True), True),
    ("r7_sft_unpacked_1.5b_lora_mb16_ckpt", S15, dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=16,
                                                       gradient_checkpointing=True, **EPOCH), True),
    ("r7_sft_unpacked_0.5b_full_mb4_ga2", S05, dict(stage="sft", finetuning_type="full", **UNPACKED,
                                                     per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                                     **EPOCH), True),
    ("r7_rm_0.5b_full_mb4_ga2", S05, dict(stage="rm", finetuning_type="full", **PAIR, per_device_train_batch_size=4,
                                           gradient_accumulation_steps=2, learning_rate=1e-6, **EPOCH), True),
    ("r7_orpo_1.5b_lora_mb4_ckpt", S15, dict(stage="dpo", pref_loss="orpo", **LORA, **PAIR, per_device_train_batch_size=4,
                                              gradient_checkpointing=True, **EPOCH), True),
    ("r7_kto_0.5b_full_mb2_ga2", S05, dict(stage="kto", dataset="synth_kto", finetuning_type="full", packing=False,
                                            cutoff_len=1024, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                            learning_rate=1e-6, **EPOCH), True),
    ("r7_dpo_1.5b_lora_mb4_ckpt", S15, dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=4,
                                             gradient_checkpointing=True, **EPOCH), True),
    ("r7_sft_0.5b_full_mb8_ckpt_ga2", S05, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=8,
                                                 gradient_accumulation_steps=2, gradient_checkpointing=True), True),
]  # fmt: skip
# Round 8: runs new to the planner after round 7's fix (estimate.recompute_phase_bytes: with full
# checkpointing the loss head and the reference forward count only above the recompute) -- that rule on
# DPO/KTO/ORPO at other sizes and on full fine-tunes, the accumulation margin again, freeze-tuning (never
# measured: the review's fixes to its checkpointed layers, its margin and freeze_trainable_layers < 0) -- and
# the four runs round 7's budget left, renamed (they were never run)
STAGES_R8 = [
    ("r8_dpo_0.5b_lora_mb8_ckpt", S05, dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=8,
                                             gradient_checkpointing=True, **EPOCH), True),
    ("r8_simpo_0.5b_full_mb4", S05, dict(stage="dpo", pref_loss="simpo", finetuning_type="full", **PAIR,
                                          per_device_train_batch_size=4, learning_rate=1e-6, **EPOCH), True),
    ("r8_orpo_0.5b_full_mb4_ckpt", S05, dict(stage="dpo", pref_loss="orpo", finetuning_type="full", **PAIR,
                                              per_device_train_batch_size=4, gradient_checkpointing=True,
                                              learning_rate=1e-6, **EPOCH), True),
    ("r8_kto_1.5b_lora_mb8_ckpt", S15, dict(stage="kto", dataset="synth_kto", **LORA, packing=False, cutoff_len=1024,
                                             per_device_train_batch_size=8, gradient_checkpointing=True, **EPOCH), True),
    ("r8_freeze_0.5b_mb8_ckpt", S05, dict(stage="sft", finetuning_type="freeze", freeze_trainable_layers=2,
                                           per_device_train_batch_size=8, gradient_checkpointing=True), True),
    ("r8_freeze_1.5b_mb4_ga2", S15, dict(stage="sft", finetuning_type="freeze", freeze_trainable_layers=-2,
                                          per_device_train_batch_size=4, gradient_accumulation_steps=2), True),
    ("r8_sft_0.5b_lora_mb16_ckpt_ga2", S05, dict(stage="sft", **LORA, per_device_train_batch_size=16,
                                                  gradient_accumulation_steps=2, gradient_checkpointing=True), True),
    ("r8_dpo_1.5b_full_mb2_ckpt", S15, dict(stage="dpo", pref_loss="sigmoid", finetuning_type="full", **PAIR,
                                             per_device_train_batch_size=2, gradient_checkpointing=True,
                                             learning_rate=1e-6, **EPOCH), True),
    ("r8_sft_1.5b_full_mb4_ga2", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=4,
                                            gradient_accumulation_steps=2), True),
    ("r8_kto_1.5b_full_mb2", S15, dict(stage="kto", dataset="synth_kto", finetuning_type="full", packing=False,
                                        cutoff_len=1024, per_device_train_batch_size=2, learning_rate=1e-6, **EPOCH), True),
    ("r8_rm_1.5b_full_mb2_ga2", S15, dict(stage="rm", finetuning_type="full", **PAIR, per_device_train_batch_size=2,
                                           gradient_accumulation_steps=2, learning_rate=1e-6, **EPOCH), True),
    ("r8_grpo_0.5b_lora_mb8_ckpt", S05, dict(**{**GRPO, "max_new_tokens": 64}, **LORA, per_device_train_batch_size=8,
                                              gradient_checkpointing=True, _steps=3, **EPOCH), True),
    ("r8_dpo_7b_lora_mb2_ckpt", S7, dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=2,
                                          gradient_checkpointing=True, **EPOCH), True),
    ("r8_sft_unpacked_7b_lora_mb4", S7, dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=4,
                                              **EPOCH), True),
]  # fmt: skip
# Round 9: runs new to the planner after round 8's fixes (the frozen copy in the policy's load dtype; TRL's
# log-prob head peaking before the decoder gradients; the step net of the stage's working sets; frozen
# recording layers at the traced discount; the chunked CE's traced bytes over checkpointed inputs, the
# embedding output and packed mask beside them; classic AMP's fp32 inputs) -- each on a shape it was not
# traced on, with the other precision scheme or size
STAGES_R9 = [
    ("r9_freeze_1.5b_mb4_first4", S15, dict(stage="sft", finetuning_type="freeze", freeze_trainable_layers=-4,
                                             per_device_train_batch_size=4), True),
    ("r9_freeze_0.5b_mb4_ga2_first2", S05, dict(stage="sft", finetuning_type="freeze", freeze_trainable_layers=-2,
                                                 per_device_train_batch_size=4, gradient_accumulation_steps=2), True),
    ("r9_freeze_1.5b_mb8_ckpt", S15, dict(stage="sft", finetuning_type="freeze", freeze_trainable_layers=2,
                                           per_device_train_batch_size=8, gradient_checkpointing=True), True),
    ("r9_dpo_0.5b_full_mb4_ckpt", S05, dict(stage="dpo", pref_loss="sigmoid", finetuning_type="full", **PAIR,
                                             per_device_train_batch_size=4, gradient_checkpointing=True,
                                             learning_rate=1e-6, **EPOCH), True),
    ("r9_kto_0.5b_full_mb4_ckpt", S05, dict(stage="kto", dataset="synth_kto", finetuning_type="full", packing=False,
                                             cutoff_len=1024, per_device_train_batch_size=4, gradient_checkpointing=True,
                                             learning_rate=1e-6, **EPOCH), True),
    ("r9_dpo_1.5b_full_mb2_pure", S15, dict(stage="dpo", pref_loss="sigmoid", finetuning_type="full", **PAIR,
                                             pure_bf16=True, per_device_train_batch_size=2, learning_rate=1e-6,
                                             **EPOCH), True),
    ("r9_sft_1.5b_full_mb8_ckpt", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=8,
                                             gradient_checkpointing=True), True),
    ("r9_sft_1.5b_full_mb4_ckpt_ga2", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=4,
                                                 gradient_accumulation_steps=2, gradient_checkpointing=True), True),
    ("r9_sft_0.5b_lora_mb32_ckpt", S05, dict(stage="sft", **LORA, per_device_train_batch_size=32,
                                              gradient_checkpointing=True), True),
    ("r9_orpo_1.5b_full_mb2_ckpt", S15, dict(stage="dpo", pref_loss="orpo", finetuning_type="full", **PAIR,
                                              per_device_train_batch_size=2, gradient_checkpointing=True,
                                              learning_rate=1e-6, **EPOCH), True),
    ("r9_rm_0.5b_full_mb4_ckpt", S05, dict(stage="rm", finetuning_type="full", **PAIR, per_device_train_batch_size=4,
                                            gradient_checkpointing=True, learning_rate=1e-6, **EPOCH), True),
    ("r9_simpo_1.5b_lora_mb4_ckpt", S15, dict(stage="dpo", pref_loss="simpo", **LORA, **PAIR,
                                               per_device_train_batch_size=4, gradient_checkpointing=True, **EPOCH), True),
    ("r9_sft_unpacked_1.5b_full_mb4_ckpt", S15, dict(stage="sft", finetuning_type="full", **UNPACKED,
                                                      per_device_train_batch_size=4, gradient_checkpointing=True,
                                                      **EPOCH), True),
]  # fmt: skip
# Round 10: the full DPO 1.5B of round 8 again, now that the frozen copy loads in the compute dtype (28233d9)
STAGES_R10 = [
    ("r10_dpo_1.5b_full_mb2_ckpt", S15, dict(stage="dpo", pref_loss="sigmoid", finetuning_type="full", **PAIR,
                                              per_device_train_batch_size=2, gradient_checkpointing=True,
                                              learning_rate=1e-6, **EPOCH), True),
]  # fmt: skip
# Round 11: shapes no constant was fitted on, predicted before they run -- unpacked sft and pairwise runs
# shorter than an epoch (the rows the sampler really draws, replayed by plan/lengths.py, not the data's
# longest), the 3B shape, KTO on the 7B at cutoff 1024, freeze-tuning of the first layers, LoRA r16/r64 and
# a long 1x8192 row, FP8 LoRA
S3 = "qwen2.5-3b"
R16, R64 = dict(LORA, lora_rank=16, lora_alpha=32), dict(LORA, lora_rank=64, lora_alpha=128)
STAGES_R11 = [
    ("r11_sft_unpacked_3b_lora_mb2_6st", S3, dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=2,
                                                   _steps=6), True),
    ("r11_sft_unpacked_0.5b_full_mb2", S05, dict(stage="sft", finetuning_type="full", **UNPACKED,
                                                  per_device_train_batch_size=2, _steps=6), True),
    ("r11_dpo_3b_lora_mb2", S3, dict(stage="dpo", pref_loss="sigmoid", **LORA, **PAIR, per_device_train_batch_size=2,
                                      _steps=6), True),
    ("r11_kto_1.5b_lora_mb8", S15, dict(stage="kto", dataset="synth_kto", **LORA, packing=False, cutoff_len=1024,
                                         per_device_train_batch_size=8), True),
    ("r11_freeze_3b_mb8_first4", S3, dict(stage="sft", finetuning_type="freeze", freeze_trainable_layers=-4,
                                           per_device_train_batch_size=8), True),
    ("r11_sft_3b_lora_r16_mb16", S3, dict(stage="sft", **R16, per_device_train_batch_size=16), True),
    ("r11_sft_unpacked_3b_lora_mb8", S3, dict(stage="sft", **LORA, **UNPACKED, per_device_train_batch_size=8), True),
    ("r11_sft_unpacked_1.5b_lora_mb16_ckpt", S15, dict(stage="sft", **R16, **UNPACKED, per_device_train_batch_size=16,
                                                        gradient_checkpointing=True), True),
    ("r11_kto_7b_lora_mb2", S7, dict(stage="kto", dataset="synth_kto", **LORA, packing=False, cutoff_len=1024,
                                      per_device_train_batch_size=2), True),
    ("r11_sft_7b_lora_r64_s8192_ckpt", S7, dict(stage="sft", **R64, cutoff_len=8192, per_device_train_batch_size=1,
                                                 gradient_checkpointing=True), True),
    ("r11_dpo_0.5b_full_mb8", S05, dict(stage="dpo", pref_loss="sigmoid", finetuning_type="full", **PAIR,
                                         per_device_train_batch_size=8, learning_rate=1e-6), True),
    ("r11_fp8_3b_lora_mb8", S3, dict(stage="sft", **LORA, per_device_train_batch_size=8, fp8=True), False),
    ("r11_sft_1.5b_full_mb4_ga2", S15, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=4,
                                                   gradient_accumulation_steps=2), True),
]  # fmt: skip
# Diagnostics (not predictions): the planner's largest errors run again with a memory trace, so the peak's
# live blocks can be named by the code that allocated them (`peak_breakdown` in the row, basis "diagnostic")
SNAP = {"_snapshot": True}
_by_name = {r[0]: r for r in STAGES + STAGES_R4 + STAGES_R6 + STAGES_R8}
STAGES_SNAP = [
    ("snap_r4_orpo_0.5b_full_mb2", S05, {**_by_name["r4_orpo_0.5b_full_mb2"][2], **SNAP}, True),  # +12.3%
    ("snap_orpo_0.5b_lora_mb4", S05, {**_by_name["orpo_0.5b_lora_mb4"][2], **SNAP}, True),  # -1.7%, same loss
    ("snap_0.5b_full_mb4_s2048_ckpt", S05, dict(finetuning_type="full", per_device_train_batch_size=4,
                                                 gradient_checkpointing=True, **SNAP), True),  # +16.8% (fit set)
    ("snap_r4_rm_0.5b_full_mb4", S05, {**_by_name["r4_rm_0.5b_full_mb4"][2], **SNAP}, True),  # +5.1%
]  # fmt: skip
# Round 6's under-predictions traced (diagnostics): gradient accumulation under classic AMP (the only
# accumulating runs recorded; -6.3% and -4.8%) next to the same SFT step without accumulation, same scheme
STAGES_SNAP6 = [
    ("snap_r6_sft_0.5b_full_mb4_ga4", S05, {**_by_name["r6_sft_0.5b_full_mb4_ga4"][2], **SNAP}, True),
    ("snap_sft_0.5b_full_mb4_amp", S05, dict(stage="sft", finetuning_type="full", per_device_train_batch_size=4,
                                             master_weights="model", **SNAP), True),
    ("snap_r6_orpo_0.5b_full_mb2_ga2", S05, {**_by_name["r6_orpo_0.5b_full_mb2_ga2"][2], **SNAP}, True),
]  # fmt: skip
# Round 8's misses traced (diagnostics): freeze-tuning's head-bound peak (+17.6%), the same chunked CE under
# LoRA where the recompute and the head are close, and the full DPO whose peak is the optimizer step (-6.7%)
STAGES_SNAP8 = [
    ("snap_r8_freeze_0.5b_mb8_ckpt", S05, {**_by_name["r8_freeze_0.5b_mb8_ckpt"][2], **SNAP}, True),
    ("snap_r8_sft_0.5b_lora_mb16_ckpt_ga2", S05, {**_by_name["r8_sft_0.5b_lora_mb16_ckpt_ga2"][2], **SNAP}, True),
    ("snap_r8_dpo_1.5b_full_mb2_ckpt", S15, {**_by_name["r8_dpo_1.5b_full_mb2_ckpt"][2], **SNAP}, True),
]  # fmt: skip
MIN_LEFT_S = 75  # a run is skipped when less of --budget is left
REWARD_PY = """def length_reward(prompts, completions, **_):
    return [min(len(c), 400) / 400.0 for c in completions]
"""


def prepare_data(data_dir: Path) -> None:
    """synth_pref (each instruction with its own answer as chosen, another's as rejected), synth_kto
    (alternately desirable / undesirable), both registered next to synth in dataset_info.json."""
    records = json.loads((data_dir / "synth.json").read_text())
    others = list(range(len(records)))
    random.Random(0).shuffle(others)
    pref, kto = [], []
    for i, rec in enumerate(records):
        j = others[i] if others[i] != i else (i + 1) % len(records)
        pref.append({"instruction": rec["instruction"], "input": rec.get("input", ""), "chosen": rec["output"],
                     "rejected": records[j]["output"]})  # fmt: skip
        answer = rec["output"] if i % 2 == 0 else records[j]["output"]
        kto.append({"messages": [{"role": "user", "content": rec["instruction"]},
                                 {"role": "assistant", "content": answer}], "label": i % 2 == 0})  # fmt: skip
    (data_dir / "synth_pref.json").write_text(json.dumps(pref))
    (data_dir / "synth_kto.json").write_text(json.dumps(kto))
    info = json.loads((data_dir / "dataset_info.json").read_text())
    info["synth_pref"] = {"file_name": "synth_pref.json", "formatting": "alpaca", "ranking": True,
                          "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                      "rejected": "rejected"}}  # fmt: skip
    info["synth_kto"] = {"file_name": "synth_kto.json", "formatting": "sharegpt",
                         "columns": {"messages": "messages", "kto_tag": "label"},
                         "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                  "assistant_tag": "assistant"}}  # fmt: skip
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=1))


def epoch_rows(overrides: dict, steps: int) -> int:
    """The rows `steps` steps draw: micro-batch x accumulation per step; prompt stages (grpo/rloo) answer
    each prompt num_generations times, and the micro-batch counts answers."""
    rows = (
        steps
        * int(overrides.get("per_device_train_batch_size", 4))
        * int(overrides.get("gradient_accumulation_steps", 1))
    )
    if overrides.get("stage") in ("grpo", "rloo"):
        rows //= int(overrides.get("num_generations", 1))
    return rows


def stage_config(assets: Path, work: Path, name: str, arch: str, overrides: dict, steps: int) -> dict:
    overrides = dict(overrides)
    steps = overrides.pop("_steps", steps)
    if overrides.pop("_epoch", False):
        overrides["max_samples"] = epoch_rows(overrides, steps)
    cfg = base_config(str(assets), arch, name, {"max_samples": 2000, **overrides, "max_steps": steps})
    cfg["output_dir"] = str(work / "out" / name)
    if cfg.get("reward_funcs") == "REWARD":
        cfg["reward_funcs"] = f"{work / 'reward.py'}:length_reward"
    return cfg


def planner_version() -> str:
    """lmstack's version + a hash of the planner's code (the work tree on the GPU machine has no .git)."""
    import hashlib

    import lmstack

    h = hashlib.sha256()
    for folder in ("plan", "memory"):
        for path in sorted((Path(REPO) / "src" / "lmstack" / folder).glob("*.py")):
            h.update(f"{folder}/{path.name}".encode() + b"\0" + path.read_bytes())
    return f"{lmstack.__version__}+plan.{h.hexdigest()[:12]}"


def predict_stage(cfg_dict: dict, gpu_gib: float) -> tuple[dict, dict]:
    """The planner's breakdown of the configured setup, reading the data's row lengths (unpacked runs),
    and the lengths it used."""
    from lmstack.config.load import build_config
    from lmstack.memory import plan
    from lmstack.plan.whatif import request_from_config

    req = request_from_config(build_config(cfg_dict), 1, gpu_gib, data=True)
    parts = plan(req).configured.estimate.gpu.to_dict()
    parts["allocated_equiv"] = parts["allocated"]
    parts["seq_len"] = req.seq_len
    lengths = {"seq_len": req.seq_len, "prompt_len": req.prompt_len, "source": req.length_source,
               "worst_seq_len": req.worst_seq_len}  # fmt: skip
    return parts, lengths


def child(spec: dict) -> None:
    import torch

    if spec["config"].get("deepspeed"):  # DeepSpeed wants a process group even on one GPU
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"])
        )
    from lmstack.train.run import train

    widths = record_batch_widths()
    snapshot = spec.get("snapshot") and torch.cuda.is_available()
    if snapshot:  # every allocation with its Python stack, from before the model loads
        torch.cuda.memory._record_memory_history(max_entries=TRACE_ENTRIES, stacks="python")
    t0 = time.time()
    train(None, spec["config"])
    out = {"wall_s": round(time.time() - t0, 1), "status": "ok", "drawn": widths}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        out.update(measured_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3))  # fmt: skip
    if snapshot:
        out["peak_breakdown"] = peak_breakdown(
            torch.cuda.memory._snapshot(), torch.cuda.max_memory_allocated()
        )
        torch.cuda.memory._record_memory_history(enabled=None)
    print("RESULT " + json.dumps(out), flush=True)


TRACE_ENTRIES = 2_000_000  # the trace's ring buffer: when full, the oldest events (the weights) fall out
# frames skipped when naming who allocated a block: the framework's own plumbing (torch's modules and
# functionals, autograd, autocast), so a block is named by the model / trainer / lmstack line that asked
PLUMBING = ("/torch/nn/modules/", "/torch/nn/functional.py", "/torch/utils/_contextlib.py", "/torch/_tensor.py",
            "/torch/autograd/", "/torch/amp/", "/accelerate/", "/torch/_dynamo/", "/torch/utils/checkpoint.py",
            "/torch/functional.py", "/torch/_ops.py")  # fmt: skip


def _owner(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if name and not any(p in name for p in PLUMBING) and not name.startswith("<"):
            short = name.split("site-packages/")[-1].split("/src/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no Python frame: the autograd engine -- gradients and backward temporaries)"


def peak_breakdown(snap: dict, measured_bytes: int | None = None, top: int = 15) -> dict:
    """The live blocks at the moment allocated memory peaked, from a torch.cuda.memory._snapshot() trace
    (device 0): GiB per allocating code line (the first frame outside torch's plumbing), largest first.
    `untraced_gib`: the measured peak (max_memory_allocated) minus the traced one -- blocks allocated before
    the trace's oldest kept event (`wrapped`: the ring buffer overflowed and dropped the first events)."""
    trace = snap["device_traces"][0] if snap.get("device_traces") else []

    def replay(until: int) -> tuple[dict[int, dict], int]:
        """The live alloc events after trace[:until], and the index just past the allocation peak."""
        live: dict[int, dict] = {}
        total = peak = peak_at = 0
        for i, ev in enumerate(trace[:until]):
            if ev.get("action") == "alloc":
                live[ev.get("addr")] = ev
                total += int(ev.get("size", 0))
                if total > peak:
                    peak, peak_at = total, i + 1
            elif ev.get("action") == "free_requested" and ev.get("addr") in live:
                total -= int(live.pop(ev.get("addr")).get("size", 0))
        return live, peak_at

    at_peak, _ = replay(replay(len(trace))[1])  # two linear passes: find the peak, then who is live there
    at_peak = {addr: (int(ev.get("size", 0)), _owner(ev.get("frames") or [])) for addr, ev in at_peak.items()}
    traced = sum(size for size, _ in at_peak.values())
    allocated_now = sum(
        b["size"] for seg in snap.get("segments", []) for b in seg.get("blocks", []) if b.get("state") == "active_allocated"
    )  # fmt: skip
    by: dict[str, int] = {}
    for size, owner in at_peak.values():
        by[owner] = by.get(owner, 0) + size
    rows = sorted(by.items(), key=lambda kv: -kv[1])
    gib = 2**30
    out = {"traced_peak_gib": round(traced / gib, 3), "allocated_at_end_gib": round(allocated_now / gib, 3),
           "events": len(trace), "wrapped": len(trace) >= TRACE_ENTRIES,
           "by_owner": [[k, round(v / gib, 3)] for k, v in rows[:top]],
           "others_gib": round(sum(v for _, v in rows[top:]) / gib, 3)}  # fmt: skip
    if measured_bytes is not None:
        out["untraced_gib"] = round((measured_bytes - traced) / gib, 3)
    return out


def record_batch_widths() -> dict:
    """The token batches the run really formed: every embedding lookup's [rows, width] is recorded, the
    widest training one (grad on) and the widest no-grad one (reference / KL / generation prefill). The
    planner is then re-run at these widths (`at_drawn`): its memory model's own error, apart from the
    sampling bound it predicts a short run with."""
    import torch

    seen = {"train_rows": 0, "train_width": 0, "train_tokens": 0, "nograd_width": 0}
    forward = torch.nn.Embedding.forward

    def recording(self, ids):
        if ids.dim() == 2:
            rows, width = ids.shape
            if torch.is_grad_enabled():
                if rows * width > seen["train_tokens"]:
                    seen.update(train_rows=int(rows), train_width=int(width), train_tokens=int(rows * width))
            else:
                seen["nograd_width"] = max(seen["nograd_width"], int(width))
        return forward(self, ids)

    torch.nn.Embedding.forward = recording
    return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(cfg: dict, timeout: float, log: Path, env: dict | None = None, snapshot: bool = False) -> dict:
    spec = json.dumps({"config": cfg, "port": free_port(), "snapshot": snapshot})
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchproc import result_from_log, run_killable

    rc = run_killable(
        [sys.executable, __file__, "--child", spec], {**os.environ, **(env or {})}, timeout, log
    )
    got = result_from_log(log)
    if got is None:
        tail = log.read_text(errors="replace")[-1500:]
        return {"status": "timeout" if rc == 124 else "error", "error": tail}
    return got


def round_of(name: str) -> str:
    """'r4', 'r5', ... from a round's run name ('snap' for the traced re-runs); 'earlier' before rounds."""
    head = name.split("_")[0]
    return head if head == "snap" or (head[:1] == "r" and head[1:].isdigit()) else "earlier"


def local_row(
    name: str, arch: str, cfg: dict, predicted: dict, lengths: dict, measured: dict, gpu: str
) -> dict:
    """One entry in plan_accuracy.json's schema (plan_check.py's rows + basis, planner version, lengths)."""
    keep = {k: v for k, v in cfg.items() if k not in ("dataset_dir", "output_dir")}
    keep["model_name_or_path"] = arch
    if "reward_funcs" in keep:
        keep["reward_funcs"] = "reward.py:length_reward"
    basis = (
        "diagnostic" if name.startswith("snap_") else "predicted"
    )  # a re-run with a trace, not a prediction
    row = {"source": "plan_accuracy.py", "name": name, "num_gpus": 1, "basis": basis,
           "planner_version": planner_version(), "predicted": predicted, "predicted_gib": predicted["allocated"],
           "predicted_reserved_gib": predicted["reserved"], "lengths": lengths,
           "data_aware": lengths["source"] != "cutoff_len", "config": keep,
           "run_date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu": gpu,
           "chunked_ce_model": "current", "round": round_of(name), **measured}  # fmt: skip
    if row.get("measured_gib"):
        row["error_pct"] = round(100 * (row["predicted_gib"] - row["measured_gib"]) / row["measured_gib"], 1)
    if row.get("reserved_gib"):
        row["reserved_error_pct"] = round(
            100 * (row["predicted_reserved_gib"] - row["reserved_gib"]) / row["reserved_gib"], 1
        )
    return row


def at_drawn(cfg: dict, drawn: dict, gpu_gib: float, measured: float) -> dict:
    """The planner's allocated figure at the widths the run drew (its prediction used the data's bound)."""
    width = drawn["train_width"]
    prompt = (
        max(width - int(cfg.get("max_new_tokens", 0)), 0)
        if cfg.get("stage") in ("grpo", "rloo", "ppo")
        else None
    )
    try:
        got = predict(cfg, gpu_gib, seq_len=width, prompt_len=prompt)["allocated"]
    except Exception as err:  # noqa: BLE001 - reported in the row, the measurement stands
        return {"error": f"{type(err).__name__}: {err}"}
    return {"seq_len": width, "prompt_len": prompt, "allocated_gib": got,
            "error_pct": round(100 * (got - measured) / measured, 1)}  # fmt: skip


def merge(out: Path, rows: list[dict]) -> dict:
    """Replace same-named plan_accuracy.py rows, keep every other entry, refresh the summaries."""
    doc = json.loads(out.read_text()) if out.exists() else {"meta": {}, "summary": {}, "runs": []}
    names = {r["name"] for r in rows}
    doc["runs"] = [
        r for r in doc["runs"] if not (r.get("source") == "plan_accuracy.py" and r["name"] in names)
    ]
    doc["runs"] += rows
    doc["summary_by_basis"] = {
        b: summarize([r for r in doc["runs"] if r.get("basis") == b]) for b in ("fit", "predicted")
    }
    # each round of predicted runs on its own: a round's runs were all new to the planner that predicted them
    rounds = sorted({r.get("round", "earlier") for r in doc["runs"] if r.get("basis") == "predicted"})
    doc["summary_by_round"] = {
        k: summarize(
            [r for r in doc["runs"] if r.get("basis") == "predicted" and r.get("round", "earlier") == k]
        )
        for k in rounds
    }
    out.write_text(json.dumps(doc, indent=1))
    return doc["summary_by_basis"]


def dry_assets(root: Path) -> tuple[Path, dict[str, str]]:
    """The tiny model in place of every arch, and a small synth set (CPU dry run)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_assets import synthetic_records, write_dataset

    from lmstack.tiny import build_tiny_model

    tiny = build_tiny_model(root / "tiny", data_dir=Path(REPO) / "data")
    records = synthetic_records(64)
    for rec in records:  # a tiny model: short rows
        rec["instruction"], rec["output"] = rec["instruction"][:80], rec["output"][:160]
    write_dataset(str(root), records)
    return root, {arch: str(tiny) for arch in (S05, S15, S3, S7)}


def main_stages(args) -> None:
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "reward.py").write_text(REWARD_PY)
    if args.dry_run:
        assets, models = dry_assets(work / "assets")
        gpu, gpu_gib, steps = "cpu (dry run)", 24.0, 1
    else:
        import torch

        assets, models = Path(args.assets), {}
        gpu = torch.cuda.get_device_name(0)
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        steps = args.steps
    prepare_data(assets / "data")
    out = Path(args.out)
    done = set()
    if args.skip_done and out.exists():
        done = {
            r["name"]
            for r in json.loads(out.read_text())["runs"]
            if r.get("basis") in ("predicted", "diagnostic") and r.get("measured_gib")
        }
    sets = {
        "stages": STAGES,
        "r4": STAGES_R4,
        "r5": STAGES_R5,
        "r6": STAGES_R6,
        "r7": STAGES_R7,
        "r8": STAGES_R8,
        "r9": STAGES_R9,
        "r10": STAGES_R10,
        "r11": STAGES_R11,
        "all": STAGES + STAGES_R4,
        "snap": STAGES_SNAP,
        "snap6": STAGES_SNAP6,
        "snap8": STAGES_SNAP8,
    }
    chosen = sets[args.set]
    runs = [r for r in chosen if (not args.only or r[0] in args.only.split(",")) and r[0] not in done]
    for name, arch, overrides, cpu_ok in runs:
        left = args.budget - (time.time() - t0)
        if left < MIN_LEFT_S:
            print(f"{name:30s} skipped: {left:.0f}s of the budget left", flush=True)
            continue
        if not args.dry_run and not (assets / arch / "config.json").exists():
            subprocess.run([sys.executable, str(Path(__file__).with_name("make_assets.py")), str(assets), arch],
                           check=True)  # fmt: skip
            prepare_data(assets / "data")  # make_assets rewrote dataset_info.json
        overrides = dict(overrides)
        env = overrides.pop("_env", {})
        snapshot = overrides.pop("_snapshot", False)
        cfg = stage_config(assets, work, name, arch, overrides, steps)
        if args.dry_run:
            cfg.update(model_name_or_path=models[arch], bf16=False, cutoff_len=min(cfg["cutoff_len"], 256),
                       max_new_tokens=min(cfg.get("max_new_tokens", 16), 16), preprocessing_num_workers=1)  # fmt: skip
        predicted, lengths = predict_stage(cfg, gpu_gib)  # before the run: a prediction, not a fit
        measured: dict = {"status": "predicted only (dry run, needs a GPU)"}
        if cpu_ok or not args.dry_run:
            measured = run_child(cfg, min(args.timeout, left - 10), work / f"{name}.log", env, snapshot)
        row = local_row(name, arch, cfg, predicted, lengths, measured, gpu)
        drawn = measured.get("drawn") or {}
        if drawn.get("train_width") and row.get("measured_gib"):
            row["at_drawn"] = at_drawn(cfg, drawn, gpu_gib, row["measured_gib"])
        if env:
            row["env"] = env
        summary = merge(out, [row])
        print(f"{name:30s} pred {row['predicted_gib']:8.3f} meas {row.get('measured_gib', '-')!s:>8} "
              f"err% {row.get('error_pct', '-')!s:>6} res {row.get('reserved_gib', '-')!s:>8} "
              f"{row.get('status')} {row.get('error', '')[-300:]}", flush=True)  # fmt: skip
    print("SUMMARY " + json.dumps(summary if runs else {}))
    if runs and out.exists():
        print("BY ROUND " + json.dumps(json.loads(out.read_text()).get("summary_by_round", {})))


def summarize(results: list[dict]) -> dict:
    errs = sorted(abs(r["error_pct"]) for r in results if "error_pct" in r)
    if not errs:
        return {"n": 0}
    mid = len(errs) // 2
    median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
    under = min(r["error_pct"] for r in results if "error_pct" in r)
    return {"n": len(errs), "median_abs_error_pct": round(median, 1), "worst_abs_error_pct": errs[-1],
            "worst_under_pct": under}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("assets", nargs="?", default=None)
    ap.add_argument(
        "--set",
        default="stages",
        choices=["stages", "r4", "r5", "r6", "r7", "r8", "r9", "r10", "r11", "all", "snap", "snap6", "snap8"],
    )
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=str(Path(REPO) / "bench" / "results" / "plan_accuracy.json"))
    ap.add_argument("--work", default="/tmp/plan_acc")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds for the whole set")
    ap.add_argument("--skip-done", action="store_true", help="skip runs already measured in --out")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the tiny model, predictions + one step")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if not args.dry_run and not args.assets:
        ap.error("ASSETS is required (or --dry-run)")
    main_stages(args)


if __name__ == "__main__":
    main()
