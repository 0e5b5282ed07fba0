"""The planner's model of FP8 training (`fp8: true`; the run plan's plan.fp8 picks the scope, models/fp8.py
applies it): which Linear layers convert, their weight bytes, the transient FP8 copies, the step's speed.

* frozen-base (LoRA): each converted layer holds float8_e4m3fn weights (1 B/param) and one fp32 scale per
  output row; the bf16 copy is dropped. Everything else (embeddings, the head, norms, biases, the layers
  `models.fp8.exclusion` keeps) stays bf16. Activations are those of bf16 LoRA: Fp8FrozenLinearFunction
  saves only the weight and its scales (parameters, no new tensor) and the adapters keep their own input.
  Transients (one GEMM at a time): the forward quantizes the GEMM's input per token ([tokens, in] FP8 +
  one fp32 scale per token); the input-grad backward quantizes dy per token ([tokens, out]) and
  requantizes W^T per input column ([in, out] FP8 + one scale per column).
* float8-training (full): torchao's Float8Linear keeps the bf16 weight (weights, gradients and the
  optimizer are unchanged) and its autograd function saves its bf16 input and the weight, as nn.Linear
  does (torchao/float8/float8_linear.py, matmul_with_hp_or_float8_args: save_for_backward(input_hp,
  weight_hp_t)): activations are unchanged too. Transients: forward FP8 input + FP8 weight; backward FP8
  weight (for the input grad), dy twice (per row for the input grad, per column for the weight grad) and
  the input per column (weight grad), all alive at the weight-grad GEMM.

Speed: frozen-base (its quantization compiled, models/fp8.py) runs the converted GEMMs faster than bf16;
float8-training, uncompiled as lmstack runs it, was measured slower than bf16 (FP8_FULL_* below), and the
planner ranks it so: it never offers FP8 full fine-tuning as a speed-up. The planner has no torch_compile
input; it models the eager run (torch_compile: false, the default).

Which layers convert is `models.fp8.exclusion` itself, asked per decoder projection with the shape the
model config gives it (so the planner cannot drift from what `apply_fp8` converts). Linear groups the
planner cannot place in the decoder layout (other architectures' names, a vision tower sharing a name)
are counted bf16: the estimate errs high, never low.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from lmstack.memory import memory as mem

if TYPE_CHECKING:
    from lmstack.memory.estimate import Setup
    from lmstack.memory.model_spec import ModelSpec
    from lmstack.memory.recommend import PlanRequest

# --- speed (recommend.relative_cost): the step's time with FP8, relative to bf16 ---------------------------
# The GEMM alone, FP8 row-wise (torch._scaled_mm) over bf16: bench/results/fp8_probe.jsonl (H200, torch
# 2.11, 16384 tokens, 2026-12-01), fp8_ms_gemm_only / bf16_ms on Qwen2.5-7B's projections FP8 converts,
# time-weighted over one layer's forward (q, o: 0.34 / 0.66 ms; gate, up: 1.76 / 2.87; down: 1.59 / 3.16):
# 5.79 / 10.22 = 0.57.
FP8_GEMM_TIME = 0.57
# Quantizing the operands (compiled, as models/fp8.py runs them on the GPU), per converted GEMM relative to
# its bf16 time: models/fp8.py `too_small`'s H200 figures (bf16 -> FP8 incl. quantization, forward / input
# grad, ms: 18944x3584 2.75 -> 1.75 / 2.78 -> 2.15; 3584x3584 0.60 -> 0.57 / 0.59 -> 0.66) give one 7B
# layer (gate, up, down + q, o) 14.16 / 18.97 = 0.75 of bf16, i.e. 0.18 above the GEMM alone.
FP8_QUANT_TIME = 0.18
# The share of a step's time spent in GEMMs: 7b_lora_bs8 on the H200 (bench/results/SUMMARY.md): GEMM
# 82.5% of kernel time, GPU busy 91% -> 0.75. The converted layers' part of it comes from the model's shapes.
# Both constants are first figures: the lead refines them with the measured 7B FP8 speed rows.
FP8_STEP_GEMM_SHARE = 0.75
# float8-training (full fine-tuning, torchao's convert_to_float8_training, rowwise recipe) without
# torch.compile: torchao's casts, amax and scales run as separate eager kernels (torchao's docs: float8
# training needs torch.compile for speed; lmstack compiles nothing unless torch_compile: true). Measured:
# `bench/fp8_parity.py --set small --only 1.5b_full`, H200, 2026-12-01, torch 2.11, torchao 0.17,
# transformers 5.17; Qwen2.5-1.5B shape, full SFT, packed 8 x 2048, Liger, 200 steps, adamw_torch_fused;
# FP8 on gate_proj/up_proj (56 Linear layers, the rest too small): bf16 47,826 tok/s (peak 54.51 GiB
# allocated), fp8 26,798 tok/s (0.56x, peak 55.40 GiB); final loss within 1e-5.
FP8_FULL_BF16_TOKENS_PER_S = 47_826
FP8_FULL_FP8_TOKENS_PER_S = 26_798
FP8_FULL_SPEED = FP8_FULL_FP8_TOKENS_PER_S / FP8_FULL_BF16_TOKENS_PER_S  # 0.56
# That run's converted share of the GEMM work (as scope_time_factor counts it): gate/up 770,703,360 of
# 1,543,569,408 params (decoder Linear layers + the tied head's GEMM).
FP8_FULL_MEASURED_SHARE = 770_703_360 / 1_543_569_408
# A converted layer's GEMM time under eager float8-training relative to bf16, fitted so that the measured
# model's step takes 1 / FP8_FULL_SPEED of bf16's (1.78x): 1 + 0.78 / (0.75 x 0.50) = 3.1. One
# measurement on one shape: other models' factors follow from their converted share, a rough figure.
_FULL_SLOWDOWN = 1.0 / FP8_FULL_SPEED - 1.0  # 0.78 of bf16's step added
FP8_FULL_EAGER_GEMM_TIME = 1.0 + _FULL_SLOWDOWN / (FP8_STEP_GEMM_SHARE * FP8_FULL_MEASURED_SHARE)


@dataclass(frozen=True)
class Fp8Layers:
    """The model's Linear layers as FP8 sees them. `converted`: (name, count, out, in) per decoder projection
    that converts; `kept`: (name, params, why it stays bf16)."""

    converted: tuple[tuple[str, int, int, int], ...]
    kept: tuple[tuple[str, int, str], ...]

    @property
    def params(self) -> int:
        return sum(count * out * inp for _, count, out, inp in self.converted)

    @property
    def rows(self) -> int:
        """Output rows of the converted layers (one fp32 scale each)."""
        return sum(count * out for _, count, out, _ in self.converted)

    @property
    def weight_bytes(self) -> float:
        return mem.FP8_BYTES * self.params + mem.FP8_SCALE_BYTES * self.rows


def decoder_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(out, in) features of each projection of one Llama/Qwen-style decoder layer."""
    h, inter, q, kv = spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim, spec.kv_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip


