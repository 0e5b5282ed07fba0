"""Images in LF's multimodal datasets (data/mm.py): the tiny vision models, `<image>` expanded to the
image tokens exactly as the model's own processor writes them, and the record errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError, DataError
from lmstack.config.load import build_config
from lmstack.data.mm import load_image
from lmstack.data.pipeline import build_datasets
from lmstack.templates import get_template

# (width, height): one under the tiny Qwen2-VL's processor bounds, one over them (it downsizes), one
# wide; LLaVA's processor crops every image to 28 x 28
SIZES = [(40, 30), (300, 200), (120, 36)]
VISION_TEMPLATE = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl_nothink",
    "qwen3_vl_moe": "qwen3_vl",
    "llava": "llava",
    "gemma3": "gemma3",
    "internvl": "intern_vl",
}
# the text each family's processor expands into one image's tokens
RAW_IMAGE = {"llava": "<image>", "gemma3": "<start_of_image>", "internvl": "<IMG_CONTEXT>"}
IMAGE_TOKEN = {"llava": "<image>", "gemma3": "<image_soft_token>", "internvl": "<IMG_CONTEXT>"}
# LF's defaults of the tiling options, said to the processor (InternVLProcessor crops unless told not to)
LF_OFF = {"internvl": {"crop_to_patches": False}, "gemma3": {"do_pan_and_scan": False}}
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_vlm")
    data = Path(__file__).resolve().parents[3] / "data"
    return {f: build_tiny_vision_model(root / f, f, data_dir=data) for f in VISION_TEMPLATE}


def write_images(folder: Path, sizes=SIZES) -> list[str]:
    from PIL import Image

    (folder / "imgs").mkdir(parents=True, exist_ok=True)
    names = []
    for i, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), ((50 * i) % 256, 100, 200 - 40 * i)).save(folder / "imgs" / f"{i}.png")
        names.append(f"imgs/{i}.png")
    return names


def write_dataset(folder: Path, records: list[dict], formatting: str = "sharegpt") -> None:
    columns = {"messages": "messages", "images": "images"} if formatting != "alpaca" else {"images": "images"}
    entry = {"file_name": "mm.json", "formatting": formatting, "columns": columns}
    if formatting == "sharegpt":
        entry["tags"] = {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        }
    (folder / "dataset_info.json").write_text(json.dumps({"mm": entry}))
    (folder / "mm.json").write_text(json.dumps(records))


def vlm_cfg(base_cfg, model: Path, family: str, folder: Path, **overrides):
    return build_config(
        {
            **base_cfg,
            "model_name_or_path": str(model),
            "template": VISION_TEMPLATE[family],
            "dataset": "mm",
            "dataset_dir": str(folder),
            "cutoff_len": 512,
            **overrides,
        }
    )


def processor_of(model: Path, family: str):
    """The model's own processor: AutoProcessor; without torchvision (the Qwen-VLs' video processors
    need it) the same processor class (Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor), holding
    the tokenizer and the PIL image processor: its own __call__ expands and tokenizes the images."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(model)
    except (ImportError, ValueError):  # InternVL's video processor: "requires `torchvision`" (a ValueError)
        if family == "internvl":
            return internvl_processor(model)
        from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

        tok = AutoTokenizer.from_pretrained(model)
        cls = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}.get(
            family.removesuffix("_moe"), Qwen2VLProcessor
        )
        assert json.loads((model / "processor_config.json").read_text())["processor_class"] == cls.__name__
        proc = cls.__new__(cls)
        proc.tokenizer, proc.image_processor, proc.video_processor = (
            tok,
            AutoImageProcessor.from_pretrained(model),
            None,
        )
        proc.image_token, proc.video_token, proc.chat_template = "<|image_pad|>", "<|video_pad|>", None
        proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        for name in ("image", "video", "vision_start", "vision_end"):
            setattr(proc, f"{name}_token_id", tok.convert_tokens_to_ids(getattr(proc, f"{name}_token")))
        return proc


