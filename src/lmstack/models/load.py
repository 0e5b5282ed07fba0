"""Tokenizer and model loading through the real `from_pretrained` path (local dir or hub id)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError, did_you_mean
from lmstack.config.schema import Config
from lmstack.memory import model_facts

logger = logging.getLogger(__name__)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not os.path.isabs(name)


def check_model_path(cfg: Config, tokenizer: bool = True, model_type: bool = True) -> None:
    """Fail before anything loads: a local path must exist; a hub id must be reachable or cached.
    `tokenizer`: the run reads the tokenizer (train, check, chat, a plan that reads the data); a plan
    from config.json alone (`lmstack plan --no-data`) needs none. `model_type`: the model_type is one the
    installed transformers knows (reading its table imports transformers and torch, which `plan` avoids)."""
    name = cfg.model.model_name_or_path
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model_name_or_path: {name} has no config.json; point it at a model directory")
        check_remote_code(path, cfg.model.trust_remote_code, model_type)
        if tokenizer:
            check_tokenizer_files(path)
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


# Any one of these lets AutoTokenizer build the model's own tokenizer. Without them transformers still
# "succeeds" with a near-empty tokenizer, so every row encodes to a few tokens and training looks fine.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "vocab.txt",
    "tekken.json",
)


def check_tokenizer_files(path: Path) -> None:
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model_name_or_path: {path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer files (tokenizer.json, tokenizer_config.json, ...) from the original model "
            "into it, or point model_name_or_path at the full model directory"
        )


def check_remote_code(path: Path, trust_remote_code: bool, model_type: bool = True) -> None:
    config = model_facts.config_json(path)
    if config is None:
        raise ConfigError(
            f"model_name_or_path: {path / 'config.json'} is not a JSON object; re-download or fix it"
        )
    if config.get("auto_map") and not trust_remote_code:
        raise ConfigError(
            f"model_name_or_path: {path} ships its own modelling code (auto_map in config.json); "
            "lmstack runs it only with `trust_remote_code: true` — set it if you trust the source"
        )
    if model_type:
        _check_model_type(path, config)


def _check_model_type(path: Path, config: dict) -> None:
    """A model_type this transformers does not know, and no modelling code of the folder's own."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    kind = config.get("model_type")
    if isinstance(kind, str) and kind not in CONFIG_MAPPING_NAMES and not config.get("auto_map"):
        import transformers

        raise ConfigError(
            f"model_name_or_path: {path / 'config.json'} has model_type {kind!r}, which transformers "
            f"{transformers.__version__} does not know{did_you_mean(kind, CONFIG_MAPPING_NAMES)}, and no "
            "auto_map (modelling code of its own); fix model_type, or upgrade transformers if the "
            "architecture is newer than this version"
        )


def hub_kwargs(cfg: Config) -> dict:
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
        **hub_kwargs(cfg),
    )
    return tokenizer


@dataclass(frozen=True)
class ModelLoadSpec:
    """What `load_model` needs, already decided by the run plan (RunPlan.model_spec)."""

    path: str
    hub: dict  # cache_dir, revision, trust_remote_code, token
    load_dtype: str  # bf16 | fp16 | fp32: the weights' dtype after loading
    compute_dtype: str  # bf16 | fp16 | fp32: quantized matmuls compute in it
    attention: str  # transformers' attn_implementation
    liger: bool  # apply Liger's kernels
    liger_fused_ce: bool  # ... including its fused linear cross-entropy
    quantization: Any = None  # BitsAndBytesConfig or None
    device_map: dict | None = None
    train_from_scratch: bool = False
    low_cpu_mem_usage: bool = True
    resize_vocab: bool = False
    upcast_layernorm: bool = False  # norm weights kept in fp32 (LF: for quantized / half-precision bases)
    seed: int = 42
    unsloth: bool = False  # load through Unsloth's FastLanguageModel (the plan's use_unsloth decision)
    max_seq_length: int = 2048  # Unsloth's max_seq_length (cutoff_len)
    full_finetuning: bool = False  # Unsloth's full_finetuning
    checkpointing: bool = False  # the plan's checkpointing (Unsloth applies its own at load)
    quantization_bit: int | None = None  # Unsloth's load_in_4bit / load_in_8bit
    device_index: int = 0  # Unsloth's device_map {"": device_index}


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name])


