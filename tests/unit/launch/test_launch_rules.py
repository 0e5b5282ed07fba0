"""Seed 003 §10.7 as executable rules: one test per row that lmstack acts on."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from lmstack.launch.rules import LaunchContext, apply_rules

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch import rules
from lmstack.launch.deepspeed import load_deepspeed_config

REPO = Path(__file__).resolve().parents[3]
Z2 = REPO / "examples/deepspeed/ds_z2_config.json"
Z3 = REPO / "examples/deepspeed/ds_z3_config.json"


def cfg(base_cfg, **over):
    return build_config({**base_cfg, **over})


def ds_ctx(path: Path, **kw) -> LaunchContext:
    return LaunchContext(deepspeed_config=load_deepspeed_config(path), **kw)


def test_deepspeed_and_unsloth_ignores_unsloth_with_one_note(base_cfg):
    c = cfg(base_cfg, use_unsloth=True, deepspeed=str(Z2))
    notes = apply_rules(c, ds_ctx(Z2))
    assert c.model.use_unsloth is False
    assert len(notes) == 1 and "use_unsloth: ignored" in notes[0] and "DeepSpeed" in notes[0]
    assert apply_rules(c, ds_ctx(Z2)) == []  # applied once: nothing more to say


def test_unsloth_on_several_processes_is_ignored(base_cfg):
    c = cfg(base_cfg, use_unsloth=True)
    notes = apply_rules(c, LaunchContext(world_size=2))
    assert c.model.use_unsloth is False and "2 processes" in notes[0]


def test_unsloth_alone_on_one_process_is_kept(base_cfg):
    c = cfg(base_cfg, use_unsloth=True)
    assert apply_rules(c, LaunchContext()) == [] and c.model.use_unsloth is True


def test_unsloth_and_liger_is_an_error(base_cfg):
    c = cfg(base_cfg, use_unsloth=True, enable_liger_kernel=True)
    with pytest.raises(ConfigError, match=r"use_unsloth and enable_liger_kernel: .*set only one"):
        apply_rules(c, LaunchContext())


def test_fsdp_launch_with_deepspeed_is_an_error(base_cfg):
    c = cfg(base_cfg, deepspeed=str(Z3))
    with pytest.raises(
        ConfigError, match=r"deepspeed: .*ds_z3_config.json.*FSDP config.*remove `deepspeed:`"
    ):
        apply_rules(c, ds_ctx(Z3, fsdp=True))


def test_fsdp_launch_without_deepspeed_is_fine(base_cfg):
    assert apply_rules(cfg(base_cfg), LaunchContext(fsdp=True)) == []


def test_deepspeed_with_flash_attn_and_liger_cooperate(base_cfg):
    c = cfg(base_cfg, deepspeed=str(Z3), flash_attn="sdpa", enable_liger_kernel=True)
    assert apply_rules(c, ds_ctx(Z3)) == []


def test_unsloth_takes_over_flash_attn(base_cfg):
    c = cfg(base_cfg, use_unsloth=True, flash_attn="fa2")
    notes = apply_rules(c, LaunchContext())
    assert notes == ["flash_attn: fa2 has no effect with use_unsloth (Unsloth picks the attention)"]


def test_qlora_with_zero3_needs_bitsandbytes(base_cfg, monkeypatch):
    monkeypatch.setattr(rules.importlib.util, "find_spec", lambda name: None)  # as if not installed
    c = cfg(base_cfg, quantization_bit=4, deepspeed=str(Z3))
    with pytest.raises(
        ConfigError, match=r"quantization_bit: 4 with ZeRO-3 .*pip install 'bitsandbytes>=0\.43"
    ):
        apply_rules(c, ds_ctx(Z3))


def test_qlora_with_old_bitsandbytes_under_zero3(base_cfg, monkeypatch):
    monkeypatch.setattr(rules.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(rules.importlib.metadata, "version", lambda name: "0.42.0")
    c = cfg(base_cfg, quantization_bit=4, deepspeed=str(Z3))
    with pytest.raises(ConfigError, match=r"installed: 0\.42\.0"):
        apply_rules(c, ds_ctx(Z3))
    monkeypatch.setattr(rules.importlib.metadata, "version", lambda name: "0.50.2")
    assert apply_rules(c, ds_ctx(Z3)) == []


def test_qlora_with_zero2_has_no_extra_requirement(base_cfg):
    c = cfg(base_cfg, quantization_bit=4, deepspeed=str(Z2))
    assert apply_rules(c, ds_ctx(Z2)) == []


def test_unsloth_warning_is_logged_once_in_a_training_run(base_cfg, monkeypatch, caplog):
    """Through train(): the fallback is logged once (rank 0), then the run stops on the missing
    deepspeed package (CPU CI) — before the model loads."""
    from lmstack.train.run import train

    monkeypatch.delenv("FORCE_TORCHRUN", raising=False)
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed installed")
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="pip install deepspeed"):
        train(None, {**base_cfg, "use_unsloth": True, "deepspeed": str(Z2)})
    assert [r.getMessage() for r in caplog.records].count(
        "use_unsloth: ignored — Unsloth runs on a single GPU only and this job uses DeepSpeed; "
        "training continues without it"
    ) == 1
