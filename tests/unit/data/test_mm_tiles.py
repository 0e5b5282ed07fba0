"""Gemma 3 and InternVL images (data/mm_tiles.py) with LF's tiling options on: `image_do_pan_and_scan`
(Gemma 3's crops) and `crop_to_patches` (InternVL's tiles) give the ids, pixels and token types the
models' own processors give for the same text and images, with the settings LF passes them."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mm import IMAGE_TOKEN, RAW_IMAGE, processor_of, vlm_cfg, write_dataset, write_images

from lmstack.config.errors import ConfigError, DataError
from lmstack.data.mm import load_image, media_spec
from lmstack.data.mm_collate import MediaCollator
from lmstack.data.mm_tiles import CROP_TO_PATCHES, PAN_AND_SCAN, internvl_tiles, pan_and_scan_crops
from lmstack.data.pipeline import build_datasets, check_data_args
from lmstack.templates import get_template

FAMILIES = {"gemma3": "image_do_pan_and_scan", "internvl": "crop_to_patches"}
LF_ON = {"gemma3": PAN_AND_SCAN, "internvl": CROP_TO_PATCHES}
# wide (3 crops), tall (2 crops), square (none: below pan-and-scan's 1.2 ratio)
SIZES = [(800, 300), (300, 700), (400, 400)]


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiled")
    data = Path(__file__).resolve().parents[3] / "data"
    return {f: build_tiny_vision_model(root / f, f, data_dir=data) for f in FAMILIES}


def _messages():
    return [
        {"role": "user", "content": "Look <image> then <image>."},
        {"role": "assistant", "content": "Two pictures."},
        {"role": "user", "content": "<image>And this?"},
        {"role": "assistant", "content": "A square."},
    ]


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiled_images_give_the_processors_own_ids_pixels_and_token_types(
    family, on, tiled, base_cfg, tmp_path
):
    import torch

    images = write_images(tmp_path, SIZES)
    write_dataset(tmp_path, [{"messages": _messages(), "images": images}])
    cfg = vlm_cfg(base_cfg, tiled[family], family, tmp_path, cutoff_len=2048, **{FAMILIES[family]: on})
    proc = processor_of(tiled[family], family)
    template = get_template(cfg.data.template, proc.tokenizer)
    sample = build_datasets(cfg, proc.tokenizer, template).train[0]
    spec = media_spec(cfg)
    image_id = proc.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family])
    batch = MediaCollator(proc.tokenizer.pad_token_id, spec, proc.image_processor, image_id)([sample])

    text = template.render(
        [dict(m, content=m["content"].replace("<image>", RAW_IMAGE[family])) for m in _messages()],
        template.default_system,
        proc.tokenizer,
    )
    kwargs = LF_ON[family] if on else {next(iter(LF_ON[family])): False}
    pictures = [load_image(str(tmp_path / p), spec) for p in images]
    ref = proc(text=[text], images=pictures, return_tensors="pt", **kwargs)
    assert batch["input_ids"][0].tolist() == ref["input_ids"][0].tolist()
    assert torch.equal(batch["pixel_values"], ref["pixel_values"])
    blocks = batch["pixel_values"].shape[0]
    # on: Gemma 3, 1 + 3 crops, 1 + 2, 1; InternVL's 56-pixel tiles, grids 5 x 2, 2 x 5, 3 x 3 + thumbnails
    assert blocks == ((4 + 3 + 1) if family == "gemma3" else (11 + 11 + 10)) if on else blocks == 3
    assert int((batch["input_ids"] == image_id).sum()) == 4 * blocks  # 4 tokens per crop / tile
    at = sample["labels"]
    assert all(at[i] == -100 for i, t in enumerate(sample["input_ids"]) if t == image_id)
    if family == "gemma3":  # the processor's token_type_ids: 1 at the image soft tokens
        assert batch["token_type_ids"].tolist() == ref["token_type_ids"].tolist()
    else:
        assert "token_type_ids" not in batch


def test_the_crop_and_tile_counts_are_the_image_processors_own(tiled):
    """pan_and_scan_crops / internvl_tiles count what the image processors cut, for many sizes (the
    token counts are made from them before any pixel is read)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    gemma = AutoImageProcessor.from_pretrained(tiled["gemma3"])
    intern = AutoImageProcessor.from_pretrained(tiled["internvl"])
    sizes = [(w, h) for w in (60, 255, 256, 300, 511, 512, 700, 1030) for h in (60, 256, 299, 520, 900)]
    images = [Image.new("RGB", s) for s in sizes]
    crops = gemma(images=images, **PAN_AND_SCAN)["num_crops"]
    assert [pan_and_scan_crops(w, h, PAN_AND_SCAN) for w, h in sizes] == list(crops)
    assert sum(crops) > 10 and 0 in list(crops)  # both cases met
    tiles = intern(images=images, **CROP_TO_PATCHES)["num_patches"]
    assert [internvl_tiles(w, h, 56, CROP_TO_PATCHES) for w, h in sizes] == list(tiles)
    assert [pan_and_scan_crops(w, h, {"do_pan_and_scan": False}) for w, h in sizes] == [0] * len(sizes)


def test_each_tiling_option_is_refused_by_name_on_the_other_family(tiled, base_cfg, tmp_path):
    write_dataset(tmp_path, [{"messages": _messages()[:2], "images": write_images(tmp_path, SIZES[:2])}])
    for family, other in (("gemma3", "crop_to_patches"), ("internvl", "image_do_pan_and_scan")):
        check_data_args(vlm_cfg(base_cfg, tiled[family], family, tmp_path, **{FAMILIES[family]: True}))
        with pytest.raises(ConfigError) as err:
            check_data_args(vlm_cfg(base_cfg, tiled[family], family, tmp_path, **{other: True}))
        owner = "InternVL" if other == "crop_to_patches" else "Gemma 3"
        assert str(err.value).startswith(f"{other}: true is {owner}'s")
        assert f"this {family} model has no such option" in str(err.value)
        assert f"of them only {owner} has it" in str(err.value)


def test_videos_of_gemma3_and_internvl_are_refused_by_name(tiled, base_cfg, tmp_path):
    """InternVL's video processor needs torchvision and Gemma 3 reads no video: a `videos` column is
    refused before the model loads, naming the model type and where video works."""
    import json

    write_dataset(tmp_path, [{"messages": _messages()[:2], "images": write_images(tmp_path, SIZES[:2])}])
    entry = json.loads((tmp_path / "dataset_info.json").read_text())
    entry["mm"]["columns"]["videos"] = "videos"
    (tmp_path / "dataset_info.json").write_text(json.dumps(entry))
    for family in FAMILIES:
        with pytest.raises(DataError, match=f"is a {family} model, which lmstack feeds no videos"):
            check_data_args(vlm_cfg(base_cfg, tiled[family], family, tmp_path))


def test_a_wrong_template_names_the_family_template(tiled, base_cfg, tmp_path):
    write_dataset(tmp_path, [{"messages": _messages()[:2], "images": write_images(tmp_path, SIZES[:2])}])
    proc = processor_of(tiled["gemma3"], "gemma3")
    cfg = vlm_cfg(base_cfg, tiled["gemma3"], "gemma3", tmp_path, template="gemma")
    with pytest.raises(
        ConfigError,
        match="template: 'gemma' has no image support for this gemma3 model .* use template: gemma3",
    ):
        build_datasets(cfg, proc.tokenizer, get_template("gemma", proc.tokenizer))
