"""Preview data on a multimodal dataset (LF's mllm_demo / mllm_video_demo / mllm_audio_demo made on the
spot, tiny real vision / audio models): the example's images as small PNG thumbnails, its video's sampled
frames and first frame, its audio's duration and rates, and each item's tokens equal to the encoded
example's; a text-only dataset's preview has no media part."""

from __future__ import annotations

import base64
import io
import re

import pytest
from PIL import Image

from lmstack.webui.actions import example_html, preview_data
from media_files import demo_dir, image_demo_dir

THUMB = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


@pytest.fixture(scope="module")
def vision_models(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_vl")
    return {f: build_tiny_vision_model(root / f, f, data_dir=None) for f in ("qwen2_vl", "qwen3_vl", "qwen2_audio")}


def _flat(model, template, dataset, data_dir, out) -> dict:
    return {
        "model_name_or_path": str(model),
        "template": template,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "dataset": dataset,
        "dataset_dir": str(data_dir),
        "cutoff_len": 1024,
        "output_dir": str(out),
        "video_maxlen": 4,
    }


def _example_text(report_html: str) -> str:
    return "".join(re.findall(r'<span class="lm-(?:trained|masked)">(.*?)</span>', report_html, re.S))


def _thumbs(page: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(m))) for m in THUMB.findall(page)]


def test_image_example_shows_a_thumbnail_and_its_image_tokens(vision_models, tmp_path):
    data = image_demo_dir(tmp_path / "data")
    flat = _flat(vision_models["qwen2_vl"], "qwen2_vl", "mllm_demo", data, tmp_path / "out")
    text, page = preview_data(flat)
    thumbs = _thumbs(page)
    assert len(thumbs) == 1 and thumbs[0].format == "PNG" and max(thumbs[0].size) <= 128
    assert thumbs[0].getpixel((0, 0)) == (220, 30, 30)  # the first record's red picture
    tokens = _example_text(page).count("&lt;|image_pad|&gt;")  # what the encoder wrote for the example
    assert tokens > 0 and f"{tokens} image tokens" in page
    assert "images[0] 0.png: 64x48" in page
    assert "image tokens" in text  # check's own report is unchanged text


def test_video_example_shows_sampled_frames_first_frame_and_video_tokens(vision_models, tmp_path):
    from lmstack.data.mm_av import load_videos
    from lmstack.webui.media_view import media_spec_of

    data = demo_dir(tmp_path, "videos")
    flat = _flat(vision_models["qwen3_vl"], "qwen3_vl_nothink", "mllm_video_demo", data, tmp_path / "out")
    _, page = preview_data(flat)
    thumbs = _thumbs(page)
    assert len(thumbs) == 1 and max(thumbs[0].size) <= 128
    decoded = load_videos([str(data / "mllm_demo_data" / "0.mp4")], media_spec_of(flat))[0]
    assert 1 < decoded.sampled <= 4  # video_maxlen bounds the sampling
    assert f"{decoded.sampled} sampled frames ({len(decoded.frames)} fed to the model)" in page
    tokens = _example_text(page).count("&lt;|video_pad|&gt;")
    assert tokens > 0 and f"{tokens} video tokens" in page


def test_audio_example_shows_duration_rates_and_audio_tokens(vision_models, tmp_path):
    data = demo_dir(tmp_path, "audios")
    flat = _flat(vision_models["qwen2_audio"], "qwen2_audio", "mllm_audio_demo", data, tmp_path / "out")
    _, page = preview_data(flat)
    assert "<img" not in page
    tokens = _example_text(page).count("&lt;|AUDIO|&gt;")
    assert tokens > 0
    assert f"audios[0] 0.wav: 0.50 s at 16000 Hz (read at 16000 Hz), {tokens} audio tokens" in page


def test_text_only_preview_has_no_media_block(base_cfg):
    from lmstack.cli.check import run_check

    _, page = preview_data(base_cfg)
    assert "lm-media" not in page and "<img" not in page
    report, _ = run_check(None, dict(base_cfg))
    assert page == example_html(report["example"])
