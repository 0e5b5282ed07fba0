"""FP8 frozen base (models/fp8.py) on CPU: the row-wise quantizer, the forward and input-grad GEMMs equal
an independent emulation of row-wise scaled FP8 (float8_e4m3fn exists on CPU, and torch._scaled_mm runs
there too), the layer choice on the tiny model, and the composition with PEFT's and the fused LoRA path."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lmstack.models.fp8 import (
    E4M3,
    Float8FrozenLinear,
    apply_fp8,
    fp8_layers,
    quantize_rowwise,
)
from lmstack.models.fused_lora import apply_fused_lora

BF16 = torch.bfloat16


def emulate_quant(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: per row, the largest power of two s with max|row| * s <= 448; q = round_e4m3(row * s)."""
    t = t.double()
    amax = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    mult = 2.0 ** torch.floor(torch.log2(448.0 / amax))
    q = (t * mult).clamp(-448, 448).to(torch.float32).to(E4M3).double()
    return q, 1.0 / mult


def emulate_linear(x2, w):
    xq, xs = emulate_quant(x2)
    wq, ws = emulate_quant(w)
    return (xq * xs) @ (wq * ws).t()


def emulate_dgrad(dy2, w):
    wq, ws = emulate_quant(w)  # the stored forward weight (per output row)
    w_back = ((wq * ws).t()).contiguous()  # W^T exactly as stored, requantized per row of W^T
    wtq, wts = emulate_quant(w_back)
    dq, ds = emulate_quant(dy2)
    return (dq * ds) @ (wtq * wts).t()


def relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_rowwise_quantizer_scales_are_powers_of_two_and_fit_e4m3():
    torch.manual_seed(0)
    t = torch.randn(16, 64, dtype=BF16) * torch.logspace(-3, 2, 16).to(BF16)[:, None]
    t[3] = 0  # an all-zero row (padding) stays zero, finite scale
    q, scale = quantize_rowwise(t)
    assert q.dtype == E4M3 and scale.shape == (16, 1) and scale.dtype == torch.float32
    assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))  # exact powers of two
    assert q.float().abs().max() <= 448 and torch.isfinite(scale).all()
    assert q[3].float().abs().max() == 0
    big = q.float().abs().amax(dim=-1)
    assert (big[torch.arange(16) != 3] > 224).all()  # the largest power of two: the top half of e4m3 is used
    back = q.float() * scale
    nonzero = t.float().abs() > 1e-2 * t.float().abs().amax(dim=-1, keepdim=True)
    assert ((back - t.float()).abs() / t.float().abs())[nonzero].max() <= 2**-4 + 1e-6  # half an e4m3 ulp
    want_q, want_s = emulate_quant(t)
    assert torch.equal(q.double(), want_q) and torch.equal(scale.double(), want_s)


@pytest.mark.parametrize("bias", [False, True])
def test_frozen_linear_forward_and_input_grad_equal_the_emulation(bias):
    torch.manual_seed(1)
    linear = nn.Linear(64, 48, bias=bias).to(BF16)
    layer = Float8FrozenLinear(linear)
    assert layer.weight.dtype == E4M3 and not layer.weight.requires_grad
    x = torch.randn(2, 5, 64, dtype=BF16, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, w = x.detach().reshape(-1, 64), linear.weight.detach()
    want = emulate_linear(x2, w) + (linear.bias.double() if bias else 0)
    assert y.dtype == BF16 and y.shape == (2, 5, 48)
    assert (y.reshape(-1, 48).double() - want).abs().max() <= 2**-7 * want.abs().max()  # bf16 output rounding
    want_dx = emulate_dgrad(dy.reshape(-1, 48), w)
    got_dx = x.grad.reshape(-1, 64).double()
    assert (got_dx - want_dx).abs().max() <= 2**-7 * want_dx.abs().max()
    # and FP8 stays close to the exact bf16 math (e4m3: 3 mantissa bits)
    exact = x2.double() @ w.double().t()
    assert relerr(y.reshape(-1, 48) - (linear.bias if bias else 0), exact) < 0.06
    assert relerr(got_dx, dy.reshape(-1, 48).double() @ w.double()) < 0.08
    assert layer.weight.grad is None and layer.weight_scale.grad is None


def test_frozen_linear_under_autocast_computes_in_bf16():
    torch.manual_seed(2)
    layer = Float8FrozenLinear(nn.Linear(32, 16).to(BF16))
    x = torch.randn(4, 32, requires_grad=True)  # fp32 input, as the Trainer's autocast sees it
    with torch.autocast("cpu", dtype=BF16):
        y = layer(x)
    y.float().sum().backward()
    assert y.dtype == BF16 and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16
        self.visual = nn.ModuleDict({"proj": nn.Linear(64, 64)})
        self.lm_head = nn.Linear(64, 96, bias=False)


def test_layer_choice_keeps_head_vision_and_odd_dims_in_bf16():
    model = Odd().requires_grad_(False)
    chosen, kept = fp8_layers(model, "frozen-base", pays_only=False)
    assert set(chosen) == {"up"}
    assert kept == {
        "odd": "in/out features not multiples of 16",
        "visual.proj": "the vision tower / projector",
        "lm_head": "the output head",
    }
    trainable = Odd()
    assert set(fp8_layers(trainable, "frozen-base", pays_only=False)[0]) == set()  # nothing frozen to convert
    assert set(fp8_layers(trainable, "float8-training", pays_only=False)[0]) == {"up"}


def test_layers_too_small_for_fp8_to_pay_stay_bf16_by_default(tiny_model):
    with torch.device("meta"):
        model = nn.ModuleDict(
            {
                "mlp_up": nn.Linear(3584, 18944),  # 7B gate/up: FP8 pays (measured on the H200)
                "attn_o": nn.Linear(3584, 3584),  # 7B q/o: even; kept FP8
                "attn_k": nn.Linear(3584, 512),  # 7B k/v: FP8 2.5x slower
                "small_up": nn.Linear(896, 4864),  # 0.5B gate/up: FP8 1.8x slower in backward
            }
        ).requires_grad_(False)
    chosen, kept = fp8_layers(model, "frozen-base")
    assert set(chosen) == {"mlp_up", "attn_o"}
    assert kept == {"attn_k": "too small for FP8 to pay", "small_up": "too small for FP8 to pay"}
    assert fp8_layers(lora_model(tiny_model), "frozen-base")[0] == {}  # the tiny model: all too small


def lora_model(tiny_model, target="all", seed=0):
    from transformers import AutoModelForCausalLM

    from lmstack.models.adapters import find_all_linear_modules

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=BF16)
    targets = find_all_linear_modules(model) if target == "all" else target.split(",")
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    peft = get_peft_model(model, config)
    for p in peft.parameters():
        if p.requires_grad:
            p.data = p.data.to(BF16)
    return peft


