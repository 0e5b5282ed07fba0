"""Tiny Gemma 3, InternVL 3 and Qwen3-VL (dense, MoE; with its video_preprocessor_config.json) models for
`lmstack tiny-model DIR --vision gemma3|internvl|qwen3_vl|qwen3_vl_moe` (tiny.py
builds the tokenizer and saves everything): random-init models of the real architectures with the
tokens, image processor and processor config their checkpoints ship, loadable offline without
torchvision (the PIL image processors: Gemma3ImageProcessorPil, GotOcr2ImageProcessorPil).

- gemma3: a SigLIP tower on 56 x 56 images (4 x 4 patches of 14), the projector's 2 x 2 average pool to
  4 image tokens (`mm_tokens_per_image`), a Gemma 3 decoder with one sliding-window and one global
  layer; tokens `<start_of_image>` `<image_soft_token>` `<end_of_image>` as the tokenizer's named
  `boi_token` / `image_token` / `eoi_token` (Gemma3Processor reads them there).
- internvl: InternVL's vision tower on 56 x 56 tiles, pixel shuffle 0.5 to 2 x 2 = 4 tokens per tile
  (`image_seq_length`), a Qwen2 decoder; tokens `<img>` `<IMG_CONTEXT>` `</img>` `<video>` as the named
  `start_image_token` / `context_image_token` / `end_image_token` / `video_token` (InternVLProcessor's).
"""

from __future__ import annotations

TINY_TILE = 56  # the image (Gemma 3) or tile (InternVL) side the tiny processors resize to
TINY_IMAGE_TOKENS = 4  # image tokens per image (Gemma 3) or per tile (InternVL)
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
GEMMA3_TURNS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "context_image_token": "<IMG_CONTEXT>",
    "end_image_token": "</img>",
    "video_token": "<video>",
}
FAMILY_TOKENS = {"gemma3": GEMMA3_TOKENS, "internvl": INTERNVL_TOKENS}
# video processor bounds of the tiny Qwen3-VL (pixels of the whole clip: frames x height x width): a
# 2-frame clip of 64x64 .. 8 frames of 128x128 (4..16 tokens per frame group, 32-pixel units)
TINY_QWEN3_VL_VIDEO = dict(shortest_edge=2 * 64 * 64, longest_edge=8 * 128 * 128)
# Qwen3-VL's image processor is Qwen2-VL's with patch 16 and mean/std 0.5 (its preprocessor_config.json);
# bounds of the tiny one: 4..16 merged tokens per image (64x64 .. 128x128 pixels, 32-pixel units)
TINY_QWEN3_VL_PIXELS = dict(min_pixels=64 * 64, max_pixels=128 * 128)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
TINY_VISION_DIMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def add_family_tokens(tokenizer, family: str) -> None:
    """The family's image tokens as named special tokens (saved in tokenizer_config.json's
    extra_special_tokens, so `tokenizer.boi_token` etc. exist after from_pretrained); Gemma 3 also
    gets its bos / eos and turn markers."""
    named = FAMILY_TOKENS[family]
    extra = list(named.values()) + (GEMMA3_TURNS[2:] if family == "gemma3" else [])
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    if family == "gemma3":
        tokenizer.add_special_tokens({"bos_token": "<bos>", "eos_token": "<eos>"})
    tokenizer._set_model_specific_special_tokens(named)
    tokenizer.init_kwargs["extra_special_tokens"] = dict(named)


def family_parts(tokenizer, family: str, text_dims: dict):
    """(config, image processor, processor config) of the tiny `family`, its tokens added first."""
    add_family_tokens(tokenizer, family)
    return (gemma3_parts if family == "gemma3" else internvl_parts)(tokenizer, text_dims)


def _text_common(tokenizer, text_dims: dict) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **text_dims,
    )


