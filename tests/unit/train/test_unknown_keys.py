"""A key lmstack passes to TrainingArguments or a TRL config that the installed class lacks is refused,
naming the key and the installed version; it is never dropped (the run would miss the setting)."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from lmstack.config.errors import ConfigError, LmstackError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan
from lmstack.train import common, rlhf


def _plan(tiny_model, **fields):
    cfg = build_config({"model_name_or_path": str(tiny_model), "output_dir": "o", "dataset": "d", **fields})
    return RunPlan.resolve(cfg, LaunchContext.from_env())


def test_training_arguments_refuse_an_unknown_key():
    from transformers import TrainingArguments

    with pytest.raises(
        ConfigError,
        match=rf"TrainingArguments of transformers {version('transformers')} "
        r"has no field no_such_field\b",
    ):
        common.checked_init(TrainingArguments, {"output_dir": "o", "no_such_field": 1})
    assert common.checked_init(TrainingArguments, {"output_dir": "o", "seed": 7}).seed == 7


def test_training_arguments_of_a_plan_pass_every_key(tiny_model):
    args = common.training_arguments(_plan(tiny_model, seed=11))
    assert args.seed == 11 and args.data_seed == 11


def test_trl_config_refuses_an_unknown_key(tiny_model):
    from trl import DPOConfig

    plan = _plan(tiny_model, stage="dpo")
    with pytest.raises(
        LmstackError, match=rf"DPOConfig of trl {version('trl')} has no field no_such_field\b"
    ):
        rlhf.trl_config(plan, DPOConfig, beta=0.2, no_such_field=1)
    assert rlhf.trl_config(plan, DPOConfig, beta=0.2).beta == 0.2


def test_grpo_config_is_not_given_rloo_only_keys(tiny_model):
    from trl import GRPOConfig

    # normalize_advantages is RLOOConfig's only: passing it to GRPOConfig is refused, so grpo leaves it out
    with pytest.raises(LmstackError, match="normalize_advantages"):
        rlhf.trl_config(_plan(tiny_model, stage="grpo"), GRPOConfig, normalize_advantages=True)


def test_continuous_batching_refuses_a_setting_the_installed_engine_lacks():
    from lmstack.train import rollout_engine

    with pytest.raises(
        ConfigError, match=r"rollout_engine: continuous_batching: .* no setting no_such_setting\b"
    ):
        rollout_engine._known_fields({"page_size": 256, "no_such_setting": 1})
    kept = rollout_engine._known_fields({"page_size": 256, "num_blocks": 3})
    assert kept.get("page_size", kept.get("block_size")) == 256 and kept["num_blocks"] == 3
