"""`lmstack train`: load + validate the config, run the pre-flight checks, dispatch the stage."""

from __future__ import annotations

import logging
from pathlib import Path

from lmstack.config.errors import ConfigError
from lmstack.config.load import load_config
from lmstack.config.schema import Config

logger = logging.getLogger(__name__)


def preflight(cfg: Config) -> None:
    """Everything that can be checked without loading the model; each error names the field and the fix."""
    from lmstack.data.registry import get_dataset_attrs
    from lmstack.models.load import check_model_path
    from lmstack.templates import get_template
    from lmstack.train import STAGES

    if cfg.finetuning.stage not in STAGES:
        raise ConfigError(
            f"stage: {cfg.finetuning.stage!r} is not implemented yet; available: {' | '.join(STAGES)}"
        )
    check_model_path(cfg)
    from lmstack.plan.auto import resolve_auto_fields

    resolve_auto_fields(cfg)  # deepspeed / per_device_train_batch_size / gradient_checkpointing: auto
    if cfg.data.template:
        get_template(cfg.data.template)
    if cfg.training.do_train and not cfg.data.dataset:
        raise ConfigError("dataset: required for training; name datasets registered in dataset_info.json")
    get_dataset_attrs(cfg.data.dataset, cfg.data.dataset_dir, "dataset")
    get_dataset_attrs(cfg.data.eval_dataset, cfg.data.dataset_dir, "eval_dataset")
    if cfg.training.deepspeed and not Path(cfg.training.deepspeed).is_file():
        raise ConfigError(
            f"deepspeed: {cfg.training.deepspeed} not found; use a JSON file such as "
            "examples/deepspeed/ds_z2_config.json"
        )
    if cfg.finetuning.finetuning_type != "lora" and cfg.model.adapter_name_or_path:
        raise ConfigError("adapter_name_or_path: adapters need finetuning_type: lora")
    from lmstack.models.quantization import check_quantization
    from lmstack.train.method_rules import check_methods

    check_methods(cfg)  # LoRA variants, GaLore/APOLLO/BAdam/Muon and how they combine
    check_quantization(cfg)  # QLoRA: GPU present, LoRA, sharding rules
    from lmstack.data.packing import check_packing_config

    check_packing_config(cfg)  # packing stage/streaming/max_tokens_per_batch rules
    from lmstack.train.rlhf import check_stage_config

    check_stage_config(cfg)  # sft-only fields elsewhere, rewards, reference models, kto/grpo batch rules
    from lmstack.train.metrics import warn_compute_accuracy

    warn_compute_accuracy(  # a warning when it has no effect: another stage, or nothing is evaluated
        cfg.finetuning.compute_accuracy,
        cfg.finetuning.stage,
        has_eval_data=bool(cfg.data.val_size or cfg.data.eval_dataset),
        evaluates=cfg.training.do_eval or cfg.training.eval_strategy != "no",
    )


def train(config_path: str | None, overrides: list[str] | dict | None = None) -> dict:
    cfg = load_config(config_path, overrides)
    preflight(cfg)
    from lmstack.launch import dist, prepare
    from lmstack.train import STAGES

    # launcher: conflict rules, DeepSpeed checks, torchrun relaunch (CLI path with > 1 GPU, or
    # FORCE_TORCHRUN=1), then the data tokenized once per node before the stage runs
    launched = prepare.relaunch_if_needed(cfg, config_path, overrides)
    if launched is not None:
        return launched
    prepare.prepare_worker(cfg)
    dist.tokenize_on_main_first(cfg)

    logger.info(
        "stage %s, finetuning_type %s, output_dir %s",
        cfg.finetuning.stage,
        cfg.finetuning.finetuning_type,
        cfg.training.output_dir,
    )
    return STAGES[cfg.finetuning.stage](cfg)
