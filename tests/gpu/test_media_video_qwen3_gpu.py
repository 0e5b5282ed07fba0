"""On a machine with torchvision (the GPU machines; CPU CI has no torchvision for its torch): lmstack's own
Qwen3-VL video preprocessing (data/media_video_qwen3.py) against transformers' Qwen3VLVideoProcessor and
Qwen3VLProcessor, called as LLaMA-Factory's Qwen3VLPlugin calls them (LF-sampled frames, metadata fps =
video_fps, return_metadata): the same kept frames, grid and prompt ids (timestamps included), and pixel
values equal up to the resize kernel (torchvision's bicubic on tensors vs PIL's, which lmstack uses)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from media_files import write_video

pytestmark = pytest.mark.gpu
torchvision = pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    data = Path(__file__).resolve().parents[2] / "data"
    return build_tiny_vision_model(tmp_path_factory.mktemp("tq3") / "m", "qwen3_vl", data_dir=data)


@pytest.mark.parametrize(
    "name,frames,size,video_fps",
    [("a.mp4", 9, (96, 64), 2.0), ("b.avi", 6, (300, 120), 2.0), ("c.mp4", 17, (80, 48), 4.0)],
)
def test_video_frames_grid_ids_and_pixels_equal_the_reference_processor(
    name, frames, size, video_fps, tiny_qwen3_vl, tmp_path
):
    from transformers import AutoProcessor

    from lmstack.data.media_video import decode_video, patchify
    from lmstack.data.media_video_qwen3 import clip, qwen3_video_spec, video_text
    from lmstack.data.mm import MediaSpec, regularize

    class Data:
        video_maxlen, video_max_pixels, video_min_pixels = 128, 256 * 256, 16 * 16

    Data.video_fps = video_fps
    spec = qwen3_video_spec(str(tiny_qwen3_vl), Data)
    frame_spec = MediaSpec("qwen3_vl", "qwen3_vl", str(tmp_path), spec.max_pixels, spec.min_pixels)
    path = write_video(tmp_path / name, frames=frames, size=size, fps=4)
    decoded = decode_video(str(path), spec, lambda im: regularize(im, frame_spec))
    ours = clip(decoded, spec)
    pixels, grid = patchify(ours.frames, spec, ours.size)

    proc = AutoProcessor.from_pretrained(tiny_qwen3_vl)
    n = len(decoded.frames)
    meta = [{"fps": video_fps, "duration": n, "total_num_frames": n}]  # LF's metadata
    ref = proc.video_processor(
        videos=[decoded.frames], video_metadata=meta, return_metadata=True, return_tensors="np"
    )
    assert [int(i) for i in ref["video_metadata"][0].frames_indices] == ours.indices
    assert tuple(int(v) for v in ref["video_grid_thw"][0]) == grid == ours.grid
    theirs = np.asarray(ref["pixel_values_videos"])
    assert theirs.shape == pixels.shape
    assert np.abs(theirs - pixels).mean() < 0.05  # normalized units: the two bicubic kernels differ slightly

    text, count = video_text(decoded, spec)
    turn = "<|im_start|>user\n{}What happens?<|im_end|>\n"
    meta = [{"fps": video_fps, "duration": n, "total_num_frames": n}]
    got = proc(text=[turn.format("<|video_pad|>")], videos=[decoded.frames], video_metadata=meta)
    assert list(got["input_ids"][0]) == proc.tokenizer(turn.format(text))["input_ids"]
    video_id = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert sum(int(t == video_id) for t in got["input_ids"][0]) == count
