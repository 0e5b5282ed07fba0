"""`use_unsloth: true`: the model and its LoRA through the real Unsloth package (LLaMA-Factory's
contract), on one CUDA GPU. The run plan decided it (plan.unsloth: the package is
installed, a GPU is visible, the run is single-process); this module only calls Unsloth.

What it maps (LF's model_utils/unsloth.py does the same): the dtype, 4/8-bit loading from
quantization_bit, full fine-tuning, max_seq_length = cutoff_len, device = this GPU, and Unsloth's
own checkpointing ("unsloth": offloaded to CPU) exactly when the run plan checkpoints. A model family
Unsloth has no fast path for raises NotImplementedError there: the caller loads it the usual way and
says so once (LF's fallback)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("lmstack")

UNSLOTH_FLAG = "_lmstack_unsloth"  # set on a model that came from FastLanguageModel


def _checkpointing(on: bool) -> str | bool:
    return "unsloth" if on else False


def load(spec: Any, dtype: Any) -> Any | None:
    """The model from FastLanguageModel.from_pretrained (spec: models/load.py's ModelLoadSpec, dtype its
    compute dtype), or None when Unsloth does not support the model."""
    from unsloth import FastLanguageModel

    quantization_bit = spec.quantization_bit
    bits = {"load_in_4bit": quantization_bit == 4, "load_in_8bit": quantization_bit == 8}
    try:
        model, _ = FastLanguageModel.from_pretrained(
            model_name=spec.path,
            max_seq_length=spec.max_seq_length,
            dtype=dtype,
            load_in_16bit=quantization_bit is None and not spec.full_finetuning,
            full_finetuning=spec.full_finetuning,
            device_map={"": spec.device_index},
            fix_tokenizer=False,
            use_gradient_checkpointing=_checkpointing(spec.checkpointing),
            random_state=spec.seed,
            trust_remote_code=spec.hub.get("trust_remote_code", False),
            token=spec.hub.get("token"),
            revision=spec.hub.get("revision"),
            **bits,
        )
    except NotImplementedError as err:
        logger.warning(
            "use_unsloth: Unsloth does not support this model (%s); loading it without Unsloth", err
        )
        return None
    setattr(model, UNSLOTH_FLAG, True)
    model._lmstack_unsloth_checkpointing = spec.checkpointing
    logger.info("use_unsloth: loaded %s through Unsloth's FastLanguageModel", spec.path)
    return model


def is_unsloth(model: Any) -> bool:
    return bool(getattr(model, UNSLOTH_FLAG, False))


def peft_model(model: Any, lora: dict, seed: int) -> Any:
    """LoRA through FastLanguageModel.get_peft_model (Unsloth's LoRA kernels). `lora` holds the same
    keys lmstack gives PEFT's LoraConfig: r, lora_alpha, lora_dropout, target_modules, use_rslora,
    modules_to_save. Checkpointing is what load() was told (the run plan's decision)."""
    from unsloth import FastLanguageModel

    wrapped = FastLanguageModel.get_peft_model(
        model,
        bias="none",
        use_gradient_checkpointing=_checkpointing(getattr(model, "_lmstack_unsloth_checkpointing", False)),
        random_state=seed,
        loftq_config=None,
        **lora,
    )
    setattr(wrapped, UNSLOTH_FLAG, True)
    return wrapped