def internvl_processor(model: Path):
    """InternVLProcessor without its video processor (InternVLVideoProcessor needs torchvision): the
    attributes its __init__ sets from the tokenizer's named tokens, with the PIL image processor."""
    import re

    from transformers import AutoImageProcessor, AutoTokenizer, InternVLProcessor

    tok = AutoTokenizer.from_pretrained(model)
    assert json.loads((model / "processor_config.json").read_text())["processor_class"] == "InternVLProcessor"
    proc = InternVLProcessor.__new__(InternVLProcessor)
    proc.tokenizer, proc.image_processor, proc.video_processor, proc.chat_template = (
        tok, AutoImageProcessor.from_pretrained(model), None, None,
    )  # fmt: skip
    proc.image_seq_length = json.loads((model / "processor_config.json").read_text())["image_seq_length"]
    proc.start_image_token, proc.end_image_token = tok.start_image_token, tok.end_image_token
    proc.start_image_token_id, proc.end_image_token_id = tok.start_image_token_id, tok.end_image_token_id
    proc.image_token, proc.image_token_id, proc.video_token = tok.context_image_token, tok.context_image_token_id, tok.video_token
    proc.multimodal_pattern = re.compile(f"(?P<image>{re.escape(proc.image_token)})|(?P<video>{re.escape(proc.video_token)})")
    return proc


def test_tiny_vision_models_load_offline_through_the_auto_classes(tiny_vlm):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    expected = {
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
        "llava": "LlavaForConditionalGeneration",
        "gemma3": "Gemma3ForConditionalGeneration",
        "internvl": "InternVLForConditionalGeneration",
    }
    for family, path in tiny_vlm.items():
        model = AutoModelForImageTextToText.from_pretrained(path)
        assert type(model).__name__ == expected[family]
        tok = AutoTokenizer.from_pretrained(path)
        assert model.config.image_token_id == tok.convert_tokens_to_ids(IMAGE_TOKEN.get(family, "<|image_pad|>"))
        assert AutoImageProcessor.from_pretrained(path) is not None
    for family, name in (("llava", "LlavaProcessor"), ("gemma3", "Gemma3Processor")):
        assert type(AutoProcessor.from_pretrained(tiny_vlm[family])).__name__ == name
    tok = AutoTokenizer.from_pretrained(tiny_vlm["gemma3"])  # the named tokens Gemma3Processor reads
    assert (tok.boi_token, tok.image_token, tok.eoi_token) == ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


@pytest.mark.parametrize("family", list(VISION_TEMPLATE))
def test_image_tokens_are_where_the_processor_puts_them_and_are_prompt(family, tiny_vlm, base_cfg, tmp_path):
    images = write_images(tmp_path)
    messages = [
        {"role": "user", "content": "Compare <image> and <image>, please."},
        {"role": "assistant", "content": "The first is smaller."},
        {"role": "user", "content": "And this one?<image>"},
        {"role": "assistant", "content": "It is wide."},
    ]
    write_dataset(tmp_path, [{"messages": messages, "images": images}])
    cfg = vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path)
    proc = processor_of(tiny_vlm[family], family)
    template = get_template(VISION_TEMPLATE[family], proc.tokenizer)
    sample = build_datasets(cfg, proc.tokenizer, template).train[0]

    raw = RAW_IMAGE.get(family, "<|vision_start|><|image_pad|><|vision_end|>")
    text = template.render(
        [dict(m, content=m["content"].replace("<image>", raw)) for m in messages],
        template.default_system,
        proc.tokenizer,
    )
    spec_images = [load_image(str(tmp_path / p), _spec(cfg)) for p in images]
    expected = proc(text=[text], images=spec_images, **LF_OFF.get(family, {}))["input_ids"][0]
    assert sample["input_ids"] == list(expected)
    image_id = proc.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN.get(family, "<|image_pad|>"))
    at = [i for i, t in enumerate(sample["input_ids"]) if t == image_id]
    assert len(at) > len(images)  # expanded, not one token per image
    assert all(sample["labels"][i] == -100 for i in at)
    assert any(lbl != -100 for lbl in sample["labels"])  # the answers are trained
    assert json.loads(sample["images"]) == [str(tmp_path / p) for p in images]


def _spec(cfg):
    from lmstack.data.mm import media_spec

    return media_spec(cfg)


