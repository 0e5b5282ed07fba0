"""Preflight rules for LoRA variants and memory-saving optimizers (LLaMA-Factory's fields):
which fields combine, which need which precision, launcher and stage. Errors name both fields and the fix."""

from __future__ import annotations

import logging

from lmstack.config.errors import ConfigError
from lmstack.config.schema import ADAMW_OPTIMS, Config
from lmstack.config.stages import stage_spec, stages_where

logger = logging.getLogger(__name__)

MEMORY_OPTIMIZERS = ("use_galore", "use_apollo", "use_badam", "use_muon", "use_adam_mini")
PACKAGES = {
    "use_galore": "galore-torch",
    "use_apollo": "apollo-torch",
    "use_badam": "badam",
    "use_adam_mini": "adam-mini",
}
MODULES = {
    "use_galore": "galore_torch",
    "use_apollo": "apollo_torch",
    "use_badam": "badam",
    "use_adam_mini": "adam_mini",
}
ADAPTER_TYPES = ("lora", "oft")
OFT_DEFAULTS = {"oft_rank": 0, "oft_block_size": 32, "oft_target": "all", "module_dropout": 0.0}
LOSSES = ("use_dft_loss", "use_eaft_loss", "use_asft_loss")
METRIC_MODULES = {"jieba": "jieba", "nltk": "nltk", "rouge_chinese": "rouge-chinese"}


def check_methods(cfg: Config, world_size: int, zero_stage: int | None) -> None:
    """Combination rules for LoRA variants and memory-saving optimizers; errors name both fields.
    `cfg` is the run plan's config (`optim: muon` already read as use_muon), the rest the plan's facts."""
    ft, t = cfg.finetuning, cfg.training
    check_lf_features(cfg)
    if t.optim.startswith("muon"):
        raise ConfigError(f"optim: got {t.optim!r}; lmstack's Muon is `optim: muon` (torch.optim.Muon)")
    on = [name for name in MEMORY_OPTIMIZERS if getattr(ft, name)]
    if len(on) > 1:
        raise ConfigError(f"{on[0]} and {on[1]}: use one memory-saving optimizer at a time; remove one")
    for name in ("loraplus_lr_ratio", "pissa_init", "use_dora", "use_rslora", "create_new_adapter"):
        if getattr(ft, name) and ft.finetuning_type != "lora":
            raise ConfigError(
                f"{name}: a LoRA option, but finetuning_type is {ft.finetuning_type}; "
                "set finetuning_type: lora or remove it"
            )
    if ft.pissa_convert and not ft.pissa_init:
        raise ConfigError(
            "pissa_convert: converts a PiSSA adapter; set pissa_init: true as well or remove it"
        )
    if ft.pissa_init and cfg.model.adapter_name_or_path and not ft.create_new_adapter:
        raise ConfigError(
            f"pissa_init: initialises a new adapter, but adapter_name_or_path resumes "
            f"{cfg.model.adapter_name_or_path}; set create_new_adapter: true or remove pissa_init"
        )
    if ft.pissa_init and ft.pissa_iter != -1 and not ft.pissa_convert:
        logger.warning(
            "pissa_init with pissa_iter: %d: PEFT re-runs the randomised SVD when the adapter is loaded, so "
            "output_dir's adapter does not reproduce the trained model; set pissa_convert: true and use "
            "output_dir/pissa_converted (or pissa_iter: -1 for the exact, reproducible SVD)",
            ft.pissa_iter,
        )
    if ft.create_new_adapter and not cfg.model.adapter_name_or_path:
        raise ConfigError("create_new_adapter: needs adapter_name_or_path (the adapters to merge first)")
    needs_wiring = on + [f for f in ("loraplus_lr_ratio", "pissa_convert") if getattr(ft, f)]
    if needs_wiring and not stage_spec(ft.stage).method_optimizers:
        raise ConfigError(
            f"{needs_wiring[0]}: not available for stage: {ft.stage} yet (stages: {' | '.join(stages_where('method_optimizers'))}); "
            "remove it or use one of those stages"
        )
    if not on:
        return
    name = on[0]
    _check_installed(name)
    if ft.finetuning_type in ADAPTER_TYPES:
        raise ConfigError(
            f"{name}: a full-parameter optimizer, not for finetuning_type: {ft.finetuning_type}; "
            "set finetuning_type: full (or freeze) or remove it"
        )
    if ft.loraplus_lr_ratio is not None:
        raise ConfigError(f"{name} and loraplus_lr_ratio: LoRA+ is a LoRA optimizer; remove one")
    if name != "use_badam" and t.optim not in ADAMW_OPTIMS + _eight_bit(name):
        raise ConfigError(
            f"{name} and optim: {t.optim!r}: {name} replaces the optimizer; "
            f"leave optim at adamw_torch (allowed: {' | '.join(ADAMW_OPTIMS + _eight_bit(name))})"
        )
    distributed = world_size > 1
    if name in ("use_galore", "use_apollo"):
        prefix = name.removeprefix("use_")
        if t.deepspeed:
            raise ConfigError(f"{name} and deepspeed: {prefix} does not run under DeepSpeed; remove one")
        if getattr(ft, f"{prefix}_layerwise"):
            if t.gradient_accumulation_steps != 1:
                raise ConfigError(
                    f"{prefix}_layerwise and gradient_accumulation_steps: {t.gradient_accumulation_steps}: "
                    "layer-wise steps happen during backward; set gradient_accumulation_steps: 1"
                )
            if distributed:
                raise ConfigError(
                    f"{prefix}_layerwise: not supported with several processes; run one process"
                )
    if name == "use_badam":
        _check_badam(cfg, distributed, zero_stage)
    if name == "use_muon":
        import torch

        if not hasattr(torch.optim, "Muon"):
            raise ConfigError(
                f"use_muon: needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}"
            )


