"""On a machine with torchvision (the GPU machines; CPU CI has no torchvision for its torch): lmstack's own
Qwen2-VL video preprocessing (data/media_video.py) against transformers' Qwen2VLVideoProcessor and
Qwen2VLProcessor on the same LF-sampled frames: the same grid and token ids, and pixel values equal up to
the resize kernel (torchvision's bicubic on tensors vs PIL's bicubic, which lmstack uses)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from media_files import write_video

pytestmark = pytest.mark.gpu
torchvision = pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    data = Path(__file__).resolve().parents[2] / "data"
    return build_tiny_vision_model(tmp_path_factory.mktemp("tq") / "m", "qwen2_vl", data_dir=data)


@pytest.mark.parametrize("name,frames,size", [("a.mp4", 9, (96, 64)), ("b.avi", 6, (300, 120))])
def test_video_grid_ids_and_pixels_equal_the_reference_video_processor(
    name, frames, size, tiny_qwen2_vl, tmp_path
):
    from transformers import AutoProcessor

    from lmstack.data.media_video import VideoSpec, decode_video, patchify, video_spec
    from lmstack.data.mm import MediaSpec, regularize

    class Data:
        video_fps, video_maxlen, video_max_pixels, video_min_pixels = 2.0, 128, 256 * 256, 16 * 16

    spec: VideoSpec = video_spec(str(tiny_qwen2_vl), Data, "qwen2_vl")
    frame_spec = MediaSpec("qwen2_vl", "qwen2_vl", str(tmp_path), spec.max_pixels, spec.min_pixels)
    path = write_video(tmp_path / name, frames=frames, size=size, fps=4)
    decoded = decode_video(str(path), spec, lambda im: regularize(im, frame_spec))
    ours, grid = patchify(decoded.frames, spec)

    proc = AutoProcessor.from_pretrained(tiny_qwen2_vl)
    ref = proc.video_processor(videos=[decoded.frames], return_tensors="np", do_sample_frames=False)
    assert tuple(ref["video_grid_thw"][0]) == grid
    theirs = np.asarray(ref["pixel_values_videos"])
    assert theirs.shape == ours.shape
    assert np.abs(theirs - ours).mean() < 0.05  # normalized units: the two bicubic kernels differ slightly

    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n"
    ids = proc(text=[text], videos=[decoded.frames], do_sample_frames=False)["input_ids"][0]
    video_id = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert sum(int(t == video_id) for t in ids) == grid[0] * grid[1] * grid[2] // spec.merge_size**2
