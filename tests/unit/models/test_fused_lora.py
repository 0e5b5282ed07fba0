"""Fused LoRA Linear (models/fused_lora.py) equals PEFT's LoRA Linear: outputs and gradients (input, A, B)
in float64 and fp32 on random inputs; the run plan's lora_kernel decision and its refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.models.fused_lora import apply_fused_lora, fused_lora_linear
from lmstack.models.kernels import cast_adapters_to_base_dtype
from lmstack.plan import decide_kernels

IN, OUT = 48, 40


class Proj(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=bias)

    def forward(self, x):
        return self.proj(x)


def peft_pair(dtype, bias=True, rank=8, alpha=16, rslora=False, dropout=0.0, dora=False, seed=0):
    """(PEFT's model, the same model with the fused forward), adapters initialised non-zero."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        use_rslora=rslora,
        use_dora=dora,
        target_modules=["proj"],
        init_lora_weights=False,  # random B: the low-rank term is not zero
    )
    peft = get_peft_model(Proj(bias).to(dtype), config)
    fused = copy.deepcopy(peft)
    if not dora:
        assert apply_fused_lora(fused) == (1, {})
    return peft, fused


def lora_params(model):
    layer = model.base_model.model.proj
    return layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.base_layer


def forward_backward(model, x, grad_out):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(grad_out)
    a, b, base = lora_params(model)
    return {"out": y.detach(), "x": x.grad, "A": a.grad, "B": b.grad, "base": base.weight.grad}