def _eight_bit(name: str) -> tuple[str, ...]:
    return ("adamw_8bit", "adamw_bnb_8bit", "adafactor") if name == "use_galore" else ()


def _check_installed(name: str) -> None:
    import importlib.util

    module = MODULES.get(name)
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(f"{name}: needs the `{PACKAGES[name]}` package; pip install 'lmstack[optim]'")


def check_lf_features(cfg: Config) -> None:
    """OFT, LLaMA-Pro, the DFT/EAFT/ASFT losses and generation for do_predict (LLaMA-Factory's rules)."""
    _check_oft(cfg)
    _check_llama_pro(cfg)
    _check_freeze_layers(cfg)
    _check_losses(cfg)
    _check_predict(cfg)


def _check_oft(cfg: Config) -> None:
    ft = cfg.finetuning
    if ft.finetuning_type != "oft":
        for name, default in OFT_DEFAULTS.items():
            if getattr(ft, name) != default:
                logger.warning(
                    "%s: has no effect with finetuning_type: %s (OFT only)", name, ft.finetuning_type
                )
        return
    if bool(ft.oft_rank) == bool(ft.oft_block_size):
        raise ConfigError(
            f"oft_rank: {ft.oft_rank} and oft_block_size: {ft.oft_block_size}: PEFT's OFT takes exactly one of "
            "them (blocks x block size = the layer width); e.g. oft_block_size: 32 with oft_rank: 0, or "
            "oft_rank: 8 with oft_block_size: 0"
        )
    if ft.lora_target.strip() != "all":
        raise ConfigError(
            f"lora_target: {ft.lora_target!r} with finetuning_type: oft; lmstack's OFT wraps oft_target "
            f"(LLaMA-Factory reads lora_target for OFT); set oft_target: {ft.lora_target} and remove lora_target"
        )


def _check_llama_pro(cfg: Config) -> None:
    ft = cfg.finetuning
    if not ft.use_llama_pro:
        return
    if ft.finetuning_type == "full":
        raise ConfigError(
            "use_llama_pro: trains only the expanded blocks, so it is for finetuning_type: freeze, lora or oft, "
            "not full; set finetuning_type: freeze (or remove use_llama_pro)"
        )
    layers, k = _config_layers(cfg), ft.freeze_trainable_layers
    if layers is not None:
        from lmstack.models.adapters import llama_pro_layers

        llama_pro_layers(layers, k)  # raises unless k divides the layer count, naming the divisors
    elif k <= 0:
        raise ConfigError(
            f"freeze_trainable_layers: got {k} with use_llama_pro; it is the number of expanded blocks, "
            "a positive divisor of the model's layer count"
        )


def _check_freeze_layers(cfg: Config) -> None:
    """freeze_trainable_layers: 0 trains no decoder layer (LF: range(0)); with no freeze_extra_modules either,
    nothing would train."""
    ft = cfg.finetuning
    if ft.finetuning_type != "freeze":
        return
    from lmstack.models.adapters import freeze_extra_modules

    extra = set(freeze_extra_modules(cfg))
    if "lm_head" in extra and _ties_embeddings(cfg):
        raise ConfigError(
            "freeze_extra_modules: lm_head is tied to the embedding in this model (tie_word_embeddings: true): "
            "the one shared matrix trains as embed_tokens; name embed_tokens instead of lm_head"
        )
    if ft.use_llama_pro or ft.freeze_trainable_layers != 0:
        return
    if not extra:
        raise ConfigError(
            "freeze_trainable_layers: 0 trains no decoder layer and freeze_extra_modules is unset, so nothing "
            "would train; use n > 0 (the last n layers), -n (the first n) or name freeze_extra_modules"
        )


