"""GPU (sm89+): the FP8 frozen base (models/fp8.py) through cuBLASLt's row-wise FP8 GEMM: forward and
input grad close to bf16 at a real layer size, the fused LoRA path over it equal to PEFT's, the plan's
refusal-free path on this GPU, a 20-step tiny training run with fp8 on (LoRA; full with torchao when
installed) whose loss falls like the bf16 run's, and regional compile (inductor) composed with FP8."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lmstack.models.fp8 import Float8FrozenLinear, apply_fp8, fp8_dgrad, fp8_linear, quantize_rowwise
from lmstack.models.fused_lora import apply_fused_lora

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
IN, OUT, TOKENS = 3584, 4608, 8192


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)


needs_fp8 = pytest.mark.skipif(not fp8_gpu(), reason="needs an sm89+ GPU (FP8 tensor cores)")


def relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_fp8
def test_fp8_gemms_are_close_to_bf16_and_equal_their_emulation():
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(TOKENS, IN, device="cuda", generator=gen).to(BF16)
    w = (torch.randn(OUT, IN, device="cuda", generator=gen) * 0.02).to(BF16)
    dy = torch.randn(TOKENS, OUT, device="cuda", generator=gen).to(BF16)
    wq, ws = quantize_rowwise(w)
    y = fp8_linear(x, wq, ws)
    dx = fp8_dgrad(dy, wq, ws)
    assert y.dtype == dx.dtype == BF16
    assert relerr(y, x.float() @ w.float().t()) < 0.05
    assert relerr(dx, dy.float() @ w.float()) < 0.07
    xq, xs = quantize_rowwise(x)
    emulated = (xq.float() * xs) @ (wq.float() * ws).t()  # the GEMM cuBLASLt must compute
    assert relerr(y, emulated) < 5e-3


@needs_fp8
def test_frozen_linear_backward_on_cuda():
    torch.manual_seed(0)
    linear = nn.Linear(IN, OUT, bias=True, device="cuda", dtype=BF16)
    layer = Float8FrozenLinear(linear)
    x = torch.randn(4, 2048, IN, device="cuda", dtype=BF16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(4, 2048, OUT, device="cuda", dtype=BF16)
    layer(x).backward(dy)
    linear(x_ref).backward(dy)
    assert relerr(x.grad, x_ref.grad) < 0.07
    assert layer.weight.element_size() == 1 and layer.weight.grad is None


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=True)

    def forward(self, x):
        return self.proj(x)


@needs_fp8
def test_fused_lora_over_the_fp8_base_equals_peft_on_cuda():
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], init_lora_weights=False)
    peft = get_peft_model(Proj().to("cuda", BF16), config)
    for p in peft.parameters():
        p.data = p.data.to(BF16)
    fused = copy.deepcopy(peft)
    assert apply_fused_lora(fused) == (1, {})
    apply_fp8(peft, "frozen-base")
    apply_fp8(fused, "frozen-base")
    x = torch.randn(2, 1024, IN, device="cuda", dtype=BF16)
    dy = torch.randn(2, 1024, OUT, device="cuda", dtype=BF16)
    out = {}
    for name, model in (("peft", peft), ("fused", fused)):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(dy)
        layer = model.base_model.model.proj
        out[name] = [y, xi.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]
    for want, have in zip(out["peft"], out["fused"], strict=True):
        assert relerr(have, want) < 1e-2


def losses(out_dir) -> list[float]:
    rows = [json.loads(x) for x in (out_dir / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Two decoder layers wide enough that FP8 pays on q/o/gate/up/down (k/v stay bf16: too small)."""
    from lmstack.tiny import build_tiny_model

    dims = dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8)
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "m", initializer_range=0.02, **dims)


def tiny_run(base_cfg, model, out, **over) -> list[float]:
    from lmstack.train.run import train

    cfg = {**base_cfg, "model_name_or_path": str(model), "bf16": True, "max_steps": 20, "learning_rate": 1e-3,
           "packing": True}  # fmt: skip
    train(None, {**cfg, **over, "output_dir": str(out)})
    return losses(out)


@needs_fp8
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_tiny_training_with_fp8_falls_like_bf16(base_cfg, wide_model, tmp_path, kind):
    if kind == "full":
        pytest.importorskip("torchao")
    ref = tiny_run(base_cfg, wide_model, tmp_path / "bf16", finetuning_type=kind)
    fp8 = tiny_run(base_cfg, wide_model, tmp_path / "fp8", finetuning_type=kind, fp8=True)
    plan = json.loads((tmp_path / "fp8" / "run_manifest.json").read_text())["plan"]
    assert plan["decisions"]["fp8"] == (
        "frozen-base (rowwise)" if kind == "lora" else "float8-training (rowwise)"
    )
    assert any("k_proj, v_proj stay bf16" in n for n in plan["notes"])
    assert len(fp8) == len(ref) == 20 and all(torch.isfinite(torch.tensor(fp8)))
    assert fp8[-1] < fp8[0] and ref[-1] < ref[0]  # both learn
    assert abs(fp8[-1] - ref[-1]) <= 0.03 * ref[-1]
    assert fp8 != ref  # FP8 really ran: its rounding shows in the losses


@needs_fp8
def test_regional_compile_with_fp8_trains_like_eager_fp8(base_cfg, wide_model, tmp_path):
    eager = tiny_run(base_cfg, wide_model, tmp_path / "eager", fp8=True)
    compiled = tiny_run(base_cfg, wide_model, tmp_path / "compiled", fp8=True, torch_compile=True)
    assert len(compiled) == 20
    assert abs(compiled[-1] - eager[-1]) <= 0.02 * eager[-1]