def test_on_the_tiny_model_every_frozen_base_projection_and_nothing_else_is_fp8(tiny_model):
    peft = lora_model(tiny_model)
    chosen, kept = fp8_layers(peft, "frozen-base", pays_only=False)
    leaves = {n.split(".")[-2] + "." + n.split(".")[-1] for n in chosen}
    assert leaves == {
        f"{p}.base_layer"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    }
    assert len(chosen) == 7 * 2  # two layers
    assert [n for n, why in kept.items() if why == "the output head"] == ["base_model.model.lm_head"]
    # with adapters on q_proj only, the untargeted frozen projections are FP8 too
    chosen_q = fp8_layers(lora_model(tiny_model, "q_proj"), "frozen-base", pays_only=False)[0]
    assert len(chosen_q) == 14 and any(n.endswith("mlp.down_proj") for n in chosen_q)


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 48, bias=True)

    def forward(self, x):
        return self.proj(x)


def test_fused_lora_over_an_fp8_base_equals_peft_over_the_same_base():
    """One LoRA Linear: the fused path's FP8 base GEMMs (forward, input grad) and PEFT's path through the
    Float8FrozenLinear give the same outputs and gradients up to bf16 rounding of the adds."""
    torch.manual_seed(3)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], init_lora_weights=False)
    peft = get_peft_model(Proj().to(BF16), config)
    for p in peft.parameters():
        p.data = p.data.to(BF16)
    fused = copy.deepcopy(peft)
    assert apply_fused_lora(fused) == (1, {})
    assert (
        apply_fp8(peft, "frozen-base", pays_only=False) == 1
        and apply_fp8(fused, "frozen-base", pays_only=False) == 1
    )
    x = torch.randn(3, 7, 64, dtype=BF16)
    dy = torch.randn(3, 7, 48, dtype=BF16)
    got = {}
    for name, model in (("peft", peft), ("fused", fused)):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(dy)
        layer = model.base_model.model.proj
        got[name] = [y, xi.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]
        assert isinstance(layer.base_layer, Float8FrozenLinear)
    for want, have in zip(got["peft"], got["fused"], strict=True):
        assert relerr(have, want) < 1e-2


def test_fp8_frozen_base_on_the_tiny_model_trains_the_adapters_close_to_bf16(tiny_model):
    peft = lora_model(tiny_model)
    ids = torch.randint(3, 1000, (2, 24))
    bf16_loss, bf16_grads = forward_backward(peft, ids)
    fp8_peft, fused = copy.deepcopy(peft), copy.deepcopy(peft)
    assert apply_fp8(fp8_peft, "frozen-base", pays_only=False) == 14
    assert apply_fused_lora(fused)[0] == 14  # the stages' order: adapters, fused forward, then FP8
    assert apply_fp8(fused, "frozen-base", pays_only=False) == 14
    for model in (fp8_peft, fused):
        loss, grads = forward_backward(model, ids)
        assert set(grads) == set(bf16_grads) and all("lora_" in n for n in grads)
        assert abs(loss - bf16_loss) <= 0.02 * abs(bf16_loss)
        flat = torch.cat([g.flatten().double() for g in grads.values()])
        want = torch.cat([bf16_grads[n].flatten().double() for n in grads])
        assert torch.nn.functional.cosine_similarity(flat, want, dim=0) > 0.95  # FP8 noise, same direction
    fp8_params = [n for n, p in fp8_peft.named_parameters() if p.dtype == E4M3]
    assert len(fp8_params) == 14 and not any(
        p.requires_grad for p in fp8_peft.parameters() if p.dtype == E4M3
    )
    assert set(fp8_peft._ddp_params_and_buffers_to_ignore) >= set(fp8_params)
    frozen_bytes = sum(p.numel() * p.element_size() for p in fp8_peft.parameters() if p.dtype == E4M3)
    assert frozen_bytes == sum(p.numel() for p in fp8_peft.parameters() if p.dtype == E4M3)  # 1 byte each


def test_float8_training_converts_the_chosen_layers_with_torchao(tiny_model):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=BF16)
    assert apply_fp8(model, "float8-training", "rowwise", pays_only=False) == 14
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {n for n, k in kinds.items() if k is Float8Linear} == {
        n for n in kinds if n.split(".")[-1] != "lm_head"
    }
    ids = torch.randint(3, 1000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