# (family, image tokens of a 300x200 image capped at 100 pixels, uncapped; of a 40x30 image with
# image_min_pixels 10000, without): the tiny Qwen2-VLs cut 14-pixel patches within 56x56 .. 112x112
# pixels, the tiny Qwen3-VLs 16-pixel patches within 64x64 .. 128x128, both merged 2 x 2
PIXEL_BOUNDS = [
    ("qwen2_vl", 4, 12, 12, 6),  # 28x28 -> 56x56; 300x200 -> 112x84; 115x86 -> 112x84; 40x30 -> 84x56
    ("qwen2_5_vl", 4, 12, 12, 6),
    ("qwen3_vl", 4, 12, 12, 6),  # 28x28 -> 64x64; 300x200 -> 128x96; 115x86 -> 128x96; 40x30 -> 96x64
    ("qwen3_vl_moe", 4, 12, 12, 6),
]


@pytest.mark.parametrize("family,capped,uncapped,raised,unraised", PIXEL_BOUNDS)
def test_image_max_and_min_pixels_resize_before_the_processor(
    family, capped, uncapped, raised, unraised, tiny_vlm, base_cfg, tmp_path
):
    """LF's image_max_pixels: a 300x200 image with a 100-pixel cap is first resized to 12x8, then raised
    to 28 pixels a side (LF's Qwen-VL rule), and the processor's minimum gives 2x2 merged tokens.
    image_min_pixels: a 40x30 image raised to 10000 pixels is 115x86 before the processor."""
    from lmstack.data.mm import image_sizes

    def pads(images, **bounds) -> int:
        write_dataset(tmp_path, [{"messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "ok"}], "images": images}])  # fmt: skip
        cfg = vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path, overwrite_cache=True, **bounds)
        proc = processor_of(tiny_vlm[family], family)
        template = get_template(VISION_TEMPLATE[family], proc.tokenizer)
        sample = build_datasets(cfg, proc.tokenizer, template).train[0]
        images = [load_image(str(tmp_path / p), _spec(cfg)) for p in images]
        grid = proc.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        assert sample["input_ids"].count(proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == int(
            grid.prod(-1).sum()
        ) // 4  # the processor's own count for the resized image
        return sample["input_ids"].count(proc.tokenizer.convert_tokens_to_ids("<|image_pad|>"))

    (big,) = write_images(tmp_path, [(300, 200)])
    cfg = vlm_cfg(
        base_cfg, tiny_vlm[family], family, tmp_path, image_max_pixels=100, image_min_pixels=10
    )
    assert image_sizes([str(tmp_path / big)], _spec(cfg)) == [(28, 28)]
    assert pads([big], image_max_pixels=100, image_min_pixels=10) == capped
    assert pads([big]) == uncapped
    small = write_images(tmp_path / "small", [(40, 30)])
    small = [f"small/{p}" for p in small]
    cfg = vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path, image_min_pixels=10000)
    assert image_sizes([str(tmp_path / small[0])], _spec(cfg)) == [(115, 86)]
    assert pads(small, image_min_pixels=10000) == raised
    assert pads(small) == unraised


@pytest.mark.parametrize("formatting", ["alpaca", "openai"])
def test_alpaca_and_openai_records_carry_images_too(formatting, tiny_vlm, base_cfg, tmp_path):
    images = write_images(tmp_path, [(40, 30)])
    if formatting == "alpaca":
        record = {"instruction": "<image>What colour?", "output": "Blue.", "images": images}
    else:
        record = {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Blue."}], "images": images}  # fmt: skip
    write_dataset(tmp_path, [record], formatting)
    cfg = vlm_cfg(base_cfg, tiny_vlm["llava"], "llava", tmp_path)
    proc = processor_of(tiny_vlm["llava"], "llava")
    sample = build_datasets(cfg, proc.tokenizer, get_template("llava", proc.tokenizer)).train[0]
    assert sample["input_ids"].count(proc.tokenizer.convert_tokens_to_ids("<image>")) == 4  # (28 / 14)^2


def _one(content: str, images) -> dict:
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}],
        "images": images,
    }


