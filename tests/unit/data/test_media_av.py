"""Videos (data/media_video.py) and audio (data/media_audio.py) of LF's multimodal datasets: LF's frame
sampling and audio loading, lmstack's own Qwen2-VL video patches against transformers' Qwen2-VL image
processor frame by frame, Qwen2-Audio's ids against its own processor, media tokens never cut, and the
refusals that name what to change."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lmstack.config.errors import ConfigError, DataError
from lmstack.config.load import build_config
from lmstack.data.media_video import VideoSpec, patchify, sample_indices
from lmstack.data.pipeline import build_datasets
from lmstack.templates import get_template
from media_files import TAGS, demo_dir, write_audio, write_video


@pytest.fixture(scope="module")
def tiny_media(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_media")
    data = Path(__file__).resolve().parents[3] / "data"
    return {f: build_tiny_vision_model(root / f, f, data_dir=data) for f in ("qwen2_vl", "qwen2_audio")}


def media_cfg(base_cfg, model: Path, data: Path, kind: str, **over):
    return build_config(
        {
            **base_cfg,
            "model_name_or_path": str(model),
            "template": "qwen2_vl" if kind == "videos" else "qwen2_audio",
            "dataset": f"mllm_{kind[:-1]}_demo",
            "dataset_dir": str(data),
            "cutoff_len": 512,
            **over,
        }
    )


def tokenizer_of(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# ---- LF's frame sampling -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "frames,duration,fps,maxlen,expected",
    [
        (20, 5.0, 2.0, 128, list(np.linspace(0, 19, 10).astype(np.int32))),  # floor(5 x 2) = 10
        (20, 5.0, 2.0, 4, [0, 6, 12, 19]),  # video_maxlen caps it
        (3, 10.0, 2.0, 128, [0, 1, 2]),  # never more than the stream has
        (10, 0.2, 2.0, 128, [0]),  # at least one
        (10, None, 2.0, 4, [0, 3, 6, 9]),  # no duration: min(frames, video_maxlen)
        (0, 3.0, 2.0, 5, [0, 1, 2, 3, 4]),  # a stream without a frame count: the first video_maxlen
    ],
)
def test_frames_are_sampled_as_llamafactory_samples_them(frames, duration, fps, maxlen, expected):
    assert sample_indices(frames, duration, fps, maxlen) == [int(i) for i in expected]


def test_a_decoded_video_has_lf_frame_count_doubled_to_even_and_lf_pixel_bounds(tmp_path):
    from lmstack.data.media_video import decode_video

    path = write_video(tmp_path / "v.mp4", frames=12, size=(80, 60), fps=4)  # 3 s
    spec = VideoSpec(fps=1.0, maxlen=128, max_pixels=40 * 30, min_pixels=16, proc_min_pixels=16,
                     proc_max_pixels=10**6)  # fmt: skip
    decoded = decode_video(str(path), spec, lambda im: im.resize((40, 30)))
    assert decoded.sampled == 3 and len(decoded.frames) == 4  # floor(3 s x 1 fps) = 3, odd: last doubled
    assert (
        decoded.frames[3] is decoded.frames[2] or decoded.frames[3].tobytes() == decoded.frames[2].tobytes()
    )
    assert decoded.duration_s == pytest.approx(3.0, abs=0.3)
    assert all(f.size == (40, 30) for f in decoded.frames)


# ---- patches: equal to transformers' Qwen2-VL image processor, frame by frame ---------------------------
@pytest.mark.parametrize("size", [(70, 90), (200, 50), (30, 30)])
def test_video_patches_equal_the_image_processor_frame_by_frame(size):
    """The image processor repeats one image over the temporal patch; a video patch holds frame 2k in
    slot 0 and frame 2k+1 in slot 1, each equal to that frame's image patch, in the same spatial order,
    and the grid is (frames / 2, image grid h, image grid w)."""
    from PIL import Image

    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(6)]
    spec = VideoSpec(fps=2, maxlen=8, max_pixels=10**6, min_pixels=1, proc_min_pixels=56 * 56,
                     proc_max_pixels=112 * 112)  # fmt: skip
    pixels, grid = patchify(frames, spec)
    ip = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    per_frame = [ip(images=[f], return_tensors="np") for f in frames]
    _, h, w = per_frame[0]["image_grid_thw"][0]
    assert grid == (3, h, w) and pixels.shape == (3 * h * w, 3 * 2 * 14 * 14)
    video = pixels.reshape(3, h * w, 3, 2, 14, 14)
    for k in range(3):
        for slot in range(2):
            image = per_frame[2 * k + slot]["pixel_values"].reshape(h * w, 3, 2, 14, 14)[:, :, 0]
            np.testing.assert_array_equal(video[k, :, :, slot], image)


def test_an_odd_frame_count_repeats_the_last_frame_as_the_video_processor_does():
    from PIL import Image

    frames = [Image.new("RGB", (56, 56), (10 * i, 50, 90)) for i in range(3)]
    spec = VideoSpec(fps=2, maxlen=8, max_pixels=10**6, min_pixels=1, proc_min_pixels=56 * 56,
                     proc_max_pixels=112 * 112)  # fmt: skip
    odd, grid = patchify(frames, spec)
    even, _ = patchify([*frames, frames[-1]], spec)
    assert grid[0] == 2
    np.testing.assert_array_equal(odd, even)


# ---- the dataset path: tokens, drops, refusals ------------------------------------------------------------
def test_video_tokens_match_the_grid_the_collator_feeds(tiny_media, base_cfg, tmp_path):
    from lmstack.data.media_video import video_seqlen
    from lmstack.data.mm import media_spec
    from lmstack.data.mm_av_collate import media_collator
    from lmstack.models.vision import load_image_processor

    data = demo_dir(tmp_path, "videos")
    cfg = media_cfg(base_cfg, tiny_media["qwen2_vl"], data, "videos", video_maxlen=4)
    tok = tokenizer_of(tiny_media["qwen2_vl"])
    bundle = build_datasets(cfg, tok, get_template("qwen2_vl", tok))
    assert len(bundle.train) == 3
    spec = media_spec(cfg)
    batch = media_collator(cfg, tok, spec, load_image_processor)([bundle.train[i] for i in range(3)])
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    grids = batch["video_grid_thw"].tolist()
    assert [int((row == video_id).sum()) for row in batch["input_ids"]] == [
        video_seqlen(g, spec.video) for g in grids
    ]
    # 1.25 s, 1.75 s, 2.25 s at video_fps 2: 2, 3 (doubled to 4), 4 frames (video_maxlen 4) -> 1, 2, 2
    assert [g[0] for g in grids] == [1, 2, 2]
    assert batch["pixel_values_videos"].shape[0] == sum(math.prod(g) for g in grids)
    assert set(batch["mm_token_type_ids"][batch["input_ids"] == video_id].tolist()) == {2}
    sample = bundle.train[0]
    at = [i for i, t in enumerate(sample["input_ids"]) if t == video_id]
    assert at and all(sample["labels"][i] == -100 for i in at)
    assert json.loads(sample["videos"]) == [str((data / "mllm_demo_data" / "0.mp4").resolve())]


def test_a_record_whose_video_tokens_cutoff_len_would_cut_is_dropped_and_counted(
    tiny_media, base_cfg, tmp_path
):
    data = demo_dir(tmp_path, "videos")
    cfg = media_cfg(base_cfg, tiny_media["qwen2_vl"], data, "videos", cutoff_len=40)
    tok = tokenizer_of(tiny_media["qwen2_vl"])
    bundle = build_datasets(cfg, tok, get_template("qwen2_vl", tok))
    assert bundle.stats[0].dropped["video tokens cut by cutoff_len"] == 2  # 12 video tokens each: cut at 40
    assert len(bundle.train) == 1 and json.loads(bundle.train[0]["videos"])[0].endswith("0.mp4")


def test_video_min_pixels_bounds_the_frames_before_the_processor(tiny_media, base_cfg, tmp_path):
    data = demo_dir(tmp_path, "videos")
    tok = tokenizer_of(tiny_media["qwen2_vl"])
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")

    def tokens(**over) -> int:
        cfg = media_cfg(base_cfg, tiny_media["qwen2_vl"], data, "videos", video_maxlen=2, overwrite_cache=True,
                        **over)  # fmt: skip
        sample = build_datasets(cfg, tok, get_template("qwen2_vl", tok)).train[2]
        return sum(t == video_id for t in sample["input_ids"])

    # 96 x 48 frames: 84 x 56 model input, 6 tokens; upscaled to >= 150 x 150 pixels first (212 x 106),
    # the processor caps them at 112 x 112 pixels: 140 x 56, 10 tokens
    assert tokens() == 6 and tokens(video_min_pixels=150 * 150) == 10


def _records(tmp_path: Path, kind: str, records: list[dict]) -> Path:
    (tmp_path / "d.json").write_text(json.dumps(records))
    entry = {"file_name": "d.json", "formatting": "sharegpt", "tags": TAGS,
             "columns": {"messages": "messages", kind: kind}}  # fmt: skip
    (tmp_path / "dataset_info.json").write_text(json.dumps({f"mllm_{kind[:-1]}_demo": entry}))
    return tmp_path


def test_video_count_mismatch_and_missing_files_stop_the_run_naming_them(tiny_media, base_cfg, tmp_path):
    write_video(tmp_path / "a.mp4", frames=4, size=(56, 56))
    rec = {"messages": [{"role": "user", "content": "<video><video>hi"}, {"role": "assistant", "content": "ok"}],
           "videos": ["a.mp4"]}  # fmt: skip
    missing = dict(rec, messages=[dict(rec["messages"][0], content="<video>hi"), rec["messages"][1]],
                   videos=["nope.mp4"])  # fmt: skip
    data = _records(tmp_path, "videos", [rec, missing])
    tok = tokenizer_of(tiny_media["qwen2_vl"])
    with pytest.raises(DataError) as err:
        build_datasets(
            media_cfg(base_cfg, tiny_media["qwen2_vl"], data, "videos"), tok, get_template("qwen2_vl", tok)
        )
    msg = str(err.value)
    assert "2 record(s) with media problems" in msg
    assert "2 <video> placeholder(s) in the messages but 1 video file(s)" in msg
    assert "'nope.mp4': no such file" in msg


def test_videos_and_audio_are_refused_by_name_where_the_model_cannot_take_them(
    tiny_media, base_cfg, tmp_path
):
    videos, audios = demo_dir(tmp_path / "v", "videos"), demo_dir(tmp_path / "a", "audios")
    cases = [
        (tiny_media["qwen2_audio"], videos, "videos", "has video input, but"),
        (tiny_media["qwen2_vl"], audios, "audios", "has audio input, but"),
        (Path(base_cfg["model_name_or_path"]), videos, "videos", "has videos, but model_name_or_path"),
    ]
    for model, data, kind, message in cases:
        cfg = media_cfg(base_cfg, model, data, kind, template="qwen")
        tok = tokenizer_of(model)
        with pytest.raises(DataError, match=message):
            build_datasets(cfg, tok, get_template("qwen", tok))
    with pytest.raises(ConfigError, match="stage: dpo with the videos of dataset mllm_video_demo"):
        cfg = media_cfg(base_cfg, tiny_media["qwen2_vl"], videos, "videos", stage="dpo")
        build_datasets(cfg, tokenizer_of(tiny_media["qwen2_vl"]), get_template("qwen2_vl", tok))
    with pytest.raises(ConfigError, match="audio_sampling_rate: got 8000, .* reads audio at 16000 Hz only"):
        cfg = media_cfg(base_cfg, tiny_media["qwen2_audio"], audios, "audios", audio_sampling_rate=8000)
        tok = tokenizer_of(tiny_media["qwen2_audio"])
        build_datasets(cfg, tok, get_template("qwen2_audio", tok))
    with pytest.raises(ConfigError, match="template: 'qwen' has no image support for this qwen2_audio model"):
        cfg = media_cfg(base_cfg, tiny_media["qwen2_audio"], audios, "audios", template="qwen")
        build_datasets(cfg, tok, get_template("qwen", tok))


# ---- audio --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix,rate,channels", [("wav", 16000, 1), ("flac", 22050, 2), ("mp3", 8000, 1)])
def test_audio_loads_mono_float32_resampled_to_ceil_length(suffix, rate, channels, tmp_path):
    import soundfile

    from lmstack.data.media_audio import load_audio

    path = write_audio(tmp_path / f"a.{suffix}", seconds=0.5, rate=rate, channels=channels)
    native = soundfile.info(str(path)).frames
    wave = load_audio(str(path), 16000)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert len(wave) == math.ceil(native * 16000 / rate)
    assert 0.1 < float(np.abs(wave).max()) < 0.5  # the 0.3 tone survives resampling


def test_audio_ids_equal_qwen2_audio_processor_and_features_feed_the_model(tiny_media, base_cfg, tmp_path):
    """The encoded ids equal Qwen2AudioProcessor's on the same waveform and text; the collator's
    features give the model as many audio embeddings as the sample has <|AUDIO|> tokens."""
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from lmstack.data.media_audio import load_audio
    from lmstack.data.mm import media_spec
    from lmstack.data.mm_av_collate import media_collator

    model_dir = tiny_media["qwen2_audio"]
    data = demo_dir(tmp_path, "audios")
    cfg = media_cfg(base_cfg, model_dir, data, "audios")
    proc = AutoProcessor.from_pretrained(model_dir)
    tok = proc.tokenizer
    template = get_template("qwen2_audio", tok)
    bundle = build_datasets(cfg, tok, template)
    records = json.loads((data / "mllm_audio_demo.json").read_text())
    for sample, record in zip(bundle.train, records):
        marks = "<|audio_bos|><|AUDIO|><|audio_eos|>"
        messages = [dict(m, content=m["content"].replace("<audio>", marks)) for m in record["messages"]]
        text = template.render(messages, template.default_system, tok)
        wave = load_audio(str(data / record["audios"][0]), 16000)
        expected = list(proc(text=[text], audio=[wave], sampling_rate=16000)["input_ids"][0])
        assert sample["input_ids"] == expected
    batch = media_collator(cfg, tok, media_spec(cfg), None)([bundle.train[i] for i in range(3)])
    assert batch["input_features"].shape == (3, 128, 3000)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir)
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items()})
    assert torch.isfinite(out.loss)


def test_a_record_whose_audio_tokens_cutoff_len_would_cut_is_dropped_and_counted(
    tiny_media, base_cfg, tmp_path
):
    data = demo_dir(tmp_path, "audios")  # 0.5 s, 0.75 s, 1 s: 12, 19, 25 audio tokens
    tok = tokenizer_of(tiny_media["qwen2_audio"])
    cfg = media_cfg(base_cfg, tiny_media["qwen2_audio"], data, "audios", cutoff_len=52)
    bundle = build_datasets(cfg, tok, get_template("qwen2_audio", tok))
    dropped = bundle.stats[0].dropped["audio tokens cut by cutoff_len"]
    assert 1 <= dropped < 3 and len(bundle.train) == 3 - dropped


def test_tiny_model_command_builds_the_audio_model(tmp_path):
    from transformers import AutoFeatureExtractor, AutoProcessor, Qwen2AudioForConditionalGeneration

    from lmstack.cli.main import main

    data = Path(__file__).resolve().parents[3] / "data"
    assert main(["tiny-model", str(tmp_path / "m"), "--vision", "qwen2_audio", "--data-dir", str(data)]) == 0
    model = Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path / "m")
    assert model.config.audio_token_index == AutoProcessor.from_pretrained(tmp_path / "m").audio_token_id
    assert type(AutoFeatureExtractor.from_pretrained(tmp_path / "m")).__name__ == "WhisperFeatureExtractor"


@pytest.mark.parametrize("family,kind", [("qwen2_vl", "videos"), ("qwen2_audio", "audios")])
def test_check_reports_videos_and_audio_with_their_tokens(family, kind, tiny_media, base_cfg, tmp_path):
    from lmstack.data.validate import check_data, format_report

    data = demo_dir(tmp_path, kind)
    cfg = media_cfg(base_cfg, tiny_media[family], data, kind)
    tok = tokenizer_of(tiny_media[family])
    report = check_data(cfg, tok, get_template("qwen2_vl" if kind == "videos" else "qwen2_audio", tok))
    entry = report["datasets"][0][kind]
    # videos: 56x56 frames (1 temporal patch), 84x56 (2), 84x56 (2); audio: 0.5 s, 0.75 s, 1 s
    expected = {"videos": [4, 12, 12], "audios": [12, 19, 25]}[kind]
    assert entry == {
        "files": 3,
        "samples": 3,
        "tokens": sum(expected),
        "tokens_per_sample": {"min": min(expected), "max": max(expected)},
    }
    assert f"{kind}: 3 in 3 samples, {sum(expected)} {kind[:-1]} tokens" in format_report(report)


def test_a_record_with_an_image_and_a_video_feeds_both_to_qwen2_vl(tiny_media, base_cfg, tmp_path):
    """Images (1) and video tokens (2) in mm_token_type_ids, both grids, and the model's forward takes
    the batch (its rope index walks the image and the video grids in text order)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from lmstack.data.mm import media_spec
    from lmstack.data.mm_av_collate import media_collator
    from lmstack.models.vision import load_image_processor

    Image.new("RGB", (60, 40), (200, 30, 30)).save(tmp_path / "a.png")
    write_video(tmp_path / "v.mp4", frames=8, size=(64, 48))
    messages = [
        {"role": "user", "content": "<image>Is this the colour of the video <video>?"},
        {"role": "assistant", "content": "No."},
    ]
    (tmp_path / "d.json").write_text(
        json.dumps([{"messages": messages, "images": ["a.png"], "videos": ["v.mp4"]}])
    )
    columns = {"messages": "messages", "images": "images", "videos": "videos"}
    entry = {"file_name": "d.json", "formatting": "sharegpt", "tags": TAGS, "columns": columns}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mllm_video_demo": entry}))
    cfg = media_cfg(base_cfg, tiny_media["qwen2_vl"], tmp_path, "videos")
    tok = tokenizer_of(tiny_media["qwen2_vl"])
    data = build_datasets(cfg, tok, get_template("qwen2_vl", tok)).train
    batch = media_collator(cfg, tok, media_spec(cfg), load_image_processor)([data[0]])
    assert {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"} <= set(batch)
    assert set(batch["mm_token_type_ids"].unique().tolist()) == {0, 1, 2}
    model = AutoModelForImageTextToText.from_pretrained(tiny_media["qwen2_vl"])
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


@pytest.mark.parametrize(
    "family,kind,name", [("qwen2_vl", "videos", "bad.mp4"), ("qwen2_audio", "audios", "bad.wav")]
)
def test_an_unreadable_media_file_stops_the_run_naming_it(family, kind, name, tiny_media, base_cfg, tmp_path):
    (tmp_path / name).write_text("not media")
    placeholder = "<video>" if kind == "videos" else "<audio>"
    rec = {
        "messages": [{"role": "user", "content": placeholder + "hi"}, {"role": "assistant", "content": "ok"}]
    }
    data = _records(tmp_path, kind, [{**rec, kind: [name]}])
    tok = tokenizer_of(tiny_media[family])
    template = get_template("qwen2_vl" if kind == "videos" else "qwen2_audio", tok)
    with pytest.raises(DataError, match=f"1 record\\(s\\) with media problems:\n.*{kind}\\[0\\]: .*{name}"):
        build_datasets(media_cfg(base_cfg, tiny_media[family], data, kind), tok, template)
