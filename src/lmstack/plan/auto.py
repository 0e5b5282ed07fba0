"""`auto` values in a training YAML, resolved by the planner before anything loads.

Fields: `deepspeed: auto` (none, or the ZeRO template that fits), `per_device_train_batch_size: auto`
(the largest micro-batch that fits) and `gradient_checkpointing: auto` (recompute only when memory
requires it). On a GPU machine the planner decides from the model's config.json and the GPU's
memory; on CPU there is no device memory to size against, so the choice is plain and logged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config

logger = logging.getLogger(__name__)
AUTO_FIELDS = ("deepspeed", "per_device_train_batch_size", "gradient_checkpointing")
CPU_CHOICE = {"deepspeed": None, "per_device_train_batch_size": 1, "gradient_checkpointing": False}


def auto_fields(cfg: Config) -> list[str]:
    return [name for name in AUTO_FIELDS if getattr(cfg.training, name) == "auto"]


def find_template(name: str) -> str:
    """The file of the DeepSpeed template the planner chose (a shipped name such as z3_offload)."""
    from lmstack.launch.deepspeed import resolve_deepspeed_ref

    return str(resolve_deepspeed_ref(name, field="deepspeed: auto"))


def _gpu_memory(cfg: Config) -> float | None:
    import torch

    if cfg.training.use_cpu or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def plan_decision(cfg: Config, gpu_memory_gib: float) -> dict:
    """The planner's values for the auto fields of `cfg` (plus `fits` and a log `message`)."""
    import torch

    from lmstack.data.packing import packing_enabled, row_capacity
    from lmstack.plan import resolve_auto
    from lmstack.plan.from_config import request_from_config

    gpus = int(os.environ.get("WORLD_SIZE") or max(torch.cuda.device_count(), 1))
    req = request_from_config(cfg, gpus=gpus, gpu_memory_gib=gpu_memory_gib)
    # sft/pt train through a fused linear CE (models/kernels.py); packed rows hold row_capacity tokens
    fused = cfg.finetuning.stage in ("sft", "pt") or bool(req.fused_ce)
    seq = req.seq_len
    if packing_enabled(cfg) and cfg.training.per_device_train_batch_size != "auto":
        seq = row_capacity(cfg)
    return resolve_auto(replace(req, fused_ce=fused, seq_len=seq))


def resolve_auto_fields(cfg: Config, gpu_memory_gib: float | None = None) -> dict:
    """Replace every `auto` in cfg.training with a concrete value; returns {field: value} and logs it."""
    fields = auto_fields(cfg)
    if not fields:
        return {}
    if cfg.training.per_device_train_batch_size == "auto" and cfg.training.max_tokens_per_batch:
        raise ConfigError(
            "per_device_train_batch_size: auto cannot be combined with max_tokens_per_batch (the "
            "token budget already sets the rows); set one of them"
        )
    memory = gpu_memory_gib if gpu_memory_gib is not None else _gpu_memory(cfg)
    if memory is None:
        chosen = {name: CPU_CHOICE[name] for name in fields}
        logger.info(
            "auto on CPU (no GPU memory to size against): %s",
            ", ".join(f"{k} -> {v}" for k, v in chosen.items()),
        )
    else:
        try:
            decision = plan_decision(cfg, memory)
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(
                f"{fields[0]}: auto needs a memory estimate, and none could be made for "
                f"{cfg.model.model_name_or_path} ({err}); set the value yourself"
            ) from None
        chosen = {name: decision.get(name, CPU_CHOICE[name]) for name in fields}
        if chosen.get("deepspeed"):
            chosen["deepspeed"] = find_template(chosen["deepspeed"])
        logger.log(logging.INFO if decision["fits"] else logging.WARNING, "%s", decision["message"])
    for name, value in chosen.items():
        setattr(cfg.training, name, value)
    return chosen
