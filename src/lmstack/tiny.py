"""The built-in tiny model: a byte-level BPE tokenizer trained in-process on the shipped demo data
and a random-init model of a real architecture (Qwen2 or Llama), saved with `save_pretrained` so
everything downstream loads it through the normal `from_pretrained` path. Deterministic and offline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from lmstack.tiny_vl import (
    VISION_TOKENS,
    llava_parts,
    qwen2_audio_parts,
    qwen2_vl_parts,
    qwen2_vl_video_config,
    qwen3_vl_parts,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, like Qwen2's own template, so "template unset -> tokenizer's chat template" is exercised.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# initializer_range 0.1 (not 0.02): a 128-wide random model then has logits large enough for a
# LoRA run of a few dozen steps to visibly lower the loss. Both architectures share the dims.
TINY_DIMS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
)
ARCHS = ("qwen2", "llama")
_FALLBACK_CORPUS = [
    "Hello, how can I help you today?",
    "你好，请问有什么可以帮你的吗？",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]


def _strings(obj: object) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def corpus_from_dir(data_dir: Path | None) -> list[str]:
    """All strings of the demo files (json, jsonl, txt) in a fixed order; a fallback when absent."""
    texts: list[str] = []
    if data_dir is not None and data_dir.is_dir():
        for path in sorted(data_dir.iterdir()):
            if path.name == "dataset_info.json":
                continue
            if path.suffix == ".json":
                texts.extend(_strings(json.loads(path.read_text(encoding="utf-8"))))
            elif path.suffix == ".jsonl":
                for line in path.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        texts.extend(_strings(json.loads(line)))
            elif path.suffix == ".txt":
                texts.extend(line for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return texts or list(_FALLBACK_CORPUS)


def build_tokenizer(corpus: list[str], vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    data_dir: str | Path | None = "data",
    arch: str = "qwen2",
    vocab_size: int = 1024,
    seed: int = 0,
    **overrides: int,
) -> Path:
    """Write tokenizer + random-init model to `out_dir`; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus_from_dir(Path(data_dir) if data_dir else None), vocab_size)
    dims = {**TINY_DIMS, **overrides}
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **dims,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ---- tiny vision-language models (`lmstack tiny-model DIR --vision FAMILY`) ----------------------
VISION_FAMILIES = (
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "qwen2_audio", "gemma3", "internvl",
)  # fmt: skip


def _vision_parts(tokenizer, family: str):
    if family == "llava":
        return llava_parts(tokenizer, dict(TINY_DIMS))
    if family == "qwen2_audio":
        return qwen2_audio_parts(tokenizer, dict(TINY_DIMS))
    if family.startswith("qwen3_vl"):
        return qwen3_vl_parts(tokenizer, dict(TINY_DIMS), family == "qwen3_vl_moe")
    return qwen2_vl_parts(tokenizer, dict(TINY_DIMS), family == "qwen2_5_vl")


def build_tiny_vision_model(
    out_dir: str | Path, family: str = "qwen2_vl", data_dir: str | Path | None = "data", seed: int = 0
) -> Path:
    """A random-init vision-language model of a real architecture (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense
    or MoE, LLaVA = CLIP + Llama, Gemma 3, InternVL 3)
    with the tiny tokenizer plus the family's image tokens, its image processor and processor config,
    loadable offline by AutoModelForImageTextToText / AutoImageProcessor / AutoProcessor."""
    import torch
    from transformers import AutoModelForImageTextToText

    if family not in VISION_FAMILIES:
        raise ValueError(f"--vision: got {family!r}; allowed: {' | '.join(VISION_FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus_from_dir(Path(data_dir) if data_dir else None))
    if family in ("gemma3", "internvl"):  # named image tokens, their own module (tiny_vision.py)
        from lmstack.tiny_vision import family_parts

        config, image_processor, processor = family_parts(tokenizer, family, dict(TINY_DIMS))
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS[family]})
        config, image_processor, processor = _vision_parts(tokenizer, family)
    torch.manual_seed(seed)
    if family == "qwen2_audio":  # not an image-text-to-text model: its own class
        from transformers import Qwen2AudioForConditionalGeneration

        model = Qwen2AudioForConditionalGeneration._from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    if family in ("gemma3", "internvl"):
        from lmstack.tiny_vision import finish_model

        finish_model(model)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)  # preprocessor_config.json: loads without torchvision
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        from lmstack.tiny_vision import qwen3_vl_video_config

        qwen3 = family.startswith("qwen3")
        video = qwen3_vl_video_config() if qwen3 else qwen2_vl_video_config(family == "qwen2_5_vl")
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    return out
