"""Seed 003 §10.7 as executable rules over the run plan: one test per row that lmstack acts on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import FsdpLaunch, LaunchContext
from lmstack.plan import rules
from lmstack.plan.rules import check_rules
from lmstack.plan.runplan import RunPlan

REPO = Path(__file__).resolve().parents[3]
Z2 = REPO / "examples/deepspeed/ds_z2_config.json"
Z3 = REPO / "examples/deepspeed/ds_z3_config.json"
CPU = LaunchContext()
FSDP = replace(CPU, accelerate_fsdp=FsdpLaunch(), world_size=2, under_launcher=True)


def problems(base_cfg, ctx=CPU, launch=False, **over) -> list[str]:
    return check_rules(RunPlan.resolve(build_config({**base_cfg, **over}), ctx), launch)[1]


GPU = replace(CPU, cuda=True, gpu_count=1, gpu_memory_gib=140.0, bf16_supported=True)
GPU_UNSLOTH = replace(GPU, packages=frozenset({"unsloth", "liger_kernel", "deepspeed"}))


def test_unsloth_needs_this_machine_to_have_a_gpu_and_the_package(base_cfg):
    # `check` (launch=False) may run on another machine than the job: no machine facts there
    assert problems(base_cfg, use_unsloth=True) == []
    found = problems(base_cfg, launch=True, use_unsloth=True)
    assert len(found) == 1 and "use_unsloth: true needs a CUDA GPU" in found[0]
    found = problems(base_cfg, GPU, launch=True, use_unsloth=True)
    assert (
        len(found) == 1
        and "needs the unsloth package, which is not installed: pip install 'lmstack[unsloth]'" in found[0]
    )
    assert problems(base_cfg, GPU_UNSLOTH, launch=True, use_unsloth=True) == []


def test_unsloth_on_a_gpu_is_one_decision_every_part_reads(base_cfg):
    plan = RunPlan.resolve(
        build_config({**base_cfg, "use_unsloth": True, "enable_liger_kernel": True}), GPU_UNSLOTH
    )
    assert plan.unsloth and plan.model_spec().unsloth
    assert plan.loss_kernel == "none" and "Unsloth" in plan.reasons["loss_kernel"]
    assert plan.lora_kernel == "peft"  # Unsloth's own LoRA kernels, not lmstack's fused one
    assert not plan.liger and any("use_unsloth patches the same modules" in n for n in plan.notes)
    assert "Unsloth" in plan.reasons["attention"]
    spec = plan.model_spec()
    assert (spec.max_seq_length, spec.full_finetuning) == (base_cfg["cutoff_len"], False)
    # a frozen model from another path (a reference / reward model) never goes through Unsloth
    assert not plan.model_spec(path="/elsewhere").unsloth
    off = RunPlan.resolve(build_config(base_cfg), GPU_UNSLOTH)
    assert not off.unsloth and off.reasons["unsloth"] == "use_unsloth: false"


def test_unsloth_with_deepspeed_falls_back_and_says_so_once(base_cfg):
    plan = RunPlan.resolve(build_config({**base_cfg, "use_unsloth": True, "deepspeed": str(Z2)}), GPU_UNSLOTH)
    assert not plan.unsloth
    said = [n for n in plan.notes if n.startswith("use_unsloth: ignored")]
    assert len(said) == 1 and "DeepSpeed ZeRO-2" in said[0]
    assert check_rules(plan, True)[1] == []  # the fallback needs neither the package nor a refusal


@pytest.mark.parametrize(
    "over, words",
    [
        ({"stage": "dpo", "dataset": "dpo_en_demo"}, "stage dpo"),
        ({"finetuning_type": "oft"}, "finetuning_type oft"),
        ({"use_dora": True}, "use_dora"),
        ({"train_from_scratch": True}, "train_from_scratch"),
    ],
)
def test_unsloth_refuses_what_it_has_no_path_for_by_name(base_cfg, over, words):
    found = problems(base_cfg, GPU_UNSLOTH, use_unsloth=True, **over)
    assert any(words in f and "use_unsloth: true does not support" in f for f in found), found


def test_fsdp_launch_with_deepspeed_is_an_error(base_cfg):
    found = problems(base_cfg, FSDP, deepspeed=str(Z3))
    assert (
        found
        and "ds_z3_config.json was given, but accelerate launched this job with an FSDP config" in found[0]
    )


def test_fsdp_field_with_deepspeed_is_an_error(base_cfg):
    found = problems(base_cfg, deepspeed="z2", fsdp="full_shard auto_wrap")
    assert any("fsdp: 'full_shard auto_wrap' is set" in p for p in found)


def test_fsdp_launch_without_deepspeed_is_fine(base_cfg):
    assert problems(base_cfg, FSDP) == []


def test_fsdp_field_and_an_fsdp_launch_is_an_error(base_cfg):
    with pytest.raises(ConfigError, match="accelerate already launched this job with an FSDP config"):
        RunPlan.resolve(build_config({**base_cfg, "fsdp": "full_shard"}), FSDP)


def test_deepspeed_with_flash_attn_and_liger_cooperate(base_cfg):
    assert problems(base_cfg, deepspeed=str(Z3), flash_attn="sdpa", enable_liger_kernel=True) == []


def test_qlora_with_zero3_needs_bitsandbytes(base_cfg):
    found = problems(base_cfg, replace(CPU, packages=frozenset()), quantization_bit=4, deepspeed=str(Z3))
    assert any(
        "quantization_bit: 4 with ZeRO-3" in p and "pip install 'bitsandbytes>=0.43" in p for p in found
    )


def test_qlora_with_old_bitsandbytes_under_zero3(base_cfg, monkeypatch):
    ctx = replace(CPU, packages=frozenset({"bitsandbytes"}))
    monkeypatch.setattr(rules.importlib.metadata, "version", lambda name: "0.42.0")
    assert any(
        "installed: 0.42.0" in p for p in problems(base_cfg, ctx, quantization_bit=4, deepspeed=str(Z3))
    )
    monkeypatch.setattr(rules.importlib.metadata, "version", lambda name: "0.50.2")
    assert problems(base_cfg, ctx, quantization_bit=4, deepspeed=str(Z3)) == []


def test_qlora_with_zero2_has_no_extra_requirement(base_cfg):
    assert problems(base_cfg, quantization_bit=4, deepspeed=str(Z2)) == []


def test_ppo_runs_in_one_process(base_cfg):
    two = replace(CPU, world_size=2, under_launcher=True)
    found = problems(base_cfg, two, stage="ppo", reward_funcs="examples/rewards.py:length_reward")
    assert any("stage: ppo runs in one process" in p for p in found)


def test_deepspeed_package_is_a_launch_rule(base_cfg):
    ctx = replace(GPU, packages=frozenset())  # the install advice is for a machine with a CUDA GPU
    assert problems(base_cfg, ctx, deepspeed="z2") == []  # `lmstack check` on a machine without it
    assert any("pip install deepspeed" in p for p in problems(base_cfg, ctx, launch=True, deepspeed="z2"))


def test_liger_on_cpu_is_a_note_said_once(base_cfg):
    notes, found = check_rules(RunPlan.resolve(build_config({**base_cfg, "enable_liger_kernel": True}), CPU))
    assert found == [] and len(notes) == 1 and "Liger's Triton kernels need a CUDA GPU" in notes[0]


def test_ppo_builds_torchs_adamw_so_another_optim_is_refused_by_name(base_cfg):
    ppo = {"stage": "ppo", "reward_model": "r", "report_to": "none"}
    assert not [p for p in problems(base_cfg, **ppo) if p.startswith("optim:")]
    assert not [p for p in problems(base_cfg, optim="adamw_torch_fused", **ppo) if p.startswith("optim:")]
    got = [p for p in problems(base_cfg, optim="adafactor", **ppo) if p.startswith("optim:")]
    assert got == [
        "optim: adafactor is not available for stage: ppo, whose own training loop builds torch's AdamW; "
        "use optim: adamw_torch or adamw_torch_fused"
    ]
    assert not [
        p for p in problems(base_cfg, optim="adafactor") if p.startswith("optim:")
    ]  # sft: the Trainer's


@pytest.mark.parametrize("optim,fused", [("adamw_torch", None), ("adamw_torch_fused", True)])
def test_ppo_optimizer_follows_optim(base_cfg, optim, fused):
    import torch

    from lmstack.train.ppo import _optimizer

    cfg = build_config({**base_cfg, "stage": "ppo", "reward_model": "r", "optim": optim})
    optimizer, _ = _optimizer(cfg, cfg.training.optim, torch.nn.Linear(4, 4), total=10)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is fused


def test_compute_accuracy_follows_the_stage_spec(base_cfg):
    """A stage reports token accuracy only where its spec says so (StageSpec.eval_accuracy)."""
    from lmstack.config.stages import STAGE_SPECS

    def accuracy_notes(**over) -> list[str]:
        notes, found = check_rules(RunPlan.resolve(build_config({**base_cfg, **over}), CPU), False)
        assert not [p for p in found if p.startswith("compute_accuracy")], found  # a note, never a refusal
        return [n for n in notes if n.startswith("compute_accuracy")]

    for name, spec in STAGE_SPECS.items():
        found = accuracy_notes(stage=name, compute_accuracy=True)
        assert bool(found) is not spec.eval_accuracy, (name, found)
        assert not accuracy_notes(stage=name)
    assert {n for n, s in STAGE_SPECS.items() if s.eval_accuracy} == {"pt", "sft"}
