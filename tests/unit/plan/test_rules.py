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


def test_unsloth_is_refused_with_the_reason_everywhere(base_cfg):
    for extra in ({}, {"deepspeed": str(Z2)}, {"enable_liger_kernel": True}):
        found = problems(base_cfg, use_unsloth=True, **extra)
        assert len(found) == 1 and "use_unsloth: LLaMA-Factory's Unsloth path is not available" in found[0]


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
    ctx = replace(CPU, packages=frozenset())
    assert problems(base_cfg, ctx, deepspeed="z2") == []  # `lmstack check` on a machine without it
    assert any("pip install deepspeed" in p for p in problems(base_cfg, ctx, launch=True, deepspeed="z2"))


def test_liger_on_cpu_is_a_note_said_once(base_cfg):
    notes, found = check_rules(RunPlan.resolve(build_config({**base_cfg, "enable_liger_kernel": True}), CPU))
    assert found == [] and len(notes) == 1 and "Liger's Triton kernels need a CUDA GPU" in notes[0]
