"""dataset_info.json entries: multimodal columns (images, videos, audios) are read in every format, and a
model that cannot take them is refused by train's pre-flight, `check`, the in-memory pipeline and
streaming before a record is read."""

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
NO_VISION = "has images, but model_name_or_path"


@pytest.mark.parametrize("formatting", ["alpaca", "sharegpt", "openai"])
@pytest.mark.parametrize("key", ["images", "videos", "audios"])
def test_a_media_column_is_read_in_every_format(formatting, key, tmp_path):
    (tmp_path / "d.json").write_text("[]")
    entry = {"file_name": "d.json", "formatting": formatting, "columns": {key: "media"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mm": entry}))
    (attr,) = get_dataset_attrs("mm", tmp_path)
    assert attr.column(key) == "media"


def test_null_means_unmapped():
    """`"images": null` is LF's spelling of "no such column"; entries with videos / audios sit next to it."""
    (attr,) = get_dataset_attrs("images_unmapped", MM_DIR)
    assert attr.column("images") is None
    _, videos = get_dataset_attrs("images_unmapped,sharegpt_videos", MM_DIR)
    assert videos.column("videos") == "videos"


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
    expected = f"dataset {name} has {key}, but model_name_or_path"
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