def gemma3_parts(tokenizer, text_dims: dict):
    """(config, image processor, processor config) of the tiny Gemma 3."""
    from transformers import Gemma3Config
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in GEMMA3_TOKENS.items()}
    head_dim = text_dims["hidden_size"] // text_dims["num_attention_heads"]
    text = dict(
        _text_common(tokenizer, text_dims),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"][: text_dims["num_hidden_layers"]],
    )
    vision = dict(
        model_type="siglip_vision_model",
        image_size=TINY_TILE,
        patch_size=14,
        vision_use_head=False,
        **TINY_VISION_DIMS,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TINY_IMAGE_TOKENS,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        initializer_range=text_dims.get("initializer_range", 0.02),
        tie_word_embeddings=True,
    )
    image_processor = Gemma3ImageProcessorPil(
        size={"height": TINY_TILE, "width": TINY_TILE}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": TINY_IMAGE_TOKENS}
    return config, image_processor, processor


def internvl_parts(tokenizer, text_dims: dict):
    """(config, image processor, processor config) of the tiny InternVL 3 (a Qwen2 decoder)."""
    from transformers import InternVLConfig
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    vision = dict(
        image_size=[TINY_TILE, TINY_TILE],
        patch_size=[14, 14],
        initializer_range=text_dims.get("initializer_range", 0.02),
        **TINY_VISION_DIMS,
    )
    config = InternVLConfig(
        vision_config=vision,
        text_config=dict(model_type="qwen2", **_text_common(tokenizer, text_dims)),
        image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
        image_seq_length=TINY_IMAGE_TOKENS,
        downsample_ratio=0.5,
        tie_word_embeddings=True,
    )
    # the checkpoints' preprocessor_config.json: 448-pixel tiles, ImageNet mean/std, no tiling unless asked
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": TINY_TILE, "width": TINY_TILE},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        crop_to_patches=False,
        min_patches=1,
        max_patches=12,
    )
    processor = {"processor_class": "InternVLProcessor", "image_seq_length": TINY_IMAGE_TOKENS}
    return config, image_processor, processor


def finish_model(model) -> None:
    """Gemma 3 initializes its projection to zeros (a checkpoint brings trained weights): random here,
    so the tiny model's image tokens depend on the pixels."""
    import torch

    projector = model.model.multi_modal_projector
    if hasattr(projector, "mm_input_projection_weight"):
        std = model.config.initializer_range
        with torch.no_grad():
            projector.mm_input_projection_weight.normal_(0.0, std)


def qwen3_vl_video_config() -> dict:
    """video_preprocessor_config.json of the tiny Qwen3-VL (dense and MoE), the keys the checkpoints ship
    (patch 16, mean / std 0.5) with the class's sampling defaults written out; plain JSON, as the video
    processor class needs torchvision to be built (lmstack reads it: data/media_video_qwen3.py)."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "size": dict(TINY_QWEN3_VL_VIDEO),
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def qwen3_vl_parts(tokenizer, text_dims: dict, ids: dict, image_processor_class, moe: bool = False):
    """Qwen3-VL (dense: Qwen3VLConfig; MoE: Qwen3VLMoeConfig): a SigLIP-style tower with learned
    position embeddings, its patch merger and one DeepStack merger (features of vision block 0 added
    to the first decoder layer), a Qwen3 decoder with interleaved M-RoPE."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    image_processor = image_processor_class(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        **TINY_QWEN3_VL_PIXELS,
    )  # fmt: skip
    head_dim = text_dims["hidden_size"] // text_dims["num_attention_heads"]
    section = head_dim // 2 // 3  # (temporal, height, width) sum to head_dim / 2, as [24, 20, 20] of 128
    text = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 2 - 2 * section, section, section],
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **text_dims,
        **(TINY_MOE if moe else {}),
    )
    vision = dict(
        depth=TINY_VISION_DIMS["num_hidden_layers"],
        hidden_size=TINY_VISION_DIMS["hidden_size"],
        intermediate_size=TINY_VISION_DIMS["intermediate_size"],
        num_heads=TINY_VISION_DIMS["num_attention_heads"],
        out_hidden_size=text_dims["hidden_size"],
        num_position_embeddings=64,  # an 8 x 8 grid of learned positions, interpolated per image
        deepstack_visual_indexes=[0],
        initializer_range=text_dims.get("initializer_range", 0.02),
    )
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    return config, image_processor, {"processor_class": "Qwen3VLProcessor"}