def apply_liger_kernel(model: Any, fused_ce: bool) -> None:
    """Liger's fused kernels for the model family (the run plan checked the package and the family);
    fused linear cross-entropy only when the stage never needs the logits."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=fused_ce)
    logger.info(
        "enable_liger_kernel: Liger kernels applied to %s (%s)",
        model.config.model_type,
        "fused linear cross-entropy" if fused_ce else "no fused cross-entropy: this stage needs the logits",
    )


def load_model(spec: ModelLoadSpec, tokenizer: Any) -> Any:
    """The causal LM through the real from_pretrained path, in the dtype, attention kernel and
    quantization the run plan chose; the Trainer's autocast (if any) does the rest."""
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    from lmstack.models.vision import load_vision_model, vision_model_type

    if vision_model_type(spec.path):  # Qwen2-VL / LLaVA: the image-text-to-text class
        return load_vision_model(spec, tokenizer)
    # `seed` covers init: random-init weights and adapter init (LoRA A) are the same in every
    # process and launch mode (one process, torchrun, accelerate), whatever ran before
    set_seed(spec.seed)
    dtype = torch_dtype(spec.load_dtype)
    config = AutoConfig.from_pretrained(spec.path, **spec.hub)
    config.use_cache = False  # training: a KV cache object disables packed-sequence detection
    if spec.unsloth:
        from lmstack.models import unsloth_model

        model = unsloth_model.load(spec, torch_dtype(spec.compute_dtype))
        if model is not None:
            return model
        spec = replace(spec, unsloth=False)
    if spec.train_from_scratch:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=spec.attention)
    else:
        quant = (
            {"quantization_config": spec.quantization, "device_map": spec.device_map}
            if spec.quantization
            else {}
        )
        model = AutoModelForCausalLM.from_pretrained(
            spec.path,
            config=config,
            dtype=dtype,
            attn_implementation=spec.attention,
            low_cpu_mem_usage=spec.low_cpu_mem_usage,
            **quant,
            **spec.hub,
        )
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 (zero.Init) leaves an empty local shard
    if spec.resize_vocab and rows < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
        logger.info("resized the vocabulary to %d", len(tokenizer))
    elif rows < len(tokenizer):
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows; set "
            "resize_vocab: true to train embeddings for the tokens the template added (they start random)"
        )
    logger.info(
        "loaded %s (%s, attention %s)", spec.path, DTYPES[spec.load_dtype], model.config._attn_implementation
    )
    if spec.liger:
        apply_liger_kernel(model, spec.liger_fused_ce)
    if spec.upcast_layernorm:
        logger.info("upcast_layernorm: %d norm weights kept in float32", upcast_norms(model))
    return model


@dataclass(frozen=True)
class SpeedupSpec:
    """What `apply_speedups` does once the adapters are on, decided by the run plan (plan.fp8, plan.compile)."""

    fp8_scope: str | None = None  # frozen-base | float8-training | None (no FP8)
    fp8_recipe: str = "rowwise"
    fp8_all_gather: bool = False
    device: str | None = None  # cuda:N: frozen FP8 weights are made there
    compile_backend: str | None = None  # None: not compiled
    compile_dynamic: bool | None = None
    compile_fullgraph: bool = False


def apply_speedups(spec: SpeedupSpec, model: Any) -> Any:
    """FP8 GEMMs (models/fp8.py), then regional torch.compile (models/compile.py): after the adapters
    (the FP8 base replaces PEFT's frozen base layers) and after checkpointing is switched on."""
    if spec.fp8_scope:
        from lmstack.models.fp8 import apply_fp8

        apply_fp8(model, spec.fp8_scope, spec.fp8_recipe, spec.fp8_all_gather, spec.device)
    if spec.compile_backend:
        from lmstack.models.compile import compile_regions

        compile_regions(model, spec.compile_backend, spec.compile_dynamic, spec.compile_fullgraph)
    return model


def upcast_norms(model: Any) -> int:
    """Norm layers' weights (and biases) to float32; returns how many tensors were cast."""
    import torch

    count = 0
    for module in model.modules():
        if "norm" not in type(module).__name__.lower():
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
                count += 1
    return count
