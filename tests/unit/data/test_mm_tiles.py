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
    why = {"gemma3": "Gemma 3 has no video input", "internvl": "InternVLVideoProcessor needs torchvision"}
    for family in FAMILIES:
        with pytest.raises(DataError, match=f"is a {family} model, which lmstack feeds no videos") as err:
            check_data_args(vlm_cfg(base_cfg, tiled[family], family, tmp_path))
        assert why[family] in str(err.value) and "video input works with model types qwen2_vl" in str(err.value)


def test_a_wrong_template_names_the_family_template(tiled, base_cfg, tmp_path):
    write_dataset(tmp_path, [{"messages": _messages()[:2], "images": write_images(tmp_path, SIZES[:2])}])
    proc = processor_of(tiled["gemma3"], "gemma3")
    cfg = vlm_cfg(base_cfg, tiled["gemma3"], "gemma3", tmp_path, template="gemma")
    with pytest.raises(
        ConfigError,
        match="template: 'gemma' has no image support for this gemma3 model .* use template: gemma3",
    ):
        build_datasets(cfg, proc.tokenizer, get_template("gemma", proc.tokenizer))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_model_command_builds_the_family_and_the_planner_counts_it_whole(family, tmp_path):
    """`lmstack tiny-model DIR --vision gemma3|internvl`: the real classes, loaded offline; the planner's
    model spec counts every parameter (vision tower too) and reads the language model's dims."""
    from transformers import AutoModelForImageTextToText

    from lmstack.cli.main import main
    from lmstack.memory.model_spec import ModelSpec

    data = Path(__file__).resolve().parents[3] / "data"
    assert main(["tiny-model", str(tmp_path / "m"), "--vision", family, "--data-dir", str(data)]) == 0
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "m")
    names = {"gemma3": "Gemma3ForConditionalGeneration", "internvl": "InternVLForConditionalGeneration"}
    assert type(model).__name__ == names[family]
    spec = ModelSpec.from_pretrained_dir(tmp_path / "m")
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.num_layers == 2 and spec.hidden_size == 128


# the checkpoints' processor files (google/gemma-3-4b-it, OpenGVLab/InternVL3-1B-hf): the torchvision
# image processors' names, 896-pixel images / 448-pixel tiles, 256 tokens per image / tile
REAL_FILES = {
    "gemma3": (
        {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
         "do_pan_and_scan": None, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2},
        {"processor_class": "Gemma3Processor", "image_seq_length": 256},
    ),
    "internvl": (
        {"image_processor_type": "GotOcr2ImageProcessorFast", "size": {"height": 448, "width": 448},
         "crop_to_patches": False, "min_patches": 1, "max_patches": 12, "resample": 3,
         "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]},
        {"processor_class": "InternVLProcessor", "image_seq_length": 256},
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_real_checkpoints_processor_files_load_without_torchvision_and_count_its_tokens(
    family, tiled, tmp_path
):
    """Without torchvision transformers loads the PIL twin of the named image processor; with LF's
    option on, a 640 x 480 photo is 1 + 2 pan-and-scan crops of 256 tokens (Gemma 3: 320-pixel crops)
    or a 4 x 3 grid of tiles + a thumbnail of 256 tokens each (InternVL), as the processor cuts it."""
    import json
    import shutil

    from PIL import Image
    from transformers import AutoImageProcessor

    from lmstack.config.load import build_config
    from lmstack.data.mm import image_seqlen

    folder = tmp_path / family
    folder.mkdir()
    shutil.copyfile(tiled[family] / "config.json", folder / "config.json")
    image_file, processor_file = REAL_FILES[family]
    (folder / "preprocessor_config.json").write_text(json.dumps(image_file))
    (folder / "processor_config.json").write_text(json.dumps(processor_file))
    cfg = build_config(
        {"model_name_or_path": str(folder), "output_dir": str(tmp_path / "o"), FAMILIES[family]: True}
    )
    spec = media_spec(cfg)
    proc = AutoImageProcessor.from_pretrained(folder)
    assert (
        type(proc).__name__
        == {"gemma3": "Gemma3ImageProcessorPil", "internvl": "GotOcr2ImageProcessorPil"}[family]
    )
    blocks = {"gemma3": 3, "internvl": 13}[family]
    assert image_seqlen(640, 480, spec) == 256 * blocks
    out = proc(images=[Image.new("RGB", (640, 480))], **dict(spec.tiling))
    assert len(out["pixel_values"]) == blocks
