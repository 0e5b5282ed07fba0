"""Images in LLaMA-Factory's multimodal datasets: the `images` column, the `<image>` placeholders, and
their expansion into the model's image tokens, exactly as the model's processor writes them.

A record's `images` (a path or a list of paths, relative to dataset_dir; never outside it, never a URL:
lmstack reads no network) must match its `<image>` placeholders one for one, counted over all its
messages (LLaMA-Factory's rule at training time; it prepends placeholders only at inference). Each
image is first resized as LLaMA-Factory does (`image_max_pixels` / `image_min_pixels`, RGB; the Qwen-VL
plugins also at least 28 pixels a side and an aspect ratio of at most 200), then each placeholder becomes:

- qwen2_vl (Qwen2-VL, Qwen2.5-VL) and qwen3_vl (Qwen3-VL dense and MoE): `<|vision_start|>` +
  `<|image_pad|>` x (grid_h x grid_w / merge_size^2) + `<|vision_end|>`, the grid from the image
  processor's own smart_resize of that size (Qwen3-VL: the same Qwen2-VL image processor, 16-pixel
  patches, so 32-pixel units after the 2 x 2 merge);
- llava (LLaVA-1.5): `<image>` x (image_size / patch_size)^2 (+1 with vision_feature_select_strategy full).
- gemma3 (Gemma 3) and intern_vl (InternVL 2.5 / 3): blocks of image tokens per image, crop or tile
  (`image_do_pan_and_scan`, `crop_to_patches`): data/mm_tiles.py.

The vision tokens are prompt tokens (label -100, as every prompt token). The encoded sample keeps its
image paths in an `images` column (JSON text); the collator (mm_collate.py) reads and processes the
pixels per batch, so the tokenized cache holds ids only. A sample whose image tokens cutoff_len would
cut is dropped and counted (the model needs all of them). Records with a media problem are listed
with file, position and reason, and stop the run (`raise_media_problems`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError, DataError
from lmstack.data.encode_common import DropExample
from lmstack.data.formats import RecordError
from lmstack.data.mm_tiles import TILED_PLUGINS, image_text
from lmstack.memory import model_facts

logger = logging.getLogger(__name__)
IMAGE_PLACEHOLDER = "<image>"
MODEL_PLUGINS = {  # model_type -> LLaMA-Factory's mm plugin (the templates name it: mm_plugin)
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "llava": "llava",
    "qwen2_audio": "qwen2_audio",
    "gemma3": "gemma3",
    "internvl": "intern_vl",
}
QWEN_VL_PLUGINS = frozenset({"qwen2_vl", "qwen3_vl"})  # grid-sized image tokens, M-RoPE, smart_resize
PLUGIN_TOKENS = {  # (before, image token, after) per image, as LLaMA-Factory's mm plugins write them
    "qwen2_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "qwen3_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "llava": ("", "<image>", ""),
    "qwen2_audio": ("", "", ""),  # no images: its audio tokens are in media_audio.py
    "gemma3": ("\n\n<start_of_image>", "<image_soft_token>", "<end_of_image>\n\n"),  # mm_tiles.py
    "intern_vl": ("<img>", "<IMG_CONTEXT>", "</img>"),
}
PLUGIN_TEMPLATES = {
    "qwen2_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl_nothink (or qwen3_vl)",
    "llava": "llava",
    "qwen2_audio": "qwen2_audio",
    "gemma3": "gemma3",
    "intern_vl": "intern_vl",
}
SUPPORTED = (
    "qwen2_vl, qwen2_5_vl (template qwen2_vl), qwen3_vl, qwen3_vl_moe (template qwen3_vl_nothink or "
    "qwen3_vl), llava (template llava), gemma3 (template gemma3) and internvl (template intern_vl)"
)
AUDIO_SUPPORTED = "qwen2_audio (template qwen2_audio)"
VIDEO_SUPPORTED = (
    "qwen2_vl, qwen2_5_vl (template qwen2_vl), qwen3_vl, qwen3_vl_moe (template qwen3_vl_nothink or qwen3_vl)"
)
NO_VIDEO_WHY = {  # why an image family lmstack trains reads no videos
    "gemma3": "Gemma 3 has no video input",
    "internvl": "InternVL's video path is not built: transformers' InternVLVideoProcessor needs torchvision",
}
# LF's image options of one family: field -> (the family, what it does, the mm_plugin that reads it)
FAMILY_IMAGE_OPTIONS = {
    "image_do_pan_and_scan": ("Gemma 3", "pan-and-scan crops of large images", "gemma3"),
    "crop_to_patches": ("InternVL", "tiling of each image into patches", "intern_vl"),
}
MEDIA_KINDS = (
    "media count mismatch", "media outside dataset_dir", "missing media file", "media URL",
    "unreadable media file", "media not supported",
)  # fmt: skip
IMAGES_CUT = "image tokens cut by cutoff_len"
# dpo: TRL's DPOTrainer with the pixels of each pair (train/dpo.py); grpo: TRL's vision path (train/grpo_media.py)
MEDIA_STAGES = ("sft", "dpo", "grpo")
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


@dataclass(frozen=True)
class MediaSpec:
    """What turning a record's images into tokens needs; plain values (part of the cache key)."""

    plugin: str  # qwen2_vl | qwen3_vl | llava
    model_type: str
    media_dir: str  # absolute; image paths are relative to it
    image_max_pixels: int
    image_min_pixels: int
    patch_size: int = 14
    merge_size: int = 1  # qwen2_vl / qwen3_vl: spatial merge of the processor
    min_pixels: int = 0  # qwen2_vl / qwen3_vl: the image processor's own resize bounds
    max_pixels: int = 0
    image_seqlen: int = 0  # llava: tokens per image
    image_size: int = 0  # llava: the square the processor crops every image to; gemma3 / intern_vl: a tile
    tiling: tuple = ()  # gemma3 / intern_vl: the image processor's crop settings (data/mm_tiles.py)
    video: Any = None  # media_video.VideoSpec of a model that reads videos (Qwen2-VL, 2.5-VL, Qwen3-VL)
    audio: Any = None  # media_audio.AudioSpec of a model that reads audio (Qwen2-Audio)

    @property
    def tokens(self) -> tuple[str, str, str]:
        return PLUGIN_TOKENS[self.plugin]


