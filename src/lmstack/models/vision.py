"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense and MoE, LLaVA, Gemma 3, InternVL) and Qwen2-Audio: loaded
through AutoModelForImageTextToText (Qwen2-Audio: its own class),
and which of their modules are the vision tower, the projector and the language model (LLaMA-Factory's
composite-model table), so that `freeze_vision_tower` / `freeze_multi_modal_projector` /
`freeze_language_model` freeze them under full and freeze fine-tuning and keep them out of LoRA's
targets (LF's defaults: vision tower and projector frozen, LoRA on the language model only)."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.memory import model_facts

logger = logging.getLogger(__name__)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # as models/load.py (which imports this)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


@dataclass(frozen=True)
class Parts:
    vision: tuple[str, ...]  # module-name pieces of the vision tower
    projector: tuple[str, ...]
    language: tuple[str, ...]
    lora_conflict: tuple[str, ...] = ()  # never a LoRA target (a Conv3d patch embedding)


QWEN2_VL = Parts(
    ("visual.patch_embed", "visual.blocks"),
    ("visual.merger",),
    ("language_model", "lm_head"),
    ("patch_embed",),
)
# LF's Qwen3-VL entry: the learned position embedding and the DeepStack mergers (features of inner
# vision blocks fed to the first decoder layers) belong to the vision tower; the projector is the
# final patch merger only
QWEN3_VL = Parts(
    ("visual.pos_embed", "visual.patch_embed", "visual.blocks", "visual.deepstack_merger_list"),
    ("visual.merger",),
    ("language_model", "lm_head"),
    ("patch_embed",),
)
COMPOSITE = {
    "qwen2_vl": QWEN2_VL,
    "qwen2_5_vl": QWEN2_VL,
    "qwen3_vl": QWEN3_VL,
    "qwen3_vl_moe": QWEN3_VL,
    "llava": Parts(("vision_tower",), ("multi_modal_projector",), ("language_model", "lm_head")),
    # LF's defaults of its composite table (vision_tower / multi_modal_projector / language_model)
    "gemma3": Parts(("vision_tower",), ("multi_modal_projector",), ("language_model", "lm_head")),
    "internvl": Parts(("vision_tower",), ("multi_modal_projector",), ("language_model", "lm_head")),
    # the audio encoder counts as the "vision tower" of LF's freeze_vision_tower (LF's composite table too)
    "qwen2_audio": Parts(("audio_tower",), ("multi_modal_projector",), ("language_model", "lm_head")),
}  # fmt: skip
# model types that AutoModelForImageTextToText does not map: their own class (transformers' name)
MODEL_CLASSES = {"qwen2_audio": "Qwen2AudioForConditionalGeneration"}


def vision_model_type(path: str) -> str | None:
    """The model_type of a supported vision-language model folder, else None."""
    kind = model_facts.model_type(path)
    return kind if kind in COMPOSITE else None


def frozen_keys(cfg: Config, model_type: str) -> set[str]:
    """Module-name pieces the freeze_* switches take out of training (LF's forbidden modules)."""
    parts, ft = COMPOSITE[model_type], cfg.finetuning
    keys: set[str] = set()
    for on, names in (
        (ft.freeze_vision_tower, parts.vision),
        (ft.freeze_multi_modal_projector, parts.projector),
        (ft.freeze_language_model, parts.language),
    ):
        if on:
            keys.update(names)
    return keys


def lora_targets(cfg: Config, model: Any, leaf_targets: list[str]) -> list[str]:
    """The full names of the linear modules named by `leaf_targets` outside the frozen parts (a text
    model: `leaf_targets` unchanged)."""
    kind = getattr(model.config, "model_type", None)
    if kind not in COMPOSITE:
        return leaf_targets
    avoid = frozen_keys(cfg, kind) | set(COMPOSITE[kind].lora_conflict)
    leaves = set(leaf_targets)
    names = [
        name
        for name, module in model.named_modules()
        if name.split(".")[-1] in leaves and not list(module.children()) and not any(k in name for k in avoid)
    ]
    if not names:
        raise ConfigError(
            f"lora_target: {cfg.finetuning.lora_target!r} names no linear layer outside the frozen parts "
            f"({', '.join(sorted(avoid))}); unfreeze a part (freeze_vision_tower / freeze_multi_modal_projector "
            "/ freeze_language_model) or name other modules"
        )
    logger.info("LoRA on %d modules of %s; not on %s", len(names), kind, ", ".join(sorted(avoid)))
    return names


def freeze_parts(cfg: Config, model: Any) -> None:
    """Full / freeze fine-tuning of a vision-language model: the frozen parts get no gradient. On a text
    model a non-default switch has no effect and says so."""
    kind = getattr(model.config, "model_type", None)
    ft = cfg.finetuning
    if kind not in COMPOSITE:
        if not ft.freeze_vision_tower or not ft.freeze_multi_modal_projector or ft.freeze_language_model:
            logger.warning("freeze_vision_tower / freeze_multi_modal_projector / freeze_language_model: no "
                           "effect on this %s text model", kind)  # fmt: skip
        return
    keys = frozen_keys(cfg, kind)
    frozen = 0
    for name, param in model.named_parameters():
        if any(k in name for k in keys):
            param.requires_grad = False
            frozen += param.numel()
    logger.info("%s: %s frozen (%s parameters)", kind, ", ".join(sorted(keys)) or "nothing", f"{frozen:,}")


def load_vision_model(spec: Any, tokenizer: Any) -> Any:
    """AutoModelForImageTextToText in the run plan's dtype and attention kernel (ModelLoadSpec)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, set_seed

    if spec.liger:
        raise ConfigError(
            "enable_liger_kernel: not available for vision-language models in lmstack; set it false"
        )
    set_seed(spec.seed)
    config = AutoConfig.from_pretrained(spec.path, **spec.hub)
    if config.model_type in MODEL_CLASSES:
        import transformers

        AutoModelForImageTextToText = getattr(transformers, MODEL_CLASSES[config.model_type])  # noqa: N806
    config.use_cache = False
    if getattr(config, "text_config", None) is not None:
        config.text_config.use_cache = False
    kwargs = dict(
        config=config, dtype=getattr(torch, DTYPES[spec.load_dtype]), attn_implementation=spec.attention
    )
    if spec.train_from_scratch:
        model = AutoModelForImageTextToText.from_config(**kwargs)
    else:
        quant = (
            {"quantization_config": spec.quantization, "device_map": spec.device_map}
            if spec.quantization
            else {}
        )
        model = AutoModelForImageTextToText.from_pretrained(
            spec.path, low_cpu_mem_usage=spec.low_cpu_mem_usage, **kwargs, **quant, **spec.hub
        )
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows"
        )
    logger.info("loaded %s (%s, %s, attention %s)", spec.path, type(model).__name__, DTYPES[spec.load_dtype],
                model.config._attn_implementation)  # fmt: skip
    return model


def load_image_processor(cfg: Config) -> Any:
    """The model's image processor (the PIL one where torchvision is missing)."""
    from transformers import AutoImageProcessor

    m = cfg.model
    token = m.hf_hub_token.get_secret_value() if m.hf_hub_token else None
    return AutoImageProcessor.from_pretrained(
        m.model_name_or_path, cache_dir=m.cache_dir, revision=m.model_revision, token=token
    )


def save_processor_files(model_dir: str, out_dir: str) -> list[str]:
    """The processor's config files next to the trained model / adapter (so it loads with its processor)."""
    copied = []
    for name in PROCESSOR_FILES:
        src = Path(model_dir) / name
        if src.is_file():
            shutil.copyfile(src, Path(out_dir) / name)
            copied.append(name)
    return copied
