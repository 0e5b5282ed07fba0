"""Fused LoRA Linear: y = x @ W^T (+ b) + s * (x @ A^T) @ B^T in three GEMMs and no elementwise pass.

PEFT's LoRA Linear runs the base GEMM, the A GEMM, the B GEMM, then a full-size scale multiply and a
full-size add (on the H200, 21% of 0.5B-LoRA kernel time). Here the scaling s is the `alpha` of the
GEMM that adds the low-rank term into the base output in place (`out.addmm_(xa, B^T, alpha=s)`), and the
backward folds s the same way (dgrad: `(dy @ W).addmm_(dy @ B, A, alpha=s)`; the adapter grads are
`addmm(beta=0, alpha=s)`). Saved for backward: the LoRA input and xa = x @ A^T (what PEFT's autograd keeps
too); nothing is recomputed. The adapter parameters stay PEFT's own (saving/loading is unchanged).

`apply_fused_lora(model)` replaces the forward of each eligible PEFT `lora.Linear`; each call checks that
it is still plain LoRA (one active adapter, not merged, adapters enabled, no DoRA, no hooks on the
base/adapter modules, matching dtypes or autocast) and otherwise runs PEFT's own forward. Dropout
(`lora_dropout > 0`, training) is applied by PEFT's own dropout module to the A-branch input, as PEFT does.

Not done: batching the q/k/v (and gate/up) adapters. They share their input, so one x @ [Aq; Ak; Av]^T
GEMM could replace three (x read once instead of three times; the r-wide outputs are tiny), and the three
dgrads could share one pass. But the attention and MLP modules call their projections one by one, so
batching means replacing those modules' forwards per model family (and keeping PEFT's per-layer adapters
as views of a concatenated weight): not simple enough for what it saves (memory-bound reads of x).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.models.fp8 import fp8_dgrad, fp8_linear


class FusedLoraFunction(torch.autograd.Function):
    """(x, x_lora, W, b, A, B, s, W_scale) -> x @ W^T + b + s * (x_lora @ A^T) @ B^T.

    `x_lora` is the A-branch input when it differs from x (dropout); None means x itself, and then the
    input gradient of both branches is one tensor (no extra add). With `weight_scale` the frozen base is
    FP8 (models/fp8.py: W = weight * weight_scale): its forward and input-grad GEMMs run in FP8."""

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_a, lora_b, scaling, weight_scale=None):
        x2 = x.reshape(-1, x.shape[-1])
        xl = x2 if x_lora is None else x_lora.reshape(-1, x.shape[-1])
        xa = xl @ lora_a.t()  # [tokens, r]
        out = (
            F.linear(x2, weight, bias) if weight_scale is None else fp8_linear(x2, weight, weight_scale, bias)
        )
        out.addmm_(xa, lora_b.t(), alpha=scaling)  # base + s * xa @ B^T in the GEMM epilogue
        need_w = ctx.needs_input_grad[2]
        ctx.save_for_backward(
            x2 if need_w and x_lora is not None else None,
            xl,
            xa,
            weight,
            lora_a,
            lora_b,
            weight_scale,
        )
        ctx.scaling, ctx.shared_input, ctx.x_shape = scaling, x_lora is None, x.shape
        ctx.has_bias = bias is not None
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, xl, xa, weight, lora_a, lora_b, weight_scale = ctx.saved_tensors
        need_x, need_xl, need_w, need_b, need_a, need_bb = ctx.needs_input_grad[:6]
        s, shape = ctx.scaling, ctx.x_shape
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_xl = grad_w = grad_bias = grad_a = grad_b = None
        dyb = dy @ lora_b if (need_x or need_xl or need_a) else None  # [tokens, r]
        if need_x:
            grad_x = dy @ weight if weight_scale is None else fp8_dgrad(dy, weight, weight_scale)
            if ctx.shared_input:
                grad_x.addmm_(dyb, lora_a, alpha=s)
            grad_x = grad_x.reshape(shape)
        if need_xl:
            grad_xl = torch.addmm(xl, dyb, lora_a, beta=0, alpha=s).reshape(shape)  # beta=0: xl unread
        if need_w:
            grad_w = dy.t() @ (xl if x2 is None else x2)
        if need_b and ctx.has_bias:
            grad_bias = dy.sum(0)
        if need_a:
            grad_a = torch.addmm(lora_a, dyb.t(), xl, beta=0, alpha=s)
        if need_bb:
            grad_b = torch.addmm(lora_b, dy.t(), xa, beta=0, alpha=s)
        return grad_x, grad_xl, grad_w, grad_bias, grad_a, grad_b, None, None


def fused_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    x_lora: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W^T + b + scaling * (x_lora or x) @ A^T @ B^T; under autocast, in the autocast dtype (as F.linear).
    `weight_scale`: the base weight is FP8 (models/fp8.py), W = weight * weight_scale."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, lora_a, lora_b = (t.to(dtype) for t in (x, lora_a, lora_b))
        weight = weight if weight_scale is not None else weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        x_lora = None if x_lora is None else x_lora.to(dtype)
        with torch.autocast(device, enabled=False):
            return FusedLoraFunction.apply(
                x, x_lora, weight, bias, lora_a, lora_b, float(scaling), weight_scale
            )
    return FusedLoraFunction.apply(x, x_lora, weight, bias, lora_a, lora_b, float(scaling), weight_scale)


def _hooked(*modules: nn.Module) -> bool:
    """Forward hooks (DeepSpeed ZeRO-3 gathers weights in them) or an accelerate device-map hook: calling
    the module is what makes its weight usable, so the fused path, which reads it directly, steps aside."""
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in modules)


def _plain_call(layer: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The active adapter when this call is plain LoRA the fused path computes exactly, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A or _variant(layer, active[0]):
        return None
    name = active[0]
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if lora_b.bias is not None or _hooked(base, lora_a, lora_b):
        return None
    if not torch.is_autocast_enabled(x.device.type):
        dtypes = {x.dtype, lora_a.weight.dtype, lora_b.weight.dtype}
        if getattr(base, "weight_scale", None) is None:  # an FP8 base (models/fp8.py) computes in x's dtype
            dtypes.add(base.weight.dtype)
        if base.bias is not None:
            dtypes.add(base.bias.dtype)
        if len(dtypes) != 1:
            return None
    return name


def _variant(layer: Any, name: str) -> Any:
    """The adapter's LoRA variant (DoRA, ...); older PEFT releases only know DoRA, as `use_dora`."""
    return getattr(layer, "lora_variant", {}).get(name) or getattr(layer, "use_dora", {}).get(name)


