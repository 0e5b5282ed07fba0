"""The best checkpoint and early stopping, LLaMA-Factory's fields on transformers' machinery:
`load_best_model_at_end` + `metric_for_best_model` + `greater_is_better` (TrainingArguments) pick the
best evaluated checkpoint, which rotation by `save_total_limit` never deletes and which is loaded at
the end; `early_stopping_steps` (LF's patience, in evaluation rounds without improvement) adds
transformers' EarlyStoppingCallback. Every combination that cannot work is refused before the model
loads (`check`), naming the fields."""

from __future__ import annotations

import logging

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.config.stages import stage_spec

logger = logging.getLogger(__name__)


def check(cfg: Config) -> None:
    """Refuse what transformers would refuse after the model loaded (or silently not do)."""
    t, d = cfg.training, cfg.data
    problems: list[str] = []
    if t.early_stopping_steps is not None and not t.load_best_model_at_end:
        problems.append(
            f"early_stopping_steps: {t.early_stopping_steps} stops on metric_for_best_model, which is tracked "
            "with load_best_model_at_end: add load_best_model_at_end: true (with eval_strategy and "
            "save_strategy: steps, and val_size or eval_dataset)"
        )
    if not t.load_best_model_at_end:
        _warn_no_effect(cfg)
        if problems:
            raise ConfigError("\n".join(problems))
        return
    spec = stage_spec(cfg.finetuning.stage)
    if not spec.trainer or spec.value_head:
        problems.append(
            f"load_best_model_at_end: not available for stage {spec.name} (LLaMA-Factory refuses it for rm and "
            "ppo too: the value head is saved apart from the model); remove it"
        )
    if not (d.eval_dataset or d.val_size > 0):
        problems.append(
            "load_best_model_at_end: needs evaluation data to pick the best checkpoint; set val_size (e.g. 0.1) "
            "or eval_dataset"
        )
    if t.eval_strategy == "no":
        problems.append(
            "load_best_model_at_end: needs evaluations during training; set eval_strategy: steps (with "
            "eval_steps) or epoch"
        )
    elif t.save_strategy != t.eval_strategy:
        problems.append(
            f"load_best_model_at_end: save_strategy: {t.save_strategy} and eval_strategy: {t.eval_strategy} "
            "must be the same, so every evaluated step has a checkpoint to load"
        )
    elif t.eval_strategy == "steps":
        every = t.eval_steps or t.logging_steps  # transformers: eval_steps defaults to logging_steps
        if t.save_steps % every:
            problems.append(
                f"load_best_model_at_end: save_steps: {t.save_steps} must be a multiple of eval_steps: {every}"
                f"{'' if t.eval_steps else ' (eval_steps unset: logging_steps)'}, so the best step has a "
                f"checkpoint; e.g. save_steps: {every * max(1, t.save_steps // every)}"
            )
    if problems:
        raise ConfigError("\n".join(problems))


def _warn_no_effect(cfg: Config) -> None:
    t = cfg.training
    if t.lr_scheduler_type == "reduce_lr_on_plateau":  # the plateau schedule reads metric_for_best_model
        return
    for name in ("metric_for_best_model", "greater_is_better"):
        if getattr(t, name) is not None:
            logger.warning("%s: has no effect without load_best_model_at_end: true", name)


def callbacks(cfg: Config) -> list:
    """transformers' EarlyStoppingCallback with LF's patience, when early_stopping_steps is set."""
    if cfg.training.early_stopping_steps is None:
        return []
    from transformers import EarlyStoppingCallback

    return [EarlyStoppingCallback(early_stopping_patience=cfg.training.early_stopping_steps)]
