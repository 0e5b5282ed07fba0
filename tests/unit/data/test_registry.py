"""dataset_info.json entries: multimodal columns are refused where the entry is parsed, so train's
pre-flight, `check`, the in-memory pipeline and streaming all refuse them before a record is read."""

from __future__ import annotations

import json
import re

import pytest
from _data_helpers import REPO

from lmstack.config.errors import DataError
from lmstack.data.pipeline import build_datasets
from lmstack.data.registry import get_dataset_attrs
from lmstack.data.validate import check_data

MM_DIR = REPO / "tests" / "fixtures" / "multimodal"
REFUSED = "input is not available in lmstack (images are, with Qwen2-VL / Qwen2.5-VL / Qwen3-VL / LLaVA)"
NO_VISION = "has images, but model_name_or_path"


@pytest.mark.parametrize("formatting", ["alpaca", "sharegpt", "openai"])
@pytest.mark.parametrize("key", ["videos", "audios"])
def test_a_mapped_video_or_audio_column_is_refused_in_every_format(formatting, key, tmp_path):
    (tmp_path / "d.json").write_text("[]")
    entry = {"file_name": "d.json", "formatting": formatting, "columns": {key: f"my_{key}"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mm": entry}))
    with pytest.raises(DataError) as err:
        get_dataset_attrs("mm", tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"dataset mm: columns.{key} = 'my_{key}': {key[:-1]} {REFUSED}")
    assert f"remove the column from {tmp_path / 'dataset_info.json'}" in msg


@pytest.mark.parametrize("formatting", ["alpaca", "sharegpt", "openai"])
def test_an_images_column_is_read_in_every_format(formatting, tmp_path):
    (tmp_path / "d.json").write_text("[]")
    entry = {"file_name": "d.json", "formatting": formatting, "columns": {"images": "pics"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mm": entry}))
    (attr,) = get_dataset_attrs("mm", tmp_path)
    assert attr.column("images") == "pics"


def test_a_hub_dataset_with_videos_is_refused_without_touching_the_hub(tmp_path):
    entry = {"hf_hub_url": "org/some-vlm-data", "formatting": "sharegpt", "columns": {"videos": "videos"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"vlm": entry}))
    with pytest.raises(DataError, match=r"dataset vlm: columns.videos = 'videos': video input is not"):
        get_dataset_attrs("vlm", tmp_path)


def test_only_the_named_entries_are_refused_and_null_means_unmapped():
    """A registry may hold multimodal entries next to text ones; naming a text one works, and
    `"images": null` is LF's spelling of "no such column"."""
    (attr,) = get_dataset_attrs("images_unmapped", MM_DIR)
    assert attr.column("images") is None
    with pytest.raises(DataError, match=r"dataset sharegpt_videos: columns.videos = 'videos': video input"):
        get_dataset_attrs("images_unmapped,sharegpt_videos", MM_DIR)


@pytest.mark.parametrize(
    "name,key", [("mllm_demo", "images"), ("sharegpt_videos", "videos"), ("openai_audios", "audios")]
)
@pytest.mark.parametrize("streaming", [False, True])
def test_pipeline_and_streaming_refuse_before_a_record_is_read(
    name, key, streaming, make_cfg, tiny_tokenizer, qwen, monkeypatch
):
    import lmstack.data.pipeline as pipeline
    import lmstack.data.streaming as streaming_mod

    def no_read(*args, **kwargs):
        raise AssertionError("no record may be read from a refused dataset")

    monkeypatch.setattr(pipeline, "read_records", no_read)
    monkeypatch.setattr(streaming_mod, "read_records", no_read)
    cfg = make_cfg(dataset=name, dataset_dir=str(MM_DIR), streaming=streaming, max_steps=2)
    expected = f"dataset {name} {NO_VISION}" if key == "images" else f"columns.{key} = '{key}': {key[:-1]} "
    with pytest.raises(DataError, match=re.escape(expected)):
        build_datasets(cfg, tiny_tokenizer, qwen)


def test_check_refuses_an_eval_dataset_before_tokenizing_the_training_one(
    make_cfg, tiny_tokenizer, qwen, monkeypatch
):
    import lmstack.data.pipeline as pipeline

    def no_read(*args, **kwargs):
        raise AssertionError("no record may be read before every entry is accepted")

    monkeypatch.setattr(pipeline, "read_records", no_read)
    cfg = make_cfg(dataset="images_unmapped", eval_dataset="alpaca_images", dataset_dir=str(MM_DIR))
    with pytest.raises(DataError, match=f"dataset alpaca_images {NO_VISION}"):
        check_data(cfg, tiny_tokenizer, qwen)
