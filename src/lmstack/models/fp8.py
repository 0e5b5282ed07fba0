"""FP8 GEMMs for training (speed: the GEMMs run at FP8 tensor-core rate) on NVIDIA GPUs with FP8 tensor cores (sm89+). The run plan picks
the scope (plan.fp8); `apply_fp8(model, scope, recipe)` runs after the adapters are in place.

- `frozen-base` (LoRA): every frozen nn.Linear of the model (PEFT's LoRA base layers and the projections
  no adapter targets) becomes a Float8FrozenLinear. Its weight is quantized once to float8_e4m3fn with one
  power-of-two scale per output row (1 byte a parameter; the bf16 copy is dropped). Forward:
  x (one scale per token) @ W^T in FP8 through torch._scaled_mm, output bf16. Backward: only the input
  gradient, dy (one scale per token) @ W in FP8, with W requantized per input column (the GEMM's
  contraction runs over the output features now); a frozen weight gets no gradient. The adapters stay
  bf16; the fused LoRA path (models/fused_lora.py) calls `fp8_linear` / `fp8_dgrad` for its base GEMM.
- `float8-training` (full): torchao's `convert_to_float8_training` (Float8LinearConfig of the plan's
  recipe: rowwise, or tensorwise when FSDP2 gathers float8 weights).

Left in bf16 in both: the output head, embeddings (not GEMMs), vision towers and projectors, Linear
layers whose in or out features are not multiples of 16 (what the FP8 tensor-core GEMM needs), and
layers too small for FP8 to pay (`too_small`: all of Qwen2.5-0.5B's; 7B's k/v projections).

Why not torchao for the frozen base: its inference weight (Float8DynamicActivationFloat8WeightConfig,
PerRow) computes `linear` through `__torch_function__` into torch._scaled_mm, which has no derivative
("derivative for aten::_scaled_mm is not implemented"), so LoRA's backward gets no input gradient; and
torchao's Float8Linear (training) keeps the bf16 weight and always computes the weight gradient, a third
GEMM thrown away on a frozen weight.

Scales are powers of two (torchao's rowwise recipe does the same): scaling is exact, and an FP8 weight
times its scale is exactly representable in bf16, so the backward's per-column requantization starts
from the exact quantized weight.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from lmstack.memory.fp8_rules import HEAD_NAMES, SCOPES, VISION_PARTS, exclusion, too_small  # noqa: F401 (models.fp8.<name>)

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (q [R, C] float8_e4m3fn, scale [R, 1] float32), t ~= q * scale: one power-of-two scale
    per row, chosen so the row's largest magnitude fits e4m3's 448."""
    return _fused(_quantize_rowwise, t)


def _fused(fn, *tensors: torch.Tensor):
    """`fn` as one compiled kernel on a GPU outside a compiled region; traced with the layer inside one;
    eager on the CPU. Eager, the quantization is six passes over the tensor: on the H200 that made the FP8
    input-grad GEMM of a 16384 x 3584 x 18944 projection slower than bf16's (5.0 ms against 3.0 ms)."""
    if tensors[0].is_cuda and not torch.compiler.is_compiling():
        return _compiled(fn)(*tensors)
    return fn(*tensors)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=None)


