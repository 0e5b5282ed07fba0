"""The parts of the tiny Qwen-family and LLaVA vision-language models (`lmstack tiny-model DIR --vision
FAMILY`, built and saved by tiny.py): each family's config of a real architecture at tiny dimensions, its
image processor (the PIL ones: loadable offline without torchvision) and its processor config. Imports
transformers only when a part is built."""

from __future__ import annotations

_QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# the special tokens each family's processor writes for an image (Qwen-VL: start, pads, end)
VISION_TOKENS = {family: _QWEN_VL_TOKENS for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")}
VISION_TOKENS["llava"] = ["<image>"]
VISION_TOKENS["qwen2_audio"] = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
# image processor bounds of the tiny Qwen2-VL: 4..16 merged tokens per image (56x56 .. 112x112 pixels)
TINY_QWEN2_VL_PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112)
TINY_LLAVA_IMAGE = 28  # CLIP input size: (28 / 14)^2 = 4 image tokens
# video processor bounds of the tiny Qwen2-VL: frames of 56x56 .. 112x112 pixels, as its images
TINY_QWEN2_VL_VIDEO = dict(TINY_QWEN2_VL_PIXELS)


def qwen2_vl_parts(tokenizer, text_dims: dict, v2_5: bool = False):
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


def qwen2_vl_video_config(v2_5: bool) -> dict:
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


def qwen2_audio_parts(tokenizer, text_dims: dict):
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


def qwen3_vl_parts(tokenizer, text_dims: dict, moe: bool = False):
    """Qwen3-VL (dense or MoE): built in tiny_vision.py, which also writes its video processor config."""
    from lmstack.tiny_vision import qwen3_vl_parts as build

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_VL_TOKENS}
    return build(tokenizer, text_dims, ids, _qwen2_vl_image_processor(), moe)


def _qwen2_vl_image_processor():
    """Qwen2-VL's image processor class without torchvision (the PIL one; older transformers: the one there is)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def llava_parts(tokenizer, text_dims: dict):
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