@pytest.mark.parametrize(
    "content,images,reason",
    [
        ("no placeholder", ["imgs/0.png"], "0 <image> placeholder(s) in the messages but 1 image(s) in images"),
        ("<image><image>two", ["imgs/0.png"], "2 <image> placeholder(s) in the messages but 1 image(s)"),
        ("<image>", ["../outside.png"], "images[0]: media outside dataset_dir: '../outside.png' resolves to"),
        ("<image>", ["imgs/nope.png"], "images[0]: missing media file: 'imgs/nope.png': no such file"),
        ("<image>", ["https://example.com/a.png"], "images[0]: media URL: 'https://example.com/a.png': lmstack reads no network"),
    ],
)  # fmt: skip
def test_media_problems_stop_the_run_naming_file_record_and_counts(
    content, images, reason, tiny_vlm, base_cfg, tmp_path
):
    write_images(tmp_path, [(40, 30)])
    (tmp_path.parent / "outside.png").write_bytes((tmp_path / "imgs" / "0.png").read_bytes())
    write_dataset(tmp_path, [_one("<image>fine", ["imgs/0.png"]), _one(content, images)])
    cfg = vlm_cfg(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", tmp_path)
    proc = processor_of(tiny_vlm["qwen2_vl"], "qwen2_vl")
    with pytest.raises(DataError) as err:
        build_datasets(cfg, proc.tokenizer, get_template("qwen2_vl", proc.tokenizer))
    msg = str(err.value)
    assert msg.startswith("dataset mm: 1 record(s) with media problems:")
    assert f"{tmp_path / 'mm.json'} record 1: images" in msg  # the second record (0-based index 1)
    assert reason in msg


def test_a_record_whose_image_tokens_cutoff_len_would_cut_is_dropped(tiny_vlm, base_cfg, tmp_path):
    images = write_images(tmp_path, [(300, 200)])  # 12 image tokens
    write_dataset(tmp_path, [_one("<image>" + " word" * 40, images), _one("short", [])])
    cfg = vlm_cfg(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", tmp_path, cutoff_len=24)
    proc = processor_of(tiny_vlm["qwen2_vl"], "qwen2_vl")
    bundle = build_datasets(cfg, proc.tokenizer, get_template("qwen2_vl", proc.tokenizer))
    assert len(bundle.train) == 1 and json.loads(bundle.train[0]["images"]) == []
    assert bundle.stats[0].dropped["image tokens cut by cutoff_len"] == 1


def test_images_need_a_vision_model_its_template_sft_and_no_packing(tiny_vlm, base_cfg, tiny_model, tmp_path):
    images = write_images(tmp_path, [(40, 30)])
    write_dataset(tmp_path, [_one("<image>hi", images)])
    proc = processor_of(tiny_vlm["qwen2_vl"], "qwen2_vl")
    text_model = vlm_cfg(base_cfg, tiny_model, "qwen2_vl", tmp_path)
    with pytest.raises(DataError, match="dataset mm has images, but model_name_or_path .* is a qwen2 model"):
        build_datasets(text_model, proc.tokenizer, get_template("qwen2_vl", proc.tokenizer))
    cfg = vlm_cfg(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", tmp_path, template="qwen")
    with pytest.raises(ConfigError, match="template: 'qwen' has no image support for this qwen2_vl model"):
        build_datasets(cfg, proc.tokenizer, get_template("qwen", proc.tokenizer))
    cfg = vlm_cfg(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", tmp_path, template="qwen3_vl")
    with pytest.raises(ConfigError, match="template: 'qwen3_vl' writes images for qwen3_vl, not for this"):
        build_datasets(cfg, proc.tokenizer, get_template("qwen3_vl", proc.tokenizer))
    cfg = vlm_cfg(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", tmp_path, packing=True)
    with pytest.raises(
        ConfigError, match="packing: not available with the vision model .* its 3D rope positions"
    ):
        build_datasets(cfg, proc.tokenizer, get_template("qwen2_vl", proc.tokenizer))
    cfg = vlm_cfg(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", tmp_path, image_max_pixels=10)
    with pytest.raises(ConfigError, match="image_max_pixels: got 10, less than image_min_pixels 1024"):
        build_datasets(cfg, proc.tokenizer, get_template("qwen2_vl", proc.tokenizer))


def test_check_reports_images_their_sizes_and_image_tokens(tiny_vlm, base_cfg, tmp_path):
    from lmstack.data.validate import check_data, format_report

    images = write_images(tmp_path, [(40, 30), (300, 200)])
    write_dataset(tmp_path, [_one("<image><image>two", images), _one("none", [])])
    cfg = vlm_cfg(base_cfg, tiny_vlm["qwen2_vl"], "qwen2_vl", tmp_path)
    proc = processor_of(tiny_vlm["qwen2_vl"], "qwen2_vl")
    report = check_data(cfg, proc.tokenizer, get_template("qwen2_vl", proc.tokenizer))
    media = report["datasets"][0]["media"]
    # the processor's smart_resize: 40x30 -> 84x56 (its 56x56-pixel minimum) = 6 x 4 patches / 2^2 = 6
    # tokens; 300x200 -> 112x84 (its 112x112-pixel maximum) = 8 x 6 / 2^2 = 12 tokens
    assert media == {
        "images": 2,
        "samples_with_images": 1,
        "resized": ["40x30", "300x200"],
        "model_input": ["84x56", "112x84"],
        "image_tokens": 18,
        "image_tokens_per_image": {"min": 6, "max": 12},
    }
    assert report["datasets"][0]["lengths"]["prompt"]["max"] > 16  # the vision tokens are prompt tokens
    text = format_report(report)
    assert (
        "images: 2 in 1 samples, resized to 40x30 .. 300x200 px (model input 84x56 .. 112x84), 18 image tokens"
        in text
    )


def test_image_pixel_bounds_on_a_text_model_say_they_have_no_effect(base_cfg, tiny_model, caplog):
    from lmstack.data.pipeline import check_data_args

    cfg = build_config({**base_cfg, "image_max_pixels": 4096})
    with caplog.at_level("WARNING", logger="lmstack.data.mm"):
        check_data_args(cfg)
    assert f"image_max_pixels: no effect on the text model {tiny_model}" in caplog.text


def test_tiny_model_command_builds_a_vision_model(tmp_path):
    from transformers import AutoModelForImageTextToText

    from lmstack.cli.main import main

    data = Path(__file__).resolve().parents[3] / "data"
    assert main(["tiny-model", str(tmp_path / "vlm"), "--vision", "qwen2_5_vl", "--data-dir", str(data)]) == 0
    assert (
        type(AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm")).__name__
        == "Qwen2_5_VLForConditionalGeneration"
    )
    assert (tmp_path / "vlm" / "preprocessor_config.json").is_file()


@pytest.mark.parametrize(
    "field,owner",
    [("image_do_pan_and_scan", "Gemma 3's pan-and-scan crops"), ("crop_to_patches", "InternVL's tiling")],
)
@pytest.mark.parametrize("family", ["qwen3_vl", "llava"])
def test_image_options_of_other_families_are_refused_by_name_when_on(
    field, owner, family, tiny_vlm, base_cfg, tmp_path
):
    from lmstack.data.pipeline import check_data_args

    write_dataset(tmp_path, [_one("<image>hi", write_images(tmp_path, [(40, 30)]))])
    check_data_args(vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path, **{field: False}))  # LF's default
    cfg = vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path, **{field: True})
    with pytest.raises(ConfigError) as err:
        check_data_args(cfg)
    msg = str(err.value)
    assert msg.startswith(f"{field}: true is {owner}")
    assert f"this {family} model has no such option" in msg and f"set {field}: false" in msg


def test_video_fields_are_validated_and_apply_to_videos_only(tiny_vlm, base_cfg, tmp_path, caplog):
    """LF's qwen3vl examples set video_max_pixels with image data only: accepted silently, as Qwen3-VL reads
    videos (they apply to them: data/media_video_qwen3.py); bad values are refused by name; a `videos`
    column is accepted for it."""
    from lmstack.data.pipeline import check_data_args

    write_dataset(tmp_path, [_one("<image>hi", write_images(tmp_path, [(40, 30)]))])
    family = "qwen3_vl"
    cfg = vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path, video_max_pixels=16384, video_fps=1.0)
    assert (cfg.data.video_max_pixels, cfg.data.video_fps, cfg.data.video_maxlen) == (16384, 1.0, 128)
    with caplog.at_level("INFO", logger="lmstack.data.mm"):
        check_data_args(cfg)
    assert "no effect on" not in caplog.text
    for bad, reason in [
        ({"video_max_pixels": 100}, "video_max_pixels: got 100, less than video_min_pixels 256"),
        ({"video_fps": 0}, "video_fps"),
        ({"video_maxlen": -1}, "video_maxlen"),
    ]:
        with pytest.raises(ConfigError, match=reason):
            vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path, **bad)
    entry = json.loads((tmp_path / "dataset_info.json").read_text())
    entry["mm"]["columns"]["videos"] = "videos"
    (tmp_path / "dataset_info.json").write_text(json.dumps(entry))
    check_data_args(cfg)  # Qwen3-VL takes the videos column


def test_a_real_qwen3_vl_processor_config_loads_without_torchvision_and_counts_its_tokens(tiny_vlm, tmp_path):
    """Qwen3-VL checkpoints name the fast (torchvision) Qwen2-VL image processor; without torchvision
    transformers loads its PIL twin from the same file. With LF's image_max_pixels 262144 a 640x480
    photo is 591x443, the processor's smart_resize (16-pixel patches merged 2 x 2, at least 65536
    pixels) makes it 576x448: 36 x 28 patches, 252 image tokens, as the processor's own grid says."""
    import shutil

    from PIL import Image

    from lmstack.data.mm import image_seqlen, media_spec, model_input_size, regularized_size

    folder = tmp_path / "qwen3_vl_4b"
    folder.mkdir()
    shutil.copyfile(tiny_vlm["qwen3_vl"] / "config.json", folder / "config.json")
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
    }))  # fmt: skip
    from lmstack.config.load import build_config

    cfg = build_config({"model_name_or_path": str(folder), "output_dir": str(tmp_path / "o"), "image_max_pixels": 262144})
    spec = media_spec(cfg)
    assert (spec.plugin, spec.patch_size, spec.merge_size, spec.min_pixels) == ("qwen3_vl", 16, 2, 65536)
    size = regularized_size(640, 480, spec)
    assert size == (591, 443) and model_input_size(*size, spec) == (576, 448)
    assert image_seqlen(*size, spec) == 252
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(folder)
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil"
    image = Image.new("RGB", (640, 480), (10, 120, 200)).resize(size)
    assert proc(images=[image], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 28, 36]]


