"""Bridge from a training `Config` to a `PlanRequest` (reads config.json only, never weights)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.launch.fsdp import fsdp_requested
from lmstack.plan.model_spec import ModelSpec
from lmstack.plan.recommend import PlanRequest

ATTENTION = {
    "auto": "sdpa",
    "sdpa": "sdpa",
    "disabled": "eager",
    "fa2": "flash",
    "fa3": "flash",
    "flex": "flash",
}


def deepspeed_settings(path: str | None) -> dict:
    """Stage and offload flags of a DeepSpeed JSON (`auto` = let the planner choose)."""
    if path is None:
        return {"deepspeed_stage": None}
    if path == "auto":
        return {"deepspeed_stage": "auto"}
    try:
        ds = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"deepspeed: cannot read {path}: {err}") from None
    zero = ds.get("zero_optimization", {})
    off = lambda key: (zero.get(key) or {}).get("device", "none") not in ("none", None)  # noqa: E731
    return {
        "deepspeed_stage": int(zero.get("stage", 0)),
        "offload_optimizer": off("offload_optimizer"),
        "offload_param": off("offload_param"),
    }


def _attention(cfg: Config) -> str:
    """`auto` on packed rows trains with flex_attention (or FA2) on a GPU: no T x T score matrix."""
    if cfg.model.flash_attn == "auto" and (cfg.data.packing or cfg.data.neat_packing):
        return "flash"
    return ATTENTION[cfg.model.flash_attn]


FSDP_STRATEGY_IDS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP"}  # accelerate's older numeric form


def fsdp_settings(env: Mapping[str, str] | None = None) -> dict:
    """FSDP comes from the accelerate launcher (its config exported as environment variables)."""
    env = os.environ if env is None else env
    if not fsdp_requested(env):
        return {"fsdp": False}
    raw = str(env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")).strip().upper()
    sharding = FSDP_STRATEGY_IDS.get(raw, raw)
    return {
        "fsdp": True,
        "fsdp_sharding": sharding if sharding in ("FULL_SHARD", "SHARD_GRAD_OP") else "FULL_SHARD",
    }


def _fused_ce(cfg: Config, ds: dict) -> bool:
    """Liger's fused linear CE, or lmstack's chunked one, which sft/pt use unless ZeRO-3 partitions
    the output head (models/kernels.py)."""
    return cfg.model.enable_liger_kernel or (
        cfg.finetuning.stage in ("sft", "pt") and ds["deepspeed_stage"] != 3
    )


def _fp32_model_weights(cfg: Config, ds: dict) -> bool:
    """Classic AMP keeps fp32 weights in the model; lmstack's default on a GPU is bf16 weights with
    the fp32 masters in the optimizer (train/master_weights.py), as DeepSpeed and FSDP do."""
    from lmstack.train.master_weights import master_weights_mode

    if cfg.finetuning.finetuning_type == "lora" or ds["deepspeed_stage"] not in (None, 0) or fsdp_requested():
        return False
    if cfg.finetuning.pure_bf16 or not (cfg.training.bf16 or cfg.training.fp16):
        return False
    return master_weights_mode(cfg, "cuda") == "model"  # the planner plans for a GPU


def _optimizer(cfg: Config) -> str:
    """use_galore | use_apollo | use_badam | use_muon (or optim: muon) -> the planner's optimizer name."""
    for name in ("galore", "apollo", "badam", "muon"):
        if getattr(cfg.finetuning, f"use_{name}"):
            return name
    return "muon" if cfg.training.optim == "muon" else "adamw"


def request_from_config(
    cfg: Config,
    gpus: int,
    gpu_memory_gib: float,
    nodes: int = 1,
    cpu_memory_gib: float | None = None,
    search: bool = False,
) -> PlanRequest:
    spec = ModelSpec.from_pretrained_dir(cfg.model.model_name_or_path)
    gc = cfg.training.gradient_checkpointing
    ds = deepspeed_settings(cfg.training.deepspeed)
    return PlanRequest(
        spec=spec,
        finetuning_type=cfg.finetuning.finetuning_type,
        lora_rank=cfg.finetuning.lora_rank,
        lora_target=cfg.finetuning.lora_target,
        quantization_bit=cfg.model.quantization_bit,
        seq_len=cfg.data.cutoff_len,
        micro_batch=None
        if (search or cfg.training.per_device_train_batch_size == "auto")
        else cfg.training.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.training.gradient_accumulation_steps,
        gradient_checkpointing=None if (search or gc == "auto") else bool(gc),
        attention=_attention(cfg),
        packing=bool(cfg.data.packing or cfg.data.neat_packing),
        fused_ce=_fused_ce(cfg, ds),
        liger=cfg.model.enable_liger_kernel,
        fp32_model_weights=_fp32_model_weights(cfg, ds),
        fp32_adapters=cfg.finetuning.finetuning_type == "lora" and not cfg.training.bf16,
        num_gpus=gpus * nodes,
        gpu_memory_gib=gpu_memory_gib,
        nodes=nodes,
        cpu_memory_gib=cpu_memory_gib,
        pure_bf16=cfg.finetuning.pure_bf16,
        freeze_trainable_layers=cfg.finetuning.freeze_trainable_layers,
        optimizer=_optimizer(cfg),
        optimizer_rank=cfg.finetuning.apollo_rank
        if cfg.finetuning.use_apollo
        else cfg.finetuning.galore_rank,
        **ds,
        **fsdp_settings(),
    )
