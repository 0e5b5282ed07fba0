"""Tokenizer and model loading through the real `from_pretrained` path (local dir or hub id)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config

logger = logging.getLogger(__name__)

ATTN_IMPL = {
    "disabled": "eager",
    "sdpa": "sdpa",
    "fa2": "flash_attention_2",
    "fa3": "flash_attention_3",
    "flex": "flex_attention",
}


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not os.path.isabs(name)


def check_model_path(cfg: Config) -> None:
    """Fail before anything loads: a local path must exist; a hub id must be reachable or cached."""
    name = cfg.model.model_name_or_path
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model_name_or_path: {name} has no config.json; point it at a model directory")
        check_remote_code(path, cfg.model.trust_remote_code)
        return
    if not _looks_like_hub_id(name):
        raise ConfigError(
            f"model_name_or_path: directory not found: {name}; give an existing model directory "
            "or a hub id like Qwen/Qwen2.5-0.5B-Instruct"
        )
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json", cache_dir=cfg.model.cache_dir), str):
            raise ConfigError(
                f"model_name_or_path: {name} is not in the local hub cache and HF_HUB_OFFLINE=1; "
                "download it first or give a local directory"
            )


def check_remote_code(path: Path, trust_remote_code: bool) -> None:
    config = json.loads((path / "config.json").read_text())
    if config.get("auto_map") and not trust_remote_code:
        raise ConfigError(
            f"model_name_or_path: {path} ships its own modelling code (auto_map in config.json); "
            "lmstack runs it only with `trust_remote_code: true` — set it if you trust the source"
        )


def _hub_kwargs(cfg: Config) -> dict:
    token = cfg.model.hf_hub_token.get_secret_value() if cfg.model.hf_hub_token else None
    return {
        "cache_dir": cfg.model.cache_dir,
        "revision": cfg.model.model_revision,
        "trust_remote_code": cfg.model.trust_remote_code,
        "token": token,
    }


def load_tokenizer(cfg: Config) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        cfg.model.model_name_or_path,
        use_fast=cfg.model.use_fast_tokenizer,
        split_special_tokens=cfg.model.split_special_tokens,
        padding_side="right",
        **_hub_kwargs(cfg),
    )
    return tokenizer


def attention_implementation(cfg: Config, device_type: str) -> str | None:
    """Map `flash_attn` to transformers' attn_implementation; `auto` picks the best available."""
    choice = cfg.model.flash_attn
    if choice == "auto":
        # packed rows on a GPU: flex_attention's document-causal BlockMask skips the masked blocks
        # (3.7x faster than SDPA on a packed row, REFERENCE); SDPA with a dense mask is slower than padding
        import importlib.util

        has_fa2 = device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        packed = bool(cfg.data.packing or cfg.data.neat_packing)
        if packed and device_type == "cuda" and not has_fa2:  # FA2 (varlen from position_ids) wins if present
            logger.info("flash_attn: auto -> flex_attention (packed rows: document-causal BlockMask)")
            return "flex_attention"
        chosen = "flash_attention_2" if has_fa2 else "sdpa"
        why = (
            "flash-attn is installed"
            if has_fa2
            else "flash-attn not installed"
            if device_type == "cuda"
            else "CPU"
        )
        logger.info("flash_attn: auto -> %s (%s)", chosen, why)
        return chosen
    if choice in ("fa2", "fa3"):
        import importlib.util

        package = "flash_attn" if choice == "fa2" else "flash_attn_interface"
        if device_type != "cuda" or importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"flash_attn: {choice} needs a CUDA GPU and the `{package}` package "
                f"(pip install flash-attn); use flash_attn: sdpa or auto instead"
            )
    return ATTN_IMPL[choice]


# stages whose loss needs the logits (pairwise / preference / RL): no fused linear cross-entropy
LOGIT_STAGES = ("rm", "dpo", "kto", "ppo", "grpo")


def apply_liger_kernel(cfg: Config, model: Any, device_type: str = "cuda") -> bool:
    """`enable_liger_kernel`: Liger's fused kernels for the model family; fused linear
    cross-entropy only when the stage never needs the logits. Missing package or an unsupported
    family -> a warning and training continues without it. Returns whether kernels were applied."""
    if not cfg.model.enable_liger_kernel:
        return False
    if device_type != "cuda":
        logger.warning(
            "enable_liger_kernel: Liger's Triton kernels need a CUDA GPU; this %s run continues without them",
            device_type,
        )
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        logger.warning(
            "enable_liger_kernel: the liger-kernel package is not installed (pip install liger-kernel); "
            "training continues without Liger's kernels"
        )
        return False
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        logger.warning(
            "enable_liger_kernel: Liger has no kernels for model type %r (supported: %s); "
            "training continues without them",
            model_type,
            ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)),
        )
        return False
    fused_ce = cfg.finetuning.stage not in LOGIT_STAGES  # eval (model.eval()) still returns the logits
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=fused_ce)
    logger.info(
        "enable_liger_kernel: Liger kernels applied to %s (%s)",
        model_type,
        "fused linear cross-entropy" if fused_ce else "no fused cross-entropy: this stage needs the logits",
    )
    return True


def compute_dtype(cfg: Config) -> Any:
    import torch

    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return torch.float32


def load_model(cfg: Config, tokenizer: Any, device_type: str) -> Any:
    """Weights are loaded in fp32 for mixed precision (master weights), or in the compute dtype for
    frozen LoRA bases on GPU and for pure_bf16; the Trainer's autocast does the rest."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    # `seed` covers init: random-init weights and adapter init (LoRA A) are the same in every
    # process and launch mode (one process, torchrun, accelerate), whatever ran before
    set_seed(cfg.training.seed)
    dtype = compute_dtype(cfg)
    keep_half = (
        cfg.finetuning.pure_bf16
        or cfg.finetuning.use_badam  # BAdam keeps weights in half precision, fp32 copies of one block only
        or (cfg.finetuning.finetuning_type == "lora" and device_type == "cuda")
        or cfg.training.master_weights == "optimizer"  # fp32 masters live in the optimizer instead
    )
    load_dtype = dtype if keep_half else torch.float32
    attn = attention_implementation(cfg, device_type)
    config = AutoConfig.from_pretrained(cfg.model.model_name_or_path, **_hub_kwargs(cfg))
    config.use_cache = False  # training: a KV cache object disables packed-sequence detection
    if cfg.model.train_from_scratch:
        model = AutoModelForCausalLM.from_config(config, dtype=load_dtype, attn_implementation=attn)
    else:
        from lmstack.models.quantization import quantization_config, quantized_device_map

        quant = quantization_config(cfg, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model.model_name_or_path,
            config=config,
            dtype=load_dtype,
            attn_implementation=attn,
            low_cpu_mem_usage=cfg.model.low_cpu_mem_usage,
            **({"quantization_config": quant, "device_map": quantized_device_map(cfg)} if quant else {}),
            **_hub_kwargs(cfg),
        )
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 (zero.Init) leaves an empty local shard
    if cfg.model.resize_vocab and rows < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
        logger.info("resized the vocabulary to %d", len(tokenizer))
    elif rows < len(tokenizer):
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows; "
            "set resize_vocab: true"
        )
    logger.info(
        "loaded %s (%s, attention %s)",
        cfg.model.model_name_or_path,
        str(load_dtype).replace("torch.", ""),
        model.config._attn_implementation,
    )
    apply_liger_kernel(cfg, model, device_type)
    return model
