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
    if cfg.training.gradient_checkpointing == "auto":
        cfg.training.gradient_checkpointing = resolve_checkpointing(cfg)


def resolve_checkpointing(cfg: Config) -> bool:
    import torch

    if not torch.cuda.is_available() or cfg.training.use_cpu:
        logger.info("gradient_checkpointing: auto -> false (CPU run: memory is not the limit)")
        return False
    return True


def train(config_path: str | None, overrides: list[str] | dict | None = None) -> dict:
    cfg = load_config(config_path, overrides)
    preflight(cfg)
    from lmstack.train import STAGES

    logger.info(
        "stage %s, finetuning_type %s, output_dir %s",
        cfg.finetuning.stage,
        cfg.finetuning.finetuning_type,
        cfg.training.output_dir,
    )
    return STAGES[cfg.finetuning.stage](cfg)
