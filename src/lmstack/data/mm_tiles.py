"""The image families whose image tokens come in fixed-size blocks, one per tile or crop: Gemma 3
(LLaMA-Factory's `gemma3` mm_plugin) and InternVL 2.5 / 3 (`intern_vl`), as LLaMA-Factory's
Gemma3Plugin / InternVLPlugin and the models' own processors (Gemma3Processor, InternVLProcessor) write
them. data/mm.py owns the common rules (placeholders, LF's resize, paths); this module the counts.

- gemma3: each `<image>` becomes `\\n\\n<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
  `<end_of_image>\\n\\n`. With `image_do_pan_and_scan: true` (LF passes the image processor
  do_pan_and_scan with min crop 256, at most 4 crops, from an aspect ratio of 1.2), an image wide or
  tall enough is also cut into 2..4 crops and written as `Here is the original image {block} and here
  are some crops to help you see better {block} {block}...`. The model reads `token_type_ids`, 1 at
  the image soft tokens (LF's `_get_gemma3_token_type_ids`; the processor's own too).
- intern_vl: each `<image>` becomes `<img>` + `<IMG_CONTEXT>` x image_seq_length x tiles + `</img>`;
  with `crop_to_patches: true` (LF: crop_to_patches with 1..12 patches) an image is resized onto the
  grid of tiles closest to its aspect ratio, plus a thumbnail tile when there is more than one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

TILED_PLUGINS = frozenset({"gemma3", "intern_vl"})
# the image processor settings LLaMA-Factory passes when its option is on (mm_plugin.py)
PAN_AND_SCAN = {
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
CROP_TO_PATCHES = {"crop_to_patches": True, "max_patches": 12, "min_patches": 1}
OPTIONS = {
    "gemma3": ("image_do_pan_and_scan", PAN_AND_SCAN),
    "intern_vl": ("crop_to_patches", CROP_TO_PATCHES),
}
PAN_AND_SCAN_TEXT = ("Here is the original image ", " and here are some crops to help you see better ")


def tile_spec(path: str, config: dict, data: Any, plugin: str) -> dict:
    """MediaSpec fields of a Gemma 3 / InternVL model folder: tokens per block (`image_seqlen`), the
    tile side (`image_size`) and the image processor settings of its crops (`tiling`, LF's when its
    option is on, else the processor's own)."""
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(path)
    field, lf = OPTIONS[plugin]
    settings = {k: getattr(proc, k) for k in lf if getattr(proc, k, None) is not None}  # None: unset
    if getattr(data, field):
        settings.update(lf)
    return dict(
        plugin=plugin,
        image_seqlen=_seqlen(path, config, plugin),
        image_size=dict(proc.size)["height"],
        tiling=tuple(sorted(settings.items())),
    )


def _seqlen(path: str, config: dict, plugin: str) -> int:
    """Image tokens per block: the processor's image_seq_length (processor_config.json; LF's plugins read
    the processor's), else the model's own count (Gemma 3's mm_tokens_per_image; InternVL's patches per
    tile after its pixel shuffle)."""
    import json

    file = Path(path) / "processor_config.json"
    saved = json.loads(file.read_text()).get("image_seq_length") if file.is_file() else None
    if saved:
        return int(saved)
    if plugin == "gemma3":
        return int(config.get("mm_tokens_per_image", 256))
    vision = config.get("vision_config") or {}
    side = _side(vision.get("image_size", 448)) // _side(vision.get("patch_size", 14))
    return int(side * side * config.get("downsample_ratio", 0.5) ** 2)


def _side(value: Any) -> int:
    return int(value[0] if isinstance(value, list | tuple) else value)


def pan_and_scan_crops(width: int, height: int, settings: dict) -> int:
    """Crops Gemma 3's pan-and-scan cuts from a `width` x `height` image (0: the image alone), by the
    rule of transformers' Gemma3ImageProcessor.pan_and_scan."""
    if not settings.get("do_pan_and_scan"):
        return 0
    min_crop = settings["pan_and_scan_min_crop_size"]
    long, short = max(width, height), min(width, height)
    if long / short < settings["pan_and_scan_min_ratio_to_activate"]:
        return 0
    crops = min(math.floor(long / short + 0.5), math.floor(long / min_crop))
    crops = min(settings["pan_and_scan_max_num_crops"], max(2, crops))
    if min(math.ceil(long / crops), short) < min_crop:
        return 0
    return crops


def internvl_tiles(width: int, height: int, tile: int, settings: dict) -> int:
    """Tiles InternVL's image processor makes of a `width` x `height` image: 1, or the grid closest to its
    aspect ratio plus a thumbnail (transformers' get_optimal_tiled_canvas)."""
    if not settings.get("crop_to_patches") or settings["max_patches"] <= 1:
        return 1
    try:  # transformers >= 5.2x: the PIL backend's module; before: the one image processor module
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas
    except ImportError:
        from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    columns, rows = get_optimal_tiled_canvas(
        (height, width), (tile, tile), settings["min_patches"], settings["max_patches"]
    )
    return 1 + columns * rows if columns * rows > 1 else 1


def blocks(width: int, height: int, spec: Any) -> int:
    """Blocks of `spec.image_seqlen` image tokens a regularized `width` x `height` image gets."""
    settings = dict(spec.tiling)
    if spec.plugin == "gemma3":
        return 1 + pan_and_scan_crops(width, height, settings)
    return internvl_tiles(width, height, spec.image_size, settings)


def image_seqlen(width: int, height: int, spec: Any) -> int:
    return spec.image_seqlen * blocks(width, height, spec)


def image_text(tokens: int, spec: Any) -> str:
    """The text of one image of `tokens` image tokens (data/mm.py's expand_text calls it)."""
    before, token, after = spec.tokens
    if spec.plugin != "gemma3" or tokens == spec.image_seqlen:
        return before + token * tokens + after
    block = before + token * spec.image_seqlen + after
    crops = tokens // spec.image_seqlen - 1
    return PAN_AND_SCAN_TEXT[0] + block + PAN_AND_SCAN_TEXT[1] + " ".join([block] * crops)


def pixel_inputs(images: list[Any], spec: Any, image_processor: Any) -> tuple[dict, list[int]]:
    """(the model inputs of regularized PIL images, the image tokens of each) from the image processor
    with the spec's tiling settings; the per-image counts (num_crops / num_patches) are not model inputs."""
    out = dict(image_processor(images=images, return_tensors="pt", **dict(spec.tiling)))
    if spec.plugin == "gemma3":
        counts = [spec.image_seqlen * (1 + int(n)) for n in _flat(out.pop("num_crops"))]
    else:
        counts = [spec.image_seqlen * int(n) for n in _flat(out.pop("num_patches"))]
    return out, counts


def _flat(values: Any) -> list:
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    return [v for row in values for v in (row if isinstance(row, list) else [row])]


def token_types(input_ids: Any, spec: Any, image_token_id: int) -> dict:
    """Gemma 3's `token_type_ids` (1 at the image soft tokens: their attention is bidirectional within
    an image); nothing for the other families."""
    return {"token_type_ids": (input_ids == image_token_id).long()} if spec.plugin == "gemma3" else {}
