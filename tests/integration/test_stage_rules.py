"""The stage/field conflict rules of the training stages (refused before the model loads, naming the
field) and the example YAMLs of every stage. The stage runs themselves: test_stages.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError, DataError
from lmstack.config.load import build_config, load_config
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cfg(base_cfg) -> dict:
    return {**base_cfg, "cutoff_len": 64, "logging_steps": 1, "save_steps": 100, "lora_rank": 8}


# ---- conflicts, before anything loads -----------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"stage": "dpo", "dataset": "dpo_en_demo", "train_on_prompt": True}, "train_on_prompt"),
        ({"stage": "rm", "dataset": "dpo_en_demo", "mask_history": True}, "mask_history"),
        ({"stage": "kto", "dataset": "kto_en_demo", "neat_packing": True}, "neat_packing"),
        ({"stage": "ppo"}, "reward_model: stage ppo needs a reward"),
        ({"stage": "ppo", "reward_model": "/nonexistent/rm"}, "reward_model: directory not found"),
        ({"stage": "grpo", "reward_funcs": "no_such_module:f"}, "reward_funcs: cannot import"),
        ({"stage": "grpo", "reward_funcs": "examples/rewards.py:nope"}, "has no function 'nope'"),
        (
            {"stage": "grpo", "reward_funcs": "examples/rewards.py:polite", "num_generations": 3},
            "num_generations: 3 must divide",
        ),
        ({"stage": "kto", "dataset": "alpaca_en_demo"}, "has no kto_tag column"),
        (
            {"stage": "dpo", "dataset": "dpo_en_demo", "pref_loss": "hinge", "dpo_label_smoothing": 0.1},
            "dpo_label_smoothing",
        ),
        ({"stage": "dpo", "dataset": "dpo_en_demo", "ref_model_adapters": "x"}, "ref_model_adapters"),
        (
            {
                "stage": "ppo",
                "reward_funcs": "examples/rewards.py:polite",
                "deepspeed": "examples/deepspeed/ds_z2_config.json",
            },
            "stage: ppo runs in one process",
        ),
    ],
)
def test_conflicts_fail_before_the_model_loads(cfg, extra, message, monkeypatch):
    import lmstack.models.load as load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=message):
        train(None, {**cfg, **extra})


@pytest.mark.parametrize(
    ("stage", "dataset"), [("sft", "dpo_en_demo"), ("dpo", "alpaca_en_demo"), ("rm", "kto_en_demo")]
)
def test_ranking_data_only_in_pairwise_stages(cfg, stage, dataset):
    with pytest.raises(DataError, match="ranking"):
        train(None, {**cfg, "stage": stage, "dataset": dataset})


def test_ref_model_with_orpo_warns_no_effect(cfg, caplog, tiny_model):
    from lmstack.train.rlhf import check_stage_config

    c = build_config({**cfg, "stage": "dpo", "pref_loss": "orpo", "ref_model": str(tiny_model)})
    with caplog.at_level(logging.WARNING):
        check_stage_config(c)
    assert any("ref_model: has no effect with pref_loss: orpo" in r.message for r in caplog.records)


# ---- examples -----------------------------------------------------------------------------------
STAGE_EXAMPLES = sorted((REPO / "examples").glob("tiny_*.yaml"))


def test_every_stage_has_an_example():
    stages = {load_config(p).finetuning.stage for p in STAGE_EXAMPLES}
    assert stages >= {"pt", "rm", "dpo", "kto", "ppo", "grpo"}


@pytest.mark.parametrize("path", STAGE_EXAMPLES, ids=lambda p: p.name)
def test_stage_examples_validate(path, monkeypatch):
    from lmstack.train.rlhf import reward_functions

    cfg = load_config(path)
    assert cfg.model.model_name_or_path == ".tiny/qwen2"
    assert cfg.training.output_dir.startswith("saves/")
    monkeypatch.chdir(REPO)  # reward_funcs paths in the examples are relative to the repo root
    assert all(callable(f) for f in reward_functions(cfg))
