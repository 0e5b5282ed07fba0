"""Which Linear layers FP8 converts: the rules models/fp8.py applies to the model and the memory model
applies to its counted shapes (duck-typed: anything with in_features / out_features)."""

from __future__ import annotations

from typing import Any

HEAD_NAMES = ("lm_head", "output_layer", "embed_out")
VISION_PARTS = (
    "visual",
    "vision_tower",
    "vision_model",
    "vision_encoder",
    "multi_modal_projector",
    "mm_projector",
)
SCOPES = ("frozen-base", "float8-training")


def too_small(out_features: int, in_features: int) -> bool:
    """FP8 does not pay on this GEMM: the per-token quantization costs more than the faster GEMM saves.
    torchao's rowwise thresholds, which the H200 confirms (16384 tokens, ms bf16 -> FP8 forward / input
    grad): 18944x3584 2.75 -> 1.75 / 2.78 -> 2.15; 3584x3584 0.60 -> 0.57 / 0.59 -> 0.66 (kept: even);
    512x3584 0.09 -> 0.26 / 0.10 -> 0.23; Qwen2.5-0.5B's 4864x896 (65536 tokens) 0.76 -> 0.77 / 0.77 -> 1.40."""
    n, k = out_features, in_features
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def exclusion(model: Any, name: str, module: Any, head: Any, pays_only: bool = True) -> str | None:
    """Why this Linear stays out of FP8 (None: it can be FP8). `pays_only=False` (tests on tiny models)
    converts layers too small for FP8 to pay as well."""
    parts = name.split(".")
    if module is head or parts[-1] in HEAD_NAMES:
        return "the output head"
    if any(p in VISION_PARTS for p in parts):
        return "the vision tower / projector"
    if module.in_features % 16 or module.out_features % 16:
        return "in/out features not multiples of 16"
    if pays_only and too_small(module.out_features, module.in_features):
        return "too small for FP8 to pay"
    return None