def assert_equal_to_peft(peft, fused, shape, dtype, rel):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, IN, generator=gen, dtype=dtype)
    dy = torch.randn(*shape, OUT, generator=gen, dtype=dtype)
    want, got = forward_backward(peft, x, dy), forward_backward(fused, x, dy)
    assert got["base"] is None and want["base"] is None  # the frozen base weight gets no gradient
    for key in ("out", "x", "A", "B"):
        scale = want[key].abs().max()
        err = (got[key] - want[key]).abs().max()
        assert err <= rel * scale, f"{key}: max error {err:.3g} vs {rel:g} x {scale:.3g}"


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("shape", [(13,), (3, 7)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("rank,alpha,rslora", [(1, 16, False), (4, 7, False), (8, 16, True), (16, 32, False)])
def test_fused_equals_peft(dtype, rel, shape, bias, rank, alpha, rslora):
    peft, fused = peft_pair(dtype, bias=bias, rank=rank, alpha=alpha, rslora=rslora)
    layer = fused.base_model.model.proj
    assert layer.scaling["default"] == pytest.approx(alpha / (math.sqrt(rank) if rslora else rank))
    assert_equal_to_peft(peft, fused, shape, dtype, rel)


def test_bf16_is_no_less_accurate_than_peft():
    """In bf16 the fused path rounds once (GEMM epilogue) where PEFT rounds after B, after the scale and
    after the add: against a float64 reference its error is at most PEFT's (plus a little)."""
    peft, fused = peft_pair(torch.bfloat16, rank=8)  # PEFT keeps fp32 adapters on a bf16 base ...
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, IN, generator=gen)
    dy = torch.randn(4, 16, OUT, generator=gen)
    mixed = forward_backward(fused, x.bfloat16(), dy.bfloat16())  # ... which the fused path leaves to PEFT
    assert torch.equal(mixed["out"], forward_backward(peft, x.bfloat16(), dy.bfloat16())["out"])
    assert cast_adapters_to_base_dtype(peft) == cast_adapters_to_base_dtype(fused) == 2  # as lmstack trains
    reference = copy.deepcopy(peft).to(torch.float64)
    ref = forward_backward(reference, x.double(), dy.double())
    want = forward_backward(peft, x.bfloat16(), dy.bfloat16())
    got = forward_backward(fused, x.bfloat16(), dy.bfloat16())
    assert got["out"].dtype == torch.bfloat16 and got["A"].dtype == torch.bfloat16
    for key in ("out", "x", "A", "B"):
        err_fused = (got[key].double() - ref[key]).abs().max()
        err_peft = (want[key].double() - ref[key]).abs().max()
        assert err_fused <= 1.25 * err_peft + 1e-3 * ref[key].abs().max(), (key, err_fused, err_peft)


def test_autocast_matches_peft_and_keeps_fp32_adapter_grads():
    peft, fused = peft_pair(torch.float32)
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, 9, IN, generator=gen), torch.randn(2, 9, OUT, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = forward_backward(peft, x, dy.bfloat16())
        got = forward_backward(fused, x, dy.bfloat16())
    assert got["out"].dtype == want["out"].dtype == torch.bfloat16
    assert got["A"].dtype == got["B"].dtype == torch.float32
    for key in ("out", "x", "A", "B"):
        assert (got[key].float() - want[key].float()).abs().max() <= 2e-2 * want[key].abs().max(), key


def test_dropout_equals_peft_in_eval_and_in_training():
    """lora_dropout > 0: the same dropout module draws the same mask (same seed), on the A branch only."""
    peft, fused = peft_pair(torch.float32, dropout=0.3)
    peft.eval(), fused.eval()
    assert_equal_to_peft(peft, fused, (3, 7), torch.float32, 1e-6)
    peft.train(), fused.train()
    gen = torch.Generator().manual_seed(4)
    x, dy = torch.randn(3, 7, IN, generator=gen), torch.randn(3, 7, OUT, generator=gen)
    torch.manual_seed(5)
    want = forward_backward(peft, x, dy)
    torch.manual_seed(5)
    got = forward_backward(fused, x, dy)
    torch.manual_seed(6)
    other_mask = forward_backward(fused, x, dy)
    assert not torch.allclose(other_mask["out"], got["out"])  # dropout is really applied in training
    for key in ("out", "x", "A", "B"):
        assert (got[key] - want[key]).abs().max() <= 1e-6 * want[key].abs().max(), key


def test_disabled_merged_and_dora_layers_keep_peft_semantics():
    peft, fused = peft_pair(torch.float64)
    x = torch.randn(5, IN, dtype=torch.float64)
    base = fused.base_model.model.proj.base_layer
    with fused.disable_adapter():  # DPO/KTO's reference model: the base alone
        assert torch.allclose(fused(x), base(x))
    assert not torch.allclose(fused(x), base(x))
    fused.base_model.model.proj.merge()
    assert torch.allclose(fused(x), peft(x))  # merged: the base GEMM with the merged weight, no double add
    _, dora = peft_pair(torch.float64, dora=True)
    count, skipped = apply_fused_lora(dora)
    assert count == 0 and "LoRA variant" in skipped["base_model.model.proj"]


def test_function_direct_3d_with_separate_lora_input():
    """x_lora (dropout output) given separately: gradients flow to both inputs, as two linear maps."""
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(OUT, IN, dtype=torch.float64, generator=gen), torch.randn(OUT, dtype=torch.float64)
    a = torch.randn(4, IN, dtype=torch.float64, generator=gen, requires_grad=True)
    bb = torch.randn(OUT, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    x = torch.randn(2, 3, IN, dtype=torch.float64, generator=gen, requires_grad=True)
    xl = torch.randn(2, 3, IN, dtype=torch.float64, generator=gen, requires_grad=True)

    def ref(x, xl, a, bb):
        return x @ w.t() + b + 0.7 * (xl @ a.t()) @ bb.t()

    def fused(x, xl, a, bb):
        return fused_lora_linear(x, w, b, a, bb, 0.7, x_lora=xl)

    assert torch.allclose(fused(x, xl, a, bb), ref(x, xl, a, bb))
    assert torch.autograd.gradcheck(fused, (x, xl, a, bb))


def cfg(**fields):
    return build_config({"model_name_or_path": "m", "output_dir": "o", **fields})


def test_plan_decision_auto_peft_and_refusals():
    assert decide_kernels.lora_kernel(cfg(), None)[0] == "fused"
    assert decide_kernels.lora_kernel(cfg(lora_kernel="peft"), None)[0] == "peft"
    value, why = decide_kernels.lora_kernel(cfg(use_dora=True), None)
    assert value == "peft" and "use_dora" in why
    assert decide_kernels.lora_kernel(cfg(quantization_bit=4), None)[0] == "peft"
    assert decide_kernels.lora_kernel(cfg(lora_kernel="auto"), 3)[0] == "peft"
    with pytest.raises(ConfigError, match="lora_kernel: fused needs use_dora: false"):
        decide_kernels.lora_kernel(cfg(lora_kernel="fused", use_dora=True), None)
    with pytest.raises(ConfigError, match="finetuning_type: lora \\(got full\\)"):
        decide_kernels.lora_kernel(cfg(lora_kernel="fused", finetuning_type="full"), None)
    with pytest.raises(ConfigError, match="ZeRO-3"):
        decide_kernels.lora_kernel(cfg(lora_kernel="fused"), 3)
