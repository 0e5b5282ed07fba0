"""GPU: the fused LoRA Linear (models/fused_lora.py) equals PEFT's on CUDA (cuBLAS addmm epilogue with
alpha, beta=0 adapter grads): fp32 at tight tolerance, bf16 at least as close to a float64 reference
as PEFT, and under bf16 autocast with fp32 adapters."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lmstack.models.fused_lora import apply_fused_lora
from lmstack.models.kernels import cast_adapters_to_base_dtype

pytestmark = pytest.mark.gpu
IN, OUT, TOKENS = 896, 1152, (4, 512)


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=True)

    def forward(self, x):
        return self.proj(x)


def pair(dtype):
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], init_lora_weights=False)
    peft = get_peft_model(Proj().to("cuda", dtype), config)
    cast_adapters_to_base_dtype(peft)
    fused = copy.deepcopy(peft)
    assert apply_fused_lora(fused) == (1, {})
    return peft, fused


def run(model, x, dy):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(dy)
    layer = model.base_model.model.proj
    return {
        "out": y.detach().double(),
        "x": x.grad.double(),
        "A": layer.lora_A["default"].weight.grad.double(),
        "B": layer.lora_B["default"].weight.grad.double(),
    }


def inputs(dtype):
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(*TOKENS, IN, device="cuda", generator=gen)
    dy = torch.randn(*TOKENS, OUT, device="cuda", generator=gen)
    return x.to(dtype), dy.to(dtype)


def test_fp32_equals_peft_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    peft, fused = pair(torch.float32)
    x, dy = inputs(torch.float32)
    want, got = run(peft, x, dy), run(fused, x, dy)
    for key in want:
        assert (got[key] - want[key]).abs().max() <= 1e-5 * want[key].abs().max(), key


def test_bf16_no_less_accurate_than_peft_on_cuda():
    peft, fused = pair(torch.bfloat16)
    reference = copy.deepcopy(peft).to(torch.float64)
    x, dy = inputs(torch.bfloat16)
    ref = run(reference, x.double(), dy.double())
    want, got = run(peft, x, dy), run(fused, x, dy)
    for key in ref:
        err_fused, err_peft = (got[key] - ref[key]).abs().max(), (want[key] - ref[key]).abs().max()
        assert err_fused <= 1.25 * err_peft + 1e-3 * ref[key].abs().max(), (key, err_fused, err_peft)


def test_bf16_autocast_with_fp32_adapters_on_cuda():
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], init_lora_weights=False)
    peft = get_peft_model(Proj().to("cuda"), config)  # fp32 weights, as fp16/bf16 AMP runs keep them
    fused = copy.deepcopy(peft)
    apply_fused_lora(fused)
    x, dy = inputs(torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = run(peft, x, dy.bfloat16()), run(fused, x, dy.bfloat16())
    assert fused.base_model.model.proj.lora_A["default"].weight.grad.dtype == torch.float32
    for key in want:
        assert (got[key] - want[key]).abs().max() <= 2e-2 * want[key].abs().max(), key