@functools.lru_cache(maxsize=64)
def fp8_layers(spec: ModelSpec) -> Fp8Layers:
    """Which of `spec`'s Linear layers FP8 converts: `models.fp8.exclusion` per decoder projection (its
    head / vision / multiple-of-16 / too-small rules); the rest of each group counted bf16."""
    from lmstack.memory.fp8_rules import exclusion

    shapes, layers = decoder_shapes(spec), spec.num_layers
    converted, kept = [], []
    for g in spec.linear_groups:
        shape = shapes.get(g.name)
        own = layers * shape[0] * shape[1] if shape else 0
        placed = shape is not None and g.count >= layers and (g.count == layers) == (g.weight_params == own)
        if not placed or g.weight_params < own:
            kept.append(
                (g.name, g.weight_params, "not a decoder projection the planner places: counted bf16")
            )
            continue
        out, inp = shape
        module = SimpleNamespace(in_features=inp, out_features=out)
        why = exclusion(None, f"model.layers.0.{g.name}", module, None)
        if why is None:
            converted.append((g.name, layers, out, inp))
        else:
            kept.append((g.name, own, why))
        if g.weight_params > own:  # the same name outside the decoder layers (e.g. a vision tower)
            kept.append((f"{g.name} (outside the decoder layers)", g.weight_params - own, "counted bf16"))
    return Fp8Layers(tuple(converted), tuple(kept))


def applies(s: Setup) -> bool:
    """The setup's FP8 scope matches its method (frozen-base: LoRA; float8-training: the trained base)."""
    lora = s.finetuning_type == "lora"
    return (s.fp8 == "frozen-base" and lora) or (s.fp8 == "float8-training" and not lora)


def frozen_weight_bytes(spec: ModelSpec) -> tuple[float, float]:
    """(FP8 bytes, bf16 bytes) of a frozen base under frozen-base FP8."""
    layers = fp8_layers(spec)
    return layers.weight_bytes, mem.BF16_BYTES * (spec.num_params - layers.params)


def transient_terms(spec: ModelSpec, s: Setup, tokens: int) -> tuple[tuple[str, float], ...]:
    """The FP8 copies one GEMM makes, as named rows (bytes) of the largest converted layer. The backward's
    row adds in full (it runs while the activations are held); the forward's only where it exceeds it
    (the two never coexist)."""
    converted = fp8_layers(spec).converted if applies(s) else ()
    if not converted:
        return ()
    b, sc = mem.FP8_BYTES, mem.FP8_SCALE_BYTES
    if s.fp8 == "frozen-base":
        bwd = max(b * (tokens * o + o * i) + sc * (tokens + i) for _, _, o, i in converted)
        fwd = max(b * tokens * i + sc * tokens for _, _, _, i in converted)
        return (
            ("fp8 backward: dy + W^T per input column, FP8 (one layer)", bwd),
            ("fp8 forward: one GEMM input in FP8, beyond the backward's", max(0.0, fwd - bwd)),
        )
    # scales: W^T per row (in), dy per token and per column (out), the input per column (in)
    bwd = max(
        b * (o * i + 2 * tokens * o + tokens * i) + sc * (2 * i + tokens + o) for _, _, o, i in converted
    )
    fwd = max(b * (tokens * i + o * i) + sc * (tokens + o) for _, _, o, i in converted)
    return (
        ("fp8 backward: W, dy x2, input in FP8 (one layer)", bwd),
        ("fp8 forward: input + W in FP8, beyond the backward's", max(0.0, fwd - bwd)),
    )


