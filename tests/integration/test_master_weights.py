"""master_weights: optimizer — bf16 model weights, fp32 masters in the optimizer (CPU, tiny model)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.train.master_weights import Fp32MasterWeights
from lmstack.train.run import train


def master_weights_mode(cfg, device: str) -> str:
    """The run plan's master-weights decision for `cfg` on a GPU (or this CPU)."""
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan
    from lmstack.plan.whatif import gpu_context

    ctx = gpu_context(1, 80) if device == "cuda" else LaunchContext()
    return RunPlan.resolve(cfg, ctx).precision.master_weights


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture
def full_cfg(base_cfg, tmp_path):
    return {**base_cfg, "finetuning_type": "full", "bf16": True, "learning_rate": 1e-3, "max_steps": 8}


def test_optimizer_masters_follow_classic_amp_and_save_bf16(full_cfg, tmp_path):
    curves = {}
    for mode in ("model", "optimizer"):
        cfg = {**full_cfg, "master_weights": mode, "output_dir": str(tmp_path / mode)}
        train(None, cfg)
        curves[mode] = losses(tmp_path / mode)
    amp, master = curves["model"], curves["optimizer"]
    assert len(master) == 8 and master[-1] < master[0] - 0.5  # it learns
    # same run, bf16 compute instead of fp32-weight autocast: the curves agree to bf16 rounding
    assert max(abs(a - b) for a, b in zip(amp, master, strict=True)) < 0.05, (amp, master)
    weights = load_file(tmp_path / "optimizer" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_masters_carry_the_update_precision(tiny_model):
    """An update far below bf16's resolution accumulates in the fp32 master and reaches the model."""
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = Fp32MasterWeights(torch.optim.SGD([param], lr=1.0))
    for _ in range(64):
        param.grad = torch.full((4,), 1e-3, dtype=torch.bfloat16)  # 1 - 1e-3 rounds back to 1 in bf16
        opt.step()
        opt.zero_grad()
    assert opt.masters[0][0].item() == pytest.approx(1 - 64 * 1e-3, rel=1e-2)
    assert param[0].item() == pytest.approx(1 - 64 * 1e-3, abs=4e-3)  # pure bf16 SGD would stay at 1.0
    state = opt.state_dict()
    fresh = Fp32MasterWeights(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], lr=1.0)
    )
    fresh.load_state_dict(state)
    assert torch.equal(fresh.masters[0], opt.masters[0]) and torch.equal(
        fresh.model_params[0], param.detach()
    )


def test_resume_restores_the_fp32_masters(full_cfg, tmp_path):
    import shutil

    straight = {**full_cfg, "master_weights": "optimizer", "save_steps": 4, "output_dir": str(tmp_path / "a")}
    train(None, straight)
    ckpt = tmp_path / "a" / "checkpoint-4"
    assert "fp32_master_weights" in torch.load(ckpt / "optimizer.pt", weights_only=False)
    shutil.copytree(ckpt, tmp_path / "b" / "checkpoint-4")  # as if the run had been killed after step 4
    train(None, {**straight, "output_dir": str(tmp_path / "b"), "resume_from_checkpoint": "auto"})
    assert losses(tmp_path / "b")[-1] == pytest.approx(losses(tmp_path / "a")[-1], abs=1e-4)


@pytest.mark.parametrize(
    "over, needs",
    [
        ({"finetuning_type": "lora"}, "finetuning_type: full or freeze"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps: 1"),
        ({"bf16": False}, "bf16: true"),
        ({"pure_bf16": True}, "pure_bf16: false"),
        ({"stage": "rm", "dataset": "dpo_en_demo"}, "stage: pt or sft"),
        ({"use_galore": True}, "the default AdamW optimizer"),
        ({"optim": "adamw_bnb_8bit"}, "optim: adamw_torch or adamw_torch_fused"),
    ],
)
def test_explicit_optimizer_masters_name_what_blocks_them(full_cfg, over, needs):
    cfg = build_config({**full_cfg, **over, "master_weights": "optimizer"})
    with pytest.raises(ConfigError, match="master_weights: optimizer needs") as err:
        master_weights_mode(cfg, "cuda")
    assert needs in str(err.value) and "master_weights: model" in str(err.value)


def test_auto_picks_optimizer_masters_on_cuda_only(full_cfg):
    cfg = build_config(full_cfg)
    assert cfg.training.master_weights == "auto"
    assert master_weights_mode(cfg, "cuda") == "optimizer"
    assert master_weights_mode(cfg, "cpu") == "model"
    assert (
        master_weights_mode(build_config({**full_cfg, "gradient_accumulation_steps": 4}), "cuda") == "model"
    )
