"""QLoRA: a bitsandbytes-quantized base (4 or 8 bit) under LoRA adapters.

The checks run in preflight, before data or weights load. The config object is what
`from_pretrained(quantization_config=...)` takes; bitsandbytes itself is imported only on a GPU run.
"""

from __future__ import annotations

import logging
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config

logger = logging.getLogger(__name__)


def check_quantization(cfg: Config, sharded: bool, device: str, has_bitsandbytes: bool) -> None:
    """Everything about `quantization_bit` that can fail before the model loads. `sharded`: ZeRO-3 or
    FSDP (from the run plan); `device`: the plan's device."""
    bits = cfg.model.quantization_bit
    if bits is None:
        return
    if cfg.finetuning.finetuning_type != "lora":
        raise ConfigError(
            f"quantization_bit: a {bits}-bit base cannot be trained with finetuning_type: "
            f"{cfg.finetuning.finetuning_type}; use finetuning_type: lora (QLoRA) or remove quantization_bit"
        )
    if cfg.model.train_from_scratch:
        raise ConfigError(
            f"quantization_bit: a random-init model (train_from_scratch: true) cannot be quantized to "
            f"{bits} bits while loading; remove one of them"
        )
    if cfg.finetuning.pissa_init:
        raise ConfigError(
            "pissa_init: PiSSA rewrites the base weights and cannot run on a quantized base "
            f"(quantization_bit: {bits}); remove one of them"
        )
    adapters = [a for a in (cfg.model.adapter_name_or_path or "").split(",") if a.strip()]
    if len(adapters) > 1 or (adapters and cfg.finetuning.create_new_adapter):
        raise ConfigError(
            f"adapter_name_or_path: merging adapters into a {bits}-bit base is not possible "
            f"(quantization_bit: {bits}); give one adapter to resume, without create_new_adapter, "
            "or merge them first with `lmstack export`"
        )
    if bits == 8 and sharded:
        raise ConfigError(
            "quantization_bit: 8-bit bases cannot be sharded by ZeRO-3/FSDP (deepspeed: "
            f"{cfg.training.deepspeed or 'FSDP via accelerate'}); use quantization_bit: 4 or ZeRO-2"
        )
    if device != "cuda":
        where = "use_cpu: true is set" if cfg.training.use_cpu else "no CUDA GPU is visible"
        raise ConfigError(
            f"quantization_bit: got {bits}, but {where}; bitsandbytes QLoRA needs a CUDA GPU. "
            "Remove quantization_bit to train LoRA on an unquantized base, or run on a GPU machine"
        )
    if not has_bitsandbytes:
        raise ConfigError(
            f"quantization_bit: {bits} needs the bitsandbytes package; pip install bitsandbytes"
        )
    if not (cfg.training.bf16 or cfg.training.fp16):
        logger.warning(
            "quantization_bit: %s without bf16/fp16: the dequantized matmuls run in float32 "
            "(slow, more memory); set bf16: true",
            bits,
        )


def quantization_config(cfg: Config, compute_dtype: Any) -> Any:
    """BitsAndBytesConfig for `quantization_bit`, or None. 4-bit stores its packed weights in the compute
    dtype, so ZeRO-3 and FSDP can shard them together with the bf16/fp16 parameters."""
    bits = cfg.model.quantization_bit
    if bits is None:
        return None
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.model.quantization_type,
        bnb_4bit_use_double_quant=cfg.model.double_quantization,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=compute_dtype,
    )


def quantized_device_map(bits: int | None, sharded: bool, local_rank: int) -> dict | None:
    """bitsandbytes quantizes while loading, on the device each weight is placed on: this process's GPU.
    Under ZeRO-3 / FSDP (`sharded`) the sharding engine places the weights, so no map is given."""
    if bits is None or sharded:
        return None
    return {"": local_rank}


def describe(cfg: Config) -> str:
    bits = cfg.model.quantization_bit
    if bits == 4:
        dq = ", double quant" if cfg.model.double_quantization else ""
        return f"4-bit {cfg.model.quantization_type}{dq}"
    return f"{bits}-bit" if bits else "none"