@pytest.mark.parametrize("family", QWEN_VL)
def test_the_collated_pixels_and_token_types_are_the_processors_own(family, tiny_vlm, base_cfg, tmp_path):
    """The batch the model gets equals the family's processor output for the same text and images:
    pixel_values, image_grid_thw and, where the processor writes them, mm_token_type_ids."""
    import torch

    from lmstack.data.mm_collate import MediaCollator

    images = write_images(tmp_path)
    messages = [{"role": "user", "content": "<image>One <image>two <image>three"}, {"role": "assistant", "content": "ok"}]
    write_dataset(tmp_path, [{"messages": messages, "images": images}])
    cfg = vlm_cfg(base_cfg, tiny_vlm[family], family, tmp_path)
    proc = processor_of(tiny_vlm[family], family)
    template = get_template(VISION_TEMPLATE[family], proc.tokenizer)
    sample = build_datasets(cfg, proc.tokenizer, template).train[0]
    spec = _spec(cfg)
    image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = MediaCollator(proc.tokenizer.pad_token_id, spec, proc.image_processor, image_id)([sample])
    raw = "<|vision_start|><|image_pad|><|vision_end|>"
    text = template.render(
        [dict(m, content=m["content"].replace("<image>", raw)) for m in messages],
        template.default_system,
        proc.tokenizer,
    )
    ref = proc(text=[text], images=[load_image(str(tmp_path / p), spec) for p in images], return_tensors="pt")
    assert batch["input_ids"][0].tolist() == ref["input_ids"][0].tolist()
    assert torch.equal(batch["pixel_values"], ref["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], ref["image_grid_thw"])
    if family.startswith("qwen3_vl"):  # Qwen3VLProcessor writes them; the model's rope index reads them
        assert batch["mm_token_type_ids"].tolist() == ref["mm_token_type_ids"].tolist()
        assert int(batch["mm_token_type_ids"].sum()) == int(ref["image_grid_thw"].prod(-1).sum()) // 4
