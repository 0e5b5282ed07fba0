"""The built-in tiny model: a byte-level BPE tokenizer trained in-process on the shipped demo data
and a random-init model of a real architecture (Qwen2 or Llama), saved with `save_pretrained` so
everything downstream loads it through the normal `from_pretrained` path. Deterministic and offline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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
_QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# the special tokens each family's processor writes for an image (Qwen-VL: start, pads, end)
VISION_TOKENS = {
    family: _QWEN_VL_TOKENS for family in VISION_FAMILIES if family.startswith("qwen") and "vl" in family
}
VISION_TOKENS["llava"] = ["<image>"]
VISION_TOKENS["qwen2_audio"] = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
# image processor bounds of the tiny Qwen2-VL: 4..16 merged tokens per image (56x56 .. 112x112 pixels)
TINY_QWEN2_VL_PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112)
TINY_LLAVA_IMAGE = 28  # CLIP input size: (28 / 14)^2 = 4 image tokens
# video processor bounds of the tiny Qwen2-VL: frames of 56x56 .. 112x112 pixels, as its images
TINY_QWEN2_VL_VIDEO = dict(TINY_QWEN2_VL_PIXELS)


def _qwen2_vl_parts(tokenizer, text_dims: dict, v2_5: bool = False):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    Qwen2VLImageProcessorPil = _qwen2_vl_image_processor()  # noqa: N806 (a class)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_VL_TOKENS}
    head_dim = text_dims["hidden_size"] // text_dims["num_attention_heads"]
    quarter = head_dim // 8  # mrope sections (temporal, height, width) sum to head_dim / 2
    vision = dict(
        depth=TINY_VISION["num_hidden_layers"],
        embed_dim=TINY_VISION["hidden_size"],
        hidden_size=text_dims["hidden_size"],
        num_heads=TINY_VISION["num_attention_heads"],
        mlp_ratio=2,
        initializer_range=text_dims.get("initializer_range", 0.02),
    )
    if v2_5:  # Qwen2.5-VL's vision tower: SwiGLU blocks, window attention but in the last block
        vision = dict(
            depth=TINY_VISION["num_hidden_layers"],
            hidden_size=TINY_VISION["hidden_size"],
            intermediate_size=TINY_VISION["intermediate_size"],
            num_heads=TINY_VISION["num_attention_heads"],
            out_hidden_size=text_dims["hidden_size"],
            fullatt_block_indexes=[TINY_VISION["num_hidden_layers"] - 1],
            initializer_range=text_dims.get("initializer_range", 0.02),
        )
    config = (Qwen2_5_VLConfig if v2_5 else Qwen2VLConfig)(
        text_config=dict(
            vocab_size=len(tokenizer),
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [
                    head_dim // 2 - 2 * (quarter + quarter // 2),
                    *([quarter + quarter // 2] * 2),
                ],
            },
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
            **text_dims,
        ),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    processor = {"processor_class": "Qwen2_5_VLProcessor" if v2_5 else "Qwen2VLProcessor"}
    return config, Qwen2VLImageProcessorPil(**TINY_QWEN2_VL_PIXELS), processor


def _qwen2_vl_video_config(v2_5: bool) -> dict:
    """video_preprocessor_config.json of the tiny Qwen2-VL, written as JSON: transformers' video processor
    class needs torchvision to be built, but its saved config is plain data (lmstack reads it itself)."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    return {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if v2_5 else "Qwen2VLProcessor",
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "do_convert_rgb": True,
        "do_sample_frames": False,
        "size": {
            "shortest_edge": TINY_QWEN2_VL_VIDEO["min_pixels"],
            "longest_edge": TINY_QWEN2_VL_VIDEO["max_pixels"],
        },
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def _qwen2_audio_parts(tokenizer, text_dims: dict):
    """Qwen2-Audio: a Whisper-style audio encoder (128 mel bins, its 30 s window), the projector and a
    Qwen2 language model; the Whisper feature extractor of the real model's settings."""
    from transformers import Qwen2AudioConfig, WhisperFeatureExtractor

    config = Qwen2AudioConfig(
        audio_config=dict(
            model_type="qwen2_audio_encoder",
            num_mel_bins=128,
            encoder_layers=TINY_VISION["num_hidden_layers"],
            encoder_attention_heads=TINY_VISION["num_attention_heads"],
            encoder_ffn_dim=TINY_VISION["intermediate_size"],
            d_model=TINY_VISION["hidden_size"],
            max_source_positions=1500,
            initializer_range=text_dims.get("initializer_range", 0.02),
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tokenizer),
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
            **text_dims,
        ),
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
        tie_word_embeddings=True,
    )
    extractor = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
    )
    processor = {
        "processor_class": "Qwen2AudioProcessor",
        "audio_token": "<|AUDIO|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    }
    return config, extractor, processor


def _qwen2_vl_image_processor():
    """Qwen2-VL's image processor class without torchvision (the PIL one; older transformers: the one there is)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def _llava_parts(tokenizer, text_dims: dict):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    try:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    except ImportError:
        from transformers import CLIPImageProcessor as CLIPImageProcessorPil

    text = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **text_dims,
    )
    vision = CLIPVisionConfig(image_size=TINY_LLAVA_IMAGE, patch_size=14, **TINY_VISION)
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(TINY_LLAVA_IMAGE // 14) ** 2,
        tie_word_embeddings=True,
    )
    size = {"height": TINY_LLAVA_IMAGE, "width": TINY_LLAVA_IMAGE}
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": TINY_LLAVA_IMAGE}, crop_size=size)
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": 14,
        "vision_feature_select_strategy": config.vision_feature_select_strategy,
        "num_additional_image_tokens": 1,  # CLIP's class token
        "image_token": "<image>",
    }
    return config, image_processor, processor


def _vision_parts(tokenizer, family: str):
    if family == "llava":
        return _llava_parts(tokenizer, dict(TINY_DIMS))
    if family == "qwen2_audio":
        return _qwen2_audio_parts(tokenizer, dict(TINY_DIMS))
    if family.startswith("qwen3_vl"):  # its own module, with its video processor config
        from lmstack.tiny_vision import qwen3_vl_parts

        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_VL_TOKENS}
        return qwen3_vl_parts(
            tokenizer, dict(TINY_DIMS), ids, _qwen2_vl_image_processor(), family == "qwen3_vl_moe"
        )
    return _qwen2_vl_parts(tokenizer, dict(TINY_DIMS), family == "qwen2_5_vl")


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

        video = (
            qwen3_vl_video_config()
            if family.startswith("qwen3")
            else _qwen2_vl_video_config(family == "qwen2_5_vl")
        )
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    return out