def _quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.contiguous()
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    mult = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))  # a power of two: t * mult is exact
    q = (t * mult.to(t.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, mult.reciprocal()


def _scaled_mm(a_q, a_scale, b_q_t, b_scale, out_dtype) -> torch.Tensor:
    """(a_q * a_scale) @ (b_q_t * b_scale) with a_q [M, K] row-major, b_q_t [K, N] column-major (the
    transpose of a row-major [N, K]), a_scale [M, 1], b_scale [1, N]: cuBLASLt's row-wise FP8 GEMM."""
    return torch._scaled_mm(a_q, b_q_t, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


def fp8_linear(
    x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x2 [M, K] @ W^T (+ bias) with W = weight [N, K] (e4m3) * weight_scale [N, 1]; output in x2's dtype."""
    xq, xs = quantize_rowwise(x2)
    out = _scaled_mm(xq, xs, weight.t(), weight_scale.view(1, -1), x2.dtype)
    return out if bias is None else out.add_(bias.to(out.dtype))


def fp8_dgrad(dy2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """dy2 [M, N] @ W -> [M, K]: dy scaled per token, W^T requantized per row (= per input column of W)."""
    dq, ds, wq_t, ws_t = _fused(_dgrad_operands, dy2, weight, weight_scale)
    return _scaled_mm(dq, ds, wq_t.t(), ws_t.view(1, -1), dy2.dtype)


def _dgrad_operands(dy2, weight, weight_scale):
    w_t = weight.t().contiguous().to(dy2.dtype) * weight_scale.view(1, -1).to(dy2.dtype)  # exact (pow-2)
    return (*_quantize_rowwise(dy2), *_quantize_rowwise(w_t))  # w_t: [K, N], one scale per input column


class Fp8FrozenLinearFunction(torch.autograd.Function):
    """(x, weight e4m3 [N, K], weight_scale [N, 1], bias) -> x @ W^T + bias; backward: the input gradient
    only (weight and bias are frozen)."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, bias):
        out = fp8_linear(x.reshape(-1, x.shape[-1]), weight, weight_scale, bias)
        ctx.save_for_backward(weight, weight_scale)
        ctx.x_shape = x.shape
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        weight, weight_scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        return fp8_dgrad(dy, weight, weight_scale).reshape(ctx.x_shape), None, None, None


def fp8_frozen_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The frozen FP8 Linear; under autocast it computes in the autocast dtype (as F.linear does)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            return Fp8FrozenLinearFunction.apply(x, weight, weight_scale, bias)
    return Fp8FrozenLinearFunction.apply(x, weight, weight_scale, bias)


class Float8FrozenLinear(nn.Module):
    """A frozen nn.Linear whose weight lives in FP8 (e4m3, one power-of-two scale per output row).

    `weight` (float8_e4m3fn [out, in]), `weight_scale` (float32 [out, 1]) and `bias` are frozen
    parameters (moved with the model, never trained, not in the optimizer)."""

    def __init__(self, linear: nn.Linear, device: torch.device | str | None = None):
        super().__init__()
        self.out_features, self.in_features = linear.out_features, linear.in_features
        weight = linear.weight.detach().to(device or linear.weight.device)
        q, scale = quantize_rowwise(weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(weight.device), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_frozen_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8 e4m3 row-wise"


def paying_projections(config: dict) -> tuple[list[str], list[str]]:
    """(projections FP8 pays on, those too small) of one decoder layer, from a config.json's dims."""
    text = config.get("text_config") or config
    h, inter = text.get("hidden_size"), text.get("intermediate_size")
    heads = text.get("num_attention_heads")
    if not (h and inter and heads):
        return [], []
    kv = text.get("num_key_value_heads", heads) * text.get("head_dim", h // heads)
    shapes = {"q_proj": (heads * text.get("head_dim", h // heads), h), "k_proj": (kv, h), "v_proj": (kv, h),
              "o_proj": (h, heads * text.get("head_dim", h // heads)), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip
    pays = [name for name, (n, k) in shapes.items() if not too_small(n, k)]
    return pays, [name for name in shapes if name not in pays]


def small_layers_note(config: dict) -> str | None:
    """The plan's note when some of a config.json's projections stay bf16 for being too small."""
    pays, small = paying_projections(config)
    if not small:
        return None
    text = config.get("text_config") or config
    dims = f"hidden_size {text.get('hidden_size')}, intermediate_size {text.get('intermediate_size')}"
    kept = f"{', '.join(small)} stay bf16: too small for FP8 to pay ({dims}; models/fp8.py too_small)"
    return f"fp8: {kept}" + ("; no projection is FP8, the run computes in bf16" if not pays else "")


def fp8_layers(
    model: nn.Module, scope: str, pays_only: bool = True
) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """(name -> the nn.Linear layers the scope converts, name -> why another Linear stays bf16).
    frozen-base takes frozen layers only (adapters and modules_to_save train in bf16); float8-training
    takes the trainable ones."""
    if scope not in SCOPES:
        raise ValueError(f"fp8 scope {scope!r}; allowed: {' | '.join(SCOPES)}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen, kept = {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        why = exclusion(model, name, module, head, pays_only)
        trainable = module.weight.requires_grad or (module.bias is not None and module.bias.requires_grad)
        if why is None and scope == "frozen-base" and trainable:
            continue  # LoRA A/B, modules_to_save: trained in bf16, not a frozen base
        if why is None and scope == "float8-training" and not trainable:
            why = "frozen"
        if why is None:
            chosen[name] = module
        else:
            kept[name] = why
    return chosen, kept


def apply_fp8(
    model: nn.Module,
    scope: str,
    recipe: str = "rowwise",
    all_gather: bool = False,
    device: str | None = None,
    pays_only: bool = True,
) -> int:
    """Convert the model's Linear layers for FP8 training (see the module doc); returns how many.
    `all_gather` (float8-training under FSDP2): float8 weight all-gather. `device` (frozen-base): where the
    FP8 weights are made and kept (the GPU: quantizing there is fast)."""
    chosen, kept = fp8_layers(model, scope, pays_only)
    if scope == "float8-training":
        _float8_training(model, set(chosen), recipe, all_gather)
    else:
        for name, linear in chosen.items():
            parent, leaf = _parent(model, name)
            setattr(parent, leaf, Float8FrozenLinear(linear, device))
        # every process quantizes the same weights the same way: DDP need not broadcast them
        ignored = [n for n, p in model.named_parameters() if p.dtype == E4M3 or n.endswith(".weight_scale")]
        model._ddp_params_and_buffers_to_ignore = ignored
    reasons = Counter(kept.values())
    logger.info(
        "fp8: %d Linear layers in FP8 (%s, %s scales)%s",
        len(chosen),
        scope,
        recipe,
        "; kept in bf16: " + ", ".join(f"{n} ({why})" for why, n in reasons.items()) if reasons else "",
    )
    return len(chosen)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _float8_training(model: nn.Module, names: set[str], recipe: str, all_gather: bool) -> Any:
    """torchao's float8 training on the chosen layers (the plan's recipe: rowwise, or tensorwise with
    FSDP2 float8 all-gather, which torchao supports for tensorwise scales only)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in names)