def time_factor(spec: ModelSpec, s: Setup) -> float:
    """The step's time with FP8 over bf16 (1.0 where the setup's scope does not apply)."""
    return scope_time_factor(spec, s.fp8) if applies(s) else 1.0


def scope_time_factor(spec: ModelSpec, scope: str) -> float:
    """The converted layers' share of the GEMM work (the head's GEMM in the whole) runs at its scope's time
    relative to bf16: FP8_GEMM_TIME + FP8_QUANT_TIME (frozen-base, faster), FP8_FULL_EAGER_GEMM_TIME
    (float8-training uncompiled, slower); FP8_STEP_GEMM_SHARE of the step is GEMM work."""
    gemm_params = spec.linear_params + spec.vocab_size * spec.hidden_size
    share = fp8_layers(spec).params / max(gemm_params, 1)
    per_gemm = FP8_GEMM_TIME + FP8_QUANT_TIME if scope == "frozen-base" else FP8_FULL_EAGER_GEMM_TIME
    return 1.0 - FP8_STEP_GEMM_SHARE * share * (1.0 - per_gemm)


def float8_training_measured() -> str:
    """The FP8 full fine-tuning measurement (FP8_FULL_*), in plain words."""
    return (
        f"torchao's float8 training ran at {FP8_FULL_SPEED:.2f}x of bf16's speed on the H200 (Qwen2.5-1.5B "
        f"shape, full fine-tuning, 8 x 2048: {FP8_FULL_FP8_TOKENS_PER_S:,} vs {FP8_FULL_BF16_TOKENS_PER_S:,} "
        "tok/s) without torch.compile, its casts and scales running as separate kernels; it saves no memory "
        "either (weights, gradients and optimizer states stay bf16/fp32, the FP8 copies add a transient)"
    )


def note(spec: ModelSpec, scope: str) -> str:
    """What FP8 does to this model, in one line (the plan's note for an FP8 row)."""
    layers = fp8_layers(spec)
    reasons: dict[str, list[str]] = {}
    for name, _, why in layers.kept:
        reasons.setdefault(why, []).append(name)
    kept = "; ".join(f"{', '.join(names)}: {why}" for why, names in reasons.items())
    if not layers.converted:
        return f"fp8 ({scope}): no Linear layer converts ({kept}): weights, activations and speed are bf16's"
    names = ", ".join(name for name, *_ in layers.converted)
    factor = scope_time_factor(spec, scope)
    if scope == "frozen-base":
        what = (
            f"{names} in FP8: {layers.weight_bytes / mem.GIB:.2f} GiB (1 B/param + an fp32 scale per output "
            f"row) instead of {mem.BF16_BYTES * layers.params / mem.GIB:.2f} GiB bf16"
        )
        speed = f"step time x{factor:.2f} (rough)"
    else:
        what = f"{names}: GEMMs in FP8 (torchao), weights stay bf16"
        speed = f"step time x{factor:.2f} of bf16's, slower (rough, uncompiled): {float8_training_measured()}"
    return f"fp8 ({scope}): {what}; {speed}" + (f"; kept bf16 ({kept})" if kept else "")


def unsearched(req: PlanRequest) -> str:
    """Why the search adds no FP8 row for this request ('' when it does, or fp8 is already on): what
    plan/rules.py refuses for this method or GPU (PlanRequest.fp8_refused), or a GPU of unknown kind."""
    if req.fp8:
        return ""
    if req.fp8_refused:
        return f"`lmstack check` would refuse fp8: true here ({req.fp8_refused})"
    if req.fp8_allowed is None:
        return "the request has no FP8 scope (plan/from_config.py request_from_plan fills it)"
    if req.gpu_capability is None:
        return "the GPU's compute capability is unknown (plan on the GPU, or give --gpu-capability, e.g. 9.0)"
    return ""


def notes(req: PlanRequest) -> list[str]:
    """What FP8 does to this model (fp8 on or searched), or why the search left it out ([] for a request
    built without the FP8 facts)."""
    scope = req.fp8 or (req.fp8_allowed if not unsearched(req) else None)
    if scope:
        return [note(req.spec, scope)]
    if req.fp8_refused or req.fp8_allowed:
        return [f"fp8: not searched: {unsearched(req)}"]
    return []
