"""load_best_model_at_end / early_stopping_steps combinations that cannot work are refused before the
model loads (train/preflight.py), naming the fields; LF's fields are accepted with LF's defaults."""

from __future__ import annotations

import logging

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan
from lmstack.train import best_model
from lmstack.train.common import training_arguments

BASE = {"model_name_or_path": "m", "output_dir": "o", "dataset": "d"}
GOOD = {
    **BASE,
    "val_size": 0.1,
    "eval_strategy": "steps",
    "eval_steps": 5,
    "save_steps": 10,
    "load_best_model_at_end": True,
}


def test_lf_defaults_and_a_working_combination_pass(tiny_model):
    best_model.check(build_config(BASE))
    cfg = build_config({**GOOD, "early_stopping_steps": 3, "metric_for_best_model": "loss"})
    best_model.check(cfg)
    assert [type(c).__name__ for c in best_model.callbacks(cfg)] == ["EarlyStoppingCallback"]
    assert best_model.callbacks(cfg)[0].early_stopping_patience == 3
    cfg = build_config({**GOOD, "model_name_or_path": str(tiny_model), "greater_is_better": False})
    args = training_arguments(RunPlan.resolve(cfg, LaunchContext.from_env()))
    assert args.load_best_model_at_end and args.metric_for_best_model == "loss" and not args.greater_is_better


@pytest.mark.parametrize(
    "fields,message",
    [
        ({**BASE, "early_stopping_steps": 2}, r"early_stopping_steps: 2 stops on metric_for_best_model.*add "
         r"load_best_model_at_end: true"),
        ({**GOOD, "val_size": 0.0}, r"load_best_model_at_end: needs evaluation data .* set val_size"),
        ({**GOOD, "eval_strategy": "no"}, r"load_best_model_at_end: needs evaluations during training; set "
         r"eval_strategy: steps"),
        ({**GOOD, "save_strategy": "epoch"}, r"save_strategy: epoch and eval_strategy: steps must be the same"),
        ({**GOOD, "save_steps": 12}, r"save_steps: 12 must be a multiple of eval_steps: 5.*e\.g\. save_steps: 10"),
        ({**GOOD, "stage": "rm"}, r"load_best_model_at_end: not available for stage rm"),
        ({**GOOD, "stage": "ppo"}, r"load_best_model_at_end: not available for stage ppo"),
    ],
)  # fmt: skip
def test_combinations_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        best_model.check(build_config(fields))


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        best_model.check(build_config({**BASE, "load_best_model_at_end": True, "save_steps": 7}))
    assert "needs evaluation data" in str(err.value) and "needs evaluations during training" in str(err.value)


def test_metric_without_best_model_warns_it_has_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="lmstack.train.best_model"):
        best_model.check(build_config({**BASE, "metric_for_best_model": "accuracy"}))
    assert "metric_for_best_model: has no effect without load_best_model_at_end: true" in caplog.text


def test_preflight_runs_the_rules(tiny_model):
    from lmstack.train import preflight

    cfg = build_config({**BASE, "model_name_or_path": str(tiny_model), "early_stopping_steps": 2})
    with pytest.raises(ConfigError, match="early_stopping_steps: 2"):
        preflight.check(RunPlan.resolve(cfg, LaunchContext.from_env()), launch=False)
