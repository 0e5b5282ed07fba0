"""The planner on a vision-language model says what it does not model: a training vision tower's
activations (a frozen tower keeps none for backward)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmstack.config.load import build_config
from lmstack.memory import plan
from lmstack.plan.from_config import request_from_plan
from lmstack.plan.whatif import plan_for

DATA = Path(__file__).resolve().parents[3] / "data"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    from lmstack.tiny import build_tiny_vision_model

    return build_tiny_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl", "qwen2_vl", data_dir=DATA)


def notes_for(vlm, **over) -> list[str]:
    cfg = build_config({"model_name_or_path": str(vlm), "template": "qwen2_vl", "dataset": "mllm_demo",
                        "dataset_dir": str(DATA), "output_dir": "o", "finetuning_type": "full", **over})  # fmt: skip
    return plan(request_from_plan(plan_for(cfg, 1, 80.0), 1, 80.0)).notes


def test_a_training_vision_tower_is_named_as_not_modelled(vlm):
    said = [n for n in notes_for(vlm, freeze_vision_tower=False) if "vision tower's saved activations" in n]
    assert len(said) == 1 and "freeze_vision_tower: false" in said[0]


def test_a_frozen_tower_needs_no_such_note(vlm):
    assert not [n for n in notes_for(vlm) if "vision tower" in n]


def test_use_unsloth_on_a_vision_model_is_refused_by_name(vlm):
    from dataclasses import replace

    from lmstack.launch.context import LaunchContext
    from lmstack.plan.rules import check_rules
    from lmstack.plan.runplan import RunPlan

    ctx = replace(LaunchContext(), cuda=True, gpu_count=1, gpu_memory_gib=80.0, bf16_supported=True,
                  packages=frozenset({"unsloth"}))  # fmt: skip
    cfg = build_config({"model_name_or_path": str(vlm), "template": "qwen2_vl", "dataset": "alpaca_en_demo",
                        "dataset_dir": str(DATA), "output_dir": "o", "use_unsloth": True})  # fmt: skip
    problems = check_rules(RunPlan.resolve(cfg, ctx), True)[1]
    assert any("use_unsloth: true does not support a vision-language model" in p for p in problems), problems
