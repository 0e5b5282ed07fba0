"""Qwen3-VL videos (data/media_video_qwen3.py): the video processor's second sampling, its clip-wide
smart_resize, patch layout and frame timestamps against transformers' own Qwen3VLVideoProcessor /
Qwen3VLProcessor functions (they run without torchvision; the class itself does not), and the prompt of
LF's mllm_video_demo videos on the tiny Qwen3-VL against hand-computed values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lmstack.config.load import build_config
from lmstack.data.media_video_qwen3 import (
    Qwen3VideoSpec,
    processor_indices,
    resized_size,
    timestamps,
)
from lmstack.data.pipeline import build_datasets
from lmstack.templates import get_template
from media_files import demo_dir

SPEC = dict(fps=2.0, maxlen=128, max_pixels=256 * 256, min_pixels=16 * 16, proc_min_pixels=8192,
            proc_max_pixels=131072, patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_q3")
    data = Path(__file__).resolve().parents[3] / "data"
    return {f: build_tiny_vision_model(root / f, f, data_dir=data) for f in ("qwen3_vl", "qwen3_vl_moe")}


def q3_cfg(base_cfg, model: Path, data: Path, **over):
    return build_config(
        {
            **base_cfg,
            "model_name_or_path": str(model),
            "template": "qwen3_vl_nothink",
            "dataset": "mllm_video_demo",
            "dataset_dir": str(data),
            "cutoff_len": 512,
            **over,
        }
    )


# ---- against transformers' own functions ------------------------------------------------------------
@pytest.mark.parametrize("frames,video_fps", [(2, 2.0), (8, 2.0), (9, 4.0), (30, 8.0), (6, 1.0), (1000, 2.0)])
def test_second_sampling_equals_the_video_processors_on_lfs_metadata(frames, video_fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    spec = Qwen3VideoSpec(**{**SPEC, "fps": video_fps}, max_frames=600)
    proc = SimpleNamespace(fps=2, min_frames=4, max_frames=600)
    meta = VideoMetadata(total_num_frames=frames, fps=video_fps, duration=frames)  # LF's metadata
    ref = Qwen3VLVideoProcessor.sample_frames(proc, meta)
    assert processor_indices(frames, spec) == [int(i) for i in ref]
    assert processor_indices(frames, Qwen3VideoSpec(**SPEC, sample_frames=False)) == list(range(frames))


@pytest.mark.parametrize("frames", [2, 3, 4, 9, 40])
@pytest.mark.parametrize("height,width", [(48, 64), (20, 300), (480, 640), (1080, 1920), (33, 33)])
@pytest.mark.parametrize("cap", [False, True])
def test_clip_resize_equals_qwen3_smart_resize(frames, height, width, cap):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    spec = Qwen3VideoSpec(**SPEC, cap_pixels_per_frame=cap, max_video_tokens=64)
    budget = spec.proc_max_pixels
    if cap:  # the processor's resize: per-frame pixels capped before smart_resize
        budget = max(min(64 * 32 * 32, budget // frames), int(spec.proc_min_pixels * 1.05)) * frames
    ref = smart_resize(frames, height, width, 2, 32, spec.proc_min_pixels, budget)
    assert resized_size(frames, height, width, spec) == ref


def test_one_frame_is_refused_as_the_processor_refuses_it():
    with pytest.raises(ValueError, match="at least temporal_patch_size 2"):
        resized_size(1, 64, 64, Qwen3VideoSpec(**SPEC))


@pytest.mark.parametrize(
    "indices,fps", [([0, 1], 2.0), ([0, 1, 2, 3, 4], 2.0), ([0, 3, 6, 9], 1.5), ([4], 24.0)]
)
def test_timestamps_equal_the_processors(indices, fps):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    assert timestamps(indices, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


@pytest.mark.parametrize("frames", [2, 3, 6])
def test_pixel_values_equal_the_processors_rescale_normalize_and_patch_layout(frames):
    """Frames already at the resize target (so no kernel is involved): lmstack's patches equal
    Qwen3VLVideoProcessor.patchify of (x / 255 - mean) / std, an odd count padded with its last frame."""
    import torch
    from PIL import Image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from lmstack.data.media_video import patchify

    rng = np.random.default_rng(frames)
    raw = rng.integers(0, 256, size=(frames, 64, 96, 3), dtype=np.uint8)
    spec = Qwen3VideoSpec(**SPEC)
    ours, grid = patchify([Image.fromarray(f) for f in raw], spec, (64, 96))
    x = torch.from_numpy(raw).permute(0, 3, 1, 2).float() / 255
    x = ((x - 0.5) / 0.5)[None]
    ref, t, h, w = Qwen3VLVideoProcessor.patchify(None, x, patch_size=16, merge_size=2, temporal_patch_size=2)
    assert grid == (t, h, w) == (math.ceil(frames / 2), 4, 6)
    np.testing.assert_allclose(ours, ref[0].numpy(), atol=1e-6)


# ---- LF's mllm_video_demo on the tiny Qwen3-VL, by hand ---------------------------------------------
# the demo videos (media_files.demo_dir): 5, 7, 9 frames at 4 fps of 64x48, 80x48, 96x48 pixels.
# LF samples floor(duration x 2) = 2, 3 (doubled to 4), 4 frames; the processor keeps them all
# (int(n / video_fps x fps) = n). Its resize over the clip (32-pixel units, 2 x 64 x 64 .. 8 x 128 x 128
# pixels): 64x48 -> 64x64, 80x48 -> 64x64 (round(2.5) = 2), 96x48 -> 64x96; grids (1,4,4), (2,4,4),
# (2,4,6); per frame group 4, 4, 6 tokens; groups at (0 + 0.5) / 2 = 0.25 s and (1 + 1.5) / 2 = 1.25 s.
EXPECTED = [
    ((1, 4, 4), ["<0.2 seconds>"], 4),
    ((2, 4, 4), ["<0.2 seconds>", "<1.2 seconds>"], 4),
    ((2, 4, 6), ["<0.2 seconds>", "<1.2 seconds>"], 6),
]


def _expected_text(stamps: list[str], per_frame: int) -> str:
    return "".join(f"{s}<|vision_start|>{'<|video_pad|>' * per_frame}<|vision_end|>" for s in stamps)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_demo_videos_prompt_grid_and_pixels_are_the_hand_computed_ones(
    family, tiny_qwen3, base_cfg, tmp_path
):
    from transformers import AutoTokenizer

    from lmstack.data.mm import media_spec
    from lmstack.data.mm_av_collate import media_collator
    from lmstack.models.vision import load_image_processor

    model = tiny_qwen3[family]
    assert json.loads((model / "video_preprocessor_config.json").read_text())["patch_size"] == 16
    data = demo_dir(tmp_path, "videos")
    cfg = q3_cfg(base_cfg, model, data)
    tok = AutoTokenizer.from_pretrained(model)
    bundle = build_datasets(cfg, tok, get_template("qwen3_vl_nothink", tok))
    assert len(bundle.train) == 3
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    for row, (grid, stamps, per_frame) in zip(bundle.train, EXPECTED):
        text = tok.decode(row["input_ids"])
        assert _expected_text(stamps, per_frame) + "What happens in this video?" in text
        assert text.count("<|vision_start|>") == grid[0]
        assert sum(t == video_id for t in row["input_ids"]) == math.prod(grid) // 4
    spec = media_spec(cfg)
    batch = media_collator(cfg, tok, spec, load_image_processor)([bundle.train[i] for i in range(3)])
    assert batch["video_grid_thw"].tolist() == [list(g) for g, _, _ in EXPECTED]
    assert batch["pixel_values_videos"].shape == (sum(math.prod(g) for g, _, _ in EXPECTED), 3 * 2 * 16 * 16)
    assert set(batch["mm_token_type_ids"][batch["input_ids"] == video_id].tolist()) == {2}
    assert "second_per_grid_ts" not in batch  # Qwen3-VL's processor gives none (its timestamps are text)


def test_video_fps_above_the_processors_fps_samples_again_and_budgets_bound_the_clip(
    tiny_qwen3, base_cfg, tmp_path
):
    """video_fps 4 on the 9-frame demo video: LF samples floor(2.25 x 4) = 9 -> 10 frames, the processor
    int(10 / 4 x 2) = 5 of them (indices 0 2 4 7 9 of 10: linspace rounded half to even), 3 frame groups
    at (0 + 0.5) / 2, (1 + 1.75) / 2, (2.25 + 2.25) / 2 seconds. video_max_pixels 1024 shrinks each
    frame to 45x22 (LF: at least 28 a side, 45x28); the processor scales sides under 32 up (51x32) and
    rounds to 64x32: 4 x 2 patches, 2 tokens per frame group (4 x 32 x 64 = its 8192-pixel floor)."""
    from transformers import AutoTokenizer

    data = demo_dir(tmp_path, "videos")
    cfg = q3_cfg(base_cfg, tiny_qwen3["qwen3_vl"], data, video_fps=4.0, video_max_pixels=1024)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3["qwen3_vl"])
    row = build_datasets(cfg, tok, get_template("qwen3_vl_nothink", tok)).train[2]
    text = tok.decode(row["input_ids"])
    stamps = ["<0.2 seconds>", "<1.4 seconds>", "<2.2 seconds>"]
    assert _expected_text(stamps, 2) + "What happens" in text