def _lora_input(dropout: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The A-branch input: None (x itself) when the dropout is an identity on this call."""
    if isinstance(dropout, nn.Identity):
        return None
    if isinstance(dropout, nn.Dropout) and (not dropout.training or dropout.p == 0):
        return None
    return dropout(x)


def _fused_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = _plain_call(self, x, args, kwargs)
    if name is None:
        return self._lmstack_peft_forward(x, *args, **kwargs)
    base = self.base_layer
    return fused_lora_linear(
        x,
        base.weight,
        base.bias,
        self.lora_A[name].weight,
        self.lora_B[name].weight,
        self.scaling[name],
        x_lora=_lora_input(self.lora_dropout[name], x),
        weight_scale=getattr(base, "weight_scale", None),
    )


def unfusable(layer: Any) -> str | None:
    """Why this PEFT LoRA Linear cannot take the fused forward (None = it can)."""
    if type(layer.base_layer) is not nn.Linear:  # bitsandbytes' Linear4bit/8bitLt subclass nn.Linear
        return f"its base layer is {type(layer.base_layer).__name__}, not a plain nn.Linear"
    if layer.fan_in_fan_out:
        return "fan_in_fan_out: the base weight is stored transposed (Conv1D)"
    variants = [name for name in layer.lora_A if _variant(layer, name)]
    if variants:
        return f"adapter {variants[0]!r} is a LoRA variant (DoRA or another), not plain LoRA"
    if any(b.bias is not None for b in layer.lora_B.values()):
        return "its lora_B has a bias (lora_bias)"
    return None


def apply_fused_lora(model: nn.Module) -> tuple[int, dict[str, str]]:
    """Give every eligible PEFT lora.Linear the fused forward. Returns (layers fused, {name: why not}).
    Other LoRA layer kinds (Embedding, Conv, bitsandbytes' Linear4bit/8bitLt) keep PEFT's forward; the
    quantized ones are listed too."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer

    fused, skipped = 0, {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        kind = type(module).__name__
        if type(module) is LoraLinear:
            why = unfusable(module)
        elif "Linear" in kind:  # peft.tuners.lora.bnb / hqq / ... wrappers of a quantized Linear
            why = f"it is PEFT's {type(module).__module__}.{kind} (a quantized base)"
        else:
            continue
        if why:
            skipped[name] = why
            continue
        if not hasattr(module, "_lmstack_peft_forward"):
            module._lmstack_peft_forward = module.forward
            module.forward = types.MethodType(_fused_forward, module)
        fused += 1
    return fused, skipped