def _model_config(cfg: Config) -> dict:
    """The model's config.json ({} when it cannot be read here)."""
    from lmstack.memory.model_facts import config_json

    return config_json(cfg.model.model_name_or_path) or {}


def _ties_embeddings(cfg: Config) -> bool:
    config = _model_config(cfg)
    return bool(
        config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings"))
    )


def _config_layers(cfg: Config) -> int | None:
    """num_hidden_layers from the model's config.json (None when it cannot be read here)."""
    config = _model_config(cfg)
    config = config.get("text_config") or config
    return config.get("num_hidden_layers") or config.get("num_layers")


def _check_losses(cfg: Config) -> None:
    ft = cfg.finetuning
    on = [name for name in LOSSES if getattr(ft, name)]
    if len(on) > 1:
        raise ConfigError(f"{on[0]} and {on[1]}: one token loss at a time; remove one")
    if on and ft.stage != "sft":
        raise ConfigError(f"{on[0]}: a stage sft loss, not available for stage: {ft.stage}; remove it")
    if ft.eaft_alpha != 1.0 and not ft.use_eaft_loss:
        logger.warning("eaft_alpha: has no effect without use_eaft_loss: true")
    if ft.asft_alpha != 0.1 and not ft.use_asft_loss:
        logger.warning("asft_alpha: has no effect without use_asft_loss: true")


def _check_predict(cfg: Config) -> None:
    ft, t, d = cfg.finetuning, cfg.training, cfg.data
    if t.predict_with_generate and ft.stage != "sft":
        raise ConfigError(f"predict_with_generate: only for stage: sft (got {ft.stage}); remove it")
    if t.do_predict and ft.stage != "sft":
        raise ConfigError(f"do_predict: lmstack predicts for stage: sft only (got {ft.stage}); remove it")
    if t.predict_with_generate and ft.compute_accuracy:
        raise ConfigError("predict_with_generate and compute_accuracy: use one of them (as in LLaMA-Factory)")
    if t.predict_with_generate and (t.do_eval or t.eval_strategy != "no"):
        raise ConfigError(
            "predict_with_generate with evaluation (do_eval / eval_strategy): lmstack generates for do_predict "
            "only and evaluates by eval_loss; remove predict_with_generate from the evaluation run, or set "
            "do_eval: false and eval_strategy: no"
        )
    if t.predict_with_generate and not t.do_predict:
        logger.warning("predict_with_generate: has no effect without do_predict: true")
    if not t.do_predict:
        return
    if not t.predict_with_generate:
        raise ConfigError(
            "do_predict: stage sft predicts by generating; set predict_with_generate: true (as LLaMA-Factory asks)"
        )
    if not d.eval_dataset and not (d.val_size > 0 and d.dataset):
        raise ConfigError("do_predict: needs eval_dataset (or dataset with val_size > 0) to generate for")
    import importlib.util

    missing = [pkg for module, pkg in METRIC_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(
            f"predict_with_generate: LLaMA-Factory's BLEU-4 / ROUGE metrics need {', '.join(missing)}; "
            "pip install 'lmstack[metrics]'"
        )


def _check_badam(cfg: Config, distributed: bool, zero_stage: int | None) -> None:
    ft, t = cfg.finetuning, cfg.training
    if ft.finetuning_type != "full":
        raise ConfigError(
            f"use_badam and finetuning_type: {ft.finetuning_type}: BAdam chooses the trainable block itself; "
            "set finetuning_type: full"
        )
    if ft.badam_mode == "layer":  # the ratio-mode fields change nothing here: said, not ignored
        if ft.badam_update_ratio != 0.05:
            logger.warning("badam_update_ratio: has no effect with badam_mode: layer (ratio mode only)")
        if ft.badam_mask_mode != "adjacent":
            logger.warning("badam_mask_mode: has no effect with badam_mode: layer (ratio mode only)")
    if ft.badam_mode == "ratio":
        # its sparse gradients break the Trainer's gradient-norm (torch's clip_grad_norm_ has no sparse kernel)
        raise ConfigError(
            "badam_mode: ratio is not supported by lmstack yet (sparse gradients cannot go through the "
            "Trainer's gradient norm); use badam_mode: layer"
        )
    if distributed or t.deepspeed:
        if zero_stage != 3:
            raise ConfigError(
                f"use_badam and deepspeed: {t.deepspeed or 'none'}: distributed layer-wise BAdam runs only under "
                "DeepSpeed ZeRO-3; use examples/deepspeed/ds_z3_config.json or one process"
            )