def model_type(cfg: Any) -> str | None:
    """config.json's model_type of a local model folder (None when there is none to read)."""
    return model_facts.model_type(cfg.model.model_name_or_path)


def media_spec(cfg: Any) -> MediaSpec | None:
    """The media spec of a supported vision-language model; None for any other model."""
    kind = model_type(cfg)
    if kind not in MODEL_PLUGINS:
        return None
    d = cfg.data
    if d.image_max_pixels < d.image_min_pixels:
        raise ConfigError(
            f"image_max_pixels: got {d.image_max_pixels}, less than image_min_pixels {d.image_min_pixels}; "
            "raise image_max_pixels or lower image_min_pixels"
        )
    path = Path(cfg.model.model_name_or_path)
    common = dict(
        model_type=kind,
        media_dir=str(Path(d.dataset_dir).resolve()),
        image_max_pixels=d.image_max_pixels,
        image_min_pixels=d.image_min_pixels,
    )
    config = model_facts.config_json(path) or {}
    if MODEL_PLUGINS[kind] == "qwen2_audio":
        from lmstack.data.media_audio import audio_spec

        return MediaSpec("qwen2_audio", audio=audio_spec(str(path), d), **common)
    if MODEL_PLUGINS[kind] == "llava":
        vision = config.get("vision_config") or {}
        size, patch = vision.get("image_size", 336), vision.get("patch_size", 14)
        extra = 1 if config.get("vision_feature_select_strategy", "default") == "full" else 0
        seqlen = (size // patch) ** 2 + extra
        return MediaSpec("llava", patch_size=patch, image_seqlen=seqlen, image_size=size, **common)
    if MODEL_PLUGINS[kind] in TILED_PLUGINS:
        from lmstack.data.mm_tiles import tile_spec

        return MediaSpec(**tile_spec(str(path), config, d, MODEL_PLUGINS[kind]), **common)
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(path)
    size = dict(proc.size)
    from lmstack.data.media_video import video_spec
    from lmstack.data.media_video_qwen3 import qwen3_video_spec

    return MediaSpec(
        MODEL_PLUGINS[kind],
        video=video_spec(str(path), d, kind)
        if MODEL_PLUGINS[kind] == "qwen2_vl"
        else qwen3_video_spec(str(path), d),
        patch_size=proc.patch_size,
        merge_size=proc.merge_size,
        min_pixels=size.get("shortest_edge", size.get("min_pixels")),
        max_pixels=size.get("longest_edge", size.get("max_pixels")),
        **common,
    )


# ---- one record -----------------------------------------------------------------------------
def media_list(value: Any, column: str) -> list[str]:
    """The images column as a list of path strings (a single path is a list of one)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise RecordError(column, "wrong type", "must be a list of image paths (strings)")
    return items


def resolve_media(path: str, spec: MediaSpec, field: str) -> str:
    """The image's absolute path inside dataset_dir; a URL, a path outside it or a missing file is refused."""
    if _URL.match(path):
        raise RecordError(
            field,
            "media URL",
            f"{path!r}: lmstack reads no network; download the image into dataset_dir and give its path",
        )
    root = Path(spec.media_dir)
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        raise RecordError(
            field, "media outside dataset_dir", f"{path!r} resolves to {full}, outside dataset_dir {root}"
        )
    if not full.is_file():
        raise RecordError(field, "missing media file", f"{path!r}: no such file in dataset_dir {root}")
    return str(full)


def regularized_size(width: int, height: int, spec: MediaSpec) -> tuple[int, int]:
    """(width, height) after LLaMA-Factory's resize of an image (before the processor's own)."""
    for bound, larger in ((spec.image_max_pixels, True), (spec.image_min_pixels, False)):
        if (width * height > bound) if larger else (width * height < bound):
            factor = math.sqrt(bound / (width * height))
            width, height = int(width * factor), int(height * factor)
    if spec.plugin in QWEN_VL_PLUGINS:  # LF's Qwen2VLPlugin._preprocess_image (Qwen3VLPlugin inherits it)
        if min(width, height) < 28:
            width, height = max(width, 28), max(height, 28)
        if width / height > 200:
            width = height * 180
        if height / width > 200:
            height = width * 180
    return width, height


def load_image(path: str, spec: MediaSpec) -> Any:
    """The image as the processor gets it: RGB, resized by regularized_size."""
    from PIL import Image

    with Image.open(path) as image:
        return regularize(image, spec)


def regularize(image: Any, spec: MediaSpec) -> Any:
    """A PIL image in RGB, resized by regularized_size (LLaMA-Factory's preprocessing)."""
    size = regularized_size(image.width, image.height, spec)
    image = image.convert("RGB")
    return image if image.size == size else image.resize(size)


def model_input_size(width: int, height: int, spec: MediaSpec) -> tuple[int, int]:
    """(width, height) the vision tower sees: the processor's resize of a regularized image."""
    if spec.plugin == "llava" or spec.plugin in TILED_PLUGINS:  # one square (a tile of it: mm_tiles.py)
        return spec.image_size, spec.image_size
    try:  # transformers >= 5.2x: the PIL backend's module; before: the one image processor module
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(
        height, width, factor=spec.patch_size * spec.merge_size, min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
    )  # fmt: skip
    return w, h


def image_seqlen(width: int, height: int, spec: MediaSpec) -> int:
    """Image tokens the processor writes for a `width` x `height` image (after regularized_size)."""
    if spec.plugin == "llava":
        return spec.image_seqlen
    if spec.plugin in TILED_PLUGINS:
        from lmstack.data.mm_tiles import image_seqlen as tiled_seqlen

        return tiled_seqlen(width, height, spec)
    w, h = model_input_size(width, height, spec)
    return (h // spec.patch_size) * (w // spec.patch_size) // spec.merge_size**2


def image_sizes(paths: list[str], spec: MediaSpec) -> list[tuple[int, int]]:
    """(width, height) of each image after regularized_size (reads the headers only)."""
    from PIL import Image

    out = []
    for path in paths:
        with Image.open(path) as image:
            out.append(regularized_size(image.width, image.height, spec))
    return out


def expand_example(example: dict, spec: MediaSpec) -> tuple[dict, list[str], int]:
    """(example with every `<image>` replaced by its image tokens, the absolute image paths, the number
    of image tokens); placeholders and images must match one for one."""
    column = example.get("images_field") or "images"
    raw = example.get("images") or []
    paths = [resolve_media(p, spec, f"{column}[{i}]") for i, p in enumerate(raw)]
    messages = example["prompt"] + example["response"]
    found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if found != len(paths):
        raise RecordError(
            column,
            "media count mismatch",
            f"{found} {IMAGE_PLACEHOLDER} placeholder(s) in the messages but {len(paths)} image(s) in "
            f"{column}; put one {IMAGE_PLACEHOLDER} in the text where each image goes",
        )
    if not paths:
        return example, paths, 0
    counts = [image_seqlen(w, h, spec) for w, h in image_sizes(paths, spec)]
    queue = iter(counts)

    def expand(text: str) -> str:
        return expand_text(text, [next(queue) for _ in range(text.count(IMAGE_PLACEHOLDER))], spec)

    out = dict(example)
    for key in ("prompt", "response"):
        out[key] = [dict(m, content=expand(m["content"])) for m in example[key]]
    return out, paths, sum(counts)


def expand_text(text: str, counts: list[int], spec: MediaSpec) -> str:
    """`text` with its `<image>` placeholders replaced, in order, by that many image tokens each."""
    parts = text.split(IMAGE_PLACEHOLDER)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"{len(parts) - 1} {IMAGE_PLACEHOLDER} placeholder(s) for {len(counts)} image(s)")
    return parts[0] + "".join(image_text(n, spec) + part for n, part in zip(counts, parts[1:]))


def finish_sample(sample: dict, paths: list[str], tokens: int, spec: MediaSpec, tokenizer: Any) -> dict:
    """The encoded sample with its `images` column; dropped when truncation cut image tokens."""
    token_id = tokenizer.convert_tokens_to_ids(spec.tokens[1])
    for key in [k for k in sample if k.endswith("input_ids")] if tokens else ():  # sft: one row; dpo: two
        kept = sum(1 for t in sample[key] if t == token_id)
        if kept != tokens:
            raise DropExample(
                f"cutoff_len keeps {kept} of the {tokens} image tokens of this record (the model needs "
                "all of them); raise cutoff_len or lower image_max_pixels",
                kind=IMAGES_CUT,
            )
    return {**sample, "images": json.dumps(paths)}


def raise_media_problems(stats: Any) -> None:
    """Records with a media problem (count mismatch, missing file, outside dataset_dir, URL) stop the
    run: each is listed with file, position and reason."""
    bad = [p for p in stats.problems if p["kind"] in MEDIA_KINDS]
    if not bad:
        return
    lines = [f"  {p['file']} {p['position']}: {p['field']}: {p['reason']}" for p in bad[:20]]
    more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
    raise DataError(
        f"dataset {stats.name}: {len(bad)} record(s) with media problems:\n" + "\n".join(lines) + more
    )


def media_stats(image_lists: list[str], spec: MediaSpec) -> dict:
    """`lmstack check`'s image summary of a dataset's kept samples (their `images` column): counts,
    the sizes after image_max_pixels / image_min_pixels and after the processor, and image tokens."""
    paths = [p for text in image_lists for p in json.loads(text)]
    sizes = image_sizes(paths, spec)
    inputs = [model_input_size(w, h, spec) for w, h in sizes]
    tokens = [image_seqlen(w, h, spec) for w, h in sizes]

    def span(values: list[tuple[int, int]]) -> list[str]:
        by_area = sorted(values, key=lambda s: s[0] * s[1])
        return [f"{w}x{h}" for w, h in (by_area[0], by_area[-1])] if values else []

    return {
        "images": len(paths),
        "samples_with_images": sum(1 for text in image_lists if json.loads(text)),
        "resized": span(sizes),  # smallest and largest (by area) after LF's pixel bounds
        "model_input": span(inputs),  # ... and as the vision tower sees them
        "image_tokens": sum(tokens),
        "image_tokens_per_image": {"min": min(tokens, default=0), "max": max(tokens, default=0)},
    }


def format_media(media: dict) -> str:
    """One line of `lmstack check`'s text report."""
    if not media["images"]:
        return "    images: none"
    per = media["image_tokens_per_image"]
    return (
        f"    images: {media['images']} in {media['samples_with_images']} samples, resized to "
        f"{' .. '.join(media['resized'])} px (model input {' .. '.join(media['model_input'])}), "
        f"{media['image_tokens']} image tokens ({per['min']}..{per['max']} per image, counted in the lengths)"
    )


# ---- inference (chat, API) -----------------------------------------------------------------------
def inference_messages(messages: list[dict], images: list[Any], spec: MediaSpec) -> list[dict]:
    """`messages` with each image's tokens in place of its `<image>` placeholder (regularized PIL
    images, in order); with no placeholder at all, LLaMA-Factory's inference rule: one placeholder
    per image at the start of the first message."""
    if images and not any(IMAGE_PLACEHOLDER in m["content"] for m in messages):
        first = dict(messages[0], content=IMAGE_PLACEHOLDER * len(images) + messages[0]["content"])
        messages = [first, *messages[1:]]
    found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if found != len(images):
        raise ValueError(
            f"{found} {IMAGE_PLACEHOLDER} placeholder(s) in the messages but {len(images)} image(s); "
            f"put one {IMAGE_PLACEHOLDER} where each image goes"
        )
    queue = iter([image_seqlen(im.width, im.height, spec) for im in images])
    return [
        dict(
            m,
            content=expand_text(
                m["content"], [next(queue) for _ in range(m["content"].count(IMAGE_PLACEHOLDER))], spec
            ),
        )
        for m in messages
    ]


def pixel_inputs(images: list[Any], spec: MediaSpec, image_processor: Any) -> dict:
    """The model inputs of regularized PIL images (pixel_values, + image_grid_thw for the Qwen-VLs)."""
    if images and spec.plugin in TILED_PLUGINS:
        from lmstack.data.mm_tiles import pixel_inputs as tiled_inputs

        return tiled_inputs(images, spec, image_processor)[0]
    return dict(image_processor(images=images, return_tensors="pt")) if images else {}
