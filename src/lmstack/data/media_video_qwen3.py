"""Videos for Qwen3-VL (dense and MoE), preprocessed by lmstack as transformers' Qwen3VLVideoProcessor and
Qwen3VLProcessor do, on the frames LLaMA-Factory's Qwen3VLPlugin hands them (no torchvision needed).

LLaMA-Factory's part is Qwen2-VL's (media_video.decode_video: frames sampled at video_fps, at most
video_maxlen, an odd count's last frame doubled, each resized under video_max_pixels / video_min_pixels).
It then passes the frames with the metadata {fps: video_fps, total_num_frames: len(frames)}, and the
processor does the rest:

- frames sampled again (when its do_sample_frames, the default): n = int(frames / video_fps * fps), at
  least min_frames, at most max_frames and the frames there are, at `linspace(0, frames - 1, n)` rounded;
- every frame resized (bicubic) to Qwen3-VL's smart_resize, whose pixel bounds count the frames too:
  round(frames / temporal_patch_size) * temporal_patch_size * h * w within size.shortest_edge ..
  size.longest_edge (with cap_pixels_per_frame: per-frame pixels at most max_video_tokens patches or
  an even share of longest_edge, at least 1.05 x shortest_edge), sides in patch_size * merge_size units;
- rescaled, normalized, cut into temporal_patch_size x patch_size x patch_size patches (Qwen2-VL's layout);
- each `<video>` written per temporal group of frames: `<{t:.1f} seconds>` + `<|vision_start|>` +
  `<|video_pad|>` x (h * w / merge_size^2) + `<|vision_end|>`, t the mean time of the group's first and
  last frame (frame index / video_fps).

Where LLaMA-Factory departs from its processor, lmstack follows the processor: LF reads every video's
frame count from the first video's grid and its timestamps from the metadata of the message's index,
so a record with two videos (or a video in a later message) gets the wrong text or fails there; and
with do_sample_frames: false LF has no frame indices for the timestamps (lmstack: the frames in order).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstack.data.media_video import VIDEO_TOKENS, Decoded, VideoSpec, patchify

QWEN3_VIDEO_TYPES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class Qwen3VideoSpec(VideoSpec):
    """Qwen2-VL's video spec plus the Qwen3-VL video processor's own sampling and pixel-budget settings."""

    proc_fps: float = 2.0  # the video processor's fps (its second sampling)
    min_frames: int = 4
    max_frames: int = 768
    sample_frames: bool = True  # the video processor's do_sample_frames
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768


def qwen3_video_spec(model_dir: str, data: Any) -> Qwen3VideoSpec:
    """The video spec of a Qwen3-VL folder (video_preprocessor_config.json, else the processor's class
    defaults) and the data section's video_* fields."""
    path = Path(model_dir) / "video_preprocessor_config.json"
    conf: dict = json.loads(path.read_text()) if path.is_file() else {}
    size = conf.get("size") or {}
    return Qwen3VideoSpec(
        fps=float(data.video_fps),
        maxlen=int(data.video_maxlen),
        max_pixels=int(data.video_max_pixels),
        min_pixels=int(data.video_min_pixels),
        proc_min_pixels=int(size.get("shortest_edge", 128 * 32 * 32)),
        proc_max_pixels=int(size.get("longest_edge", 32 * 32 * 768)),
        patch_size=int(conf.get("patch_size", 16)),
        merge_size=int(conf.get("merge_size", 2)),
        temporal_patch_size=int(conf.get("temporal_patch_size", 2)),
        image_mean=tuple(conf.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(conf.get("image_std", (0.5, 0.5, 0.5))),
        rescale_factor=float(conf.get("rescale_factor", 1 / 255)),
        proc_fps=float(conf.get("fps", 2.0)),
        min_frames=int(conf.get("min_frames", 4)),
        max_frames=int(conf.get("max_frames", 768)),
        sample_frames=bool(conf.get("do_sample_frames", True)),
        cap_pixels_per_frame=bool(conf.get("cap_pixels_per_frame") or False),
        max_video_tokens=int(conf.get("max_video_tokens", 768)),
    )


def processor_indices(frames: int, spec: Qwen3VideoSpec) -> list[int]:
    """The frames (of LF's `frames`) the video processor keeps, LF's metadata fps being video_fps."""
    import numpy as np

    if not spec.sample_frames:
        return list(range(frames))
    n = int(frames / spec.fps * spec.proc_fps)
    n = min(max(n, spec.min_frames), spec.max_frames, frames)
    return [int(i) for i in np.linspace(0, frames - 1, n).round().astype(int)]


def resized_size(frames: int, height: int, width: int, spec: Qwen3VideoSpec) -> tuple[int, int]:
    """(height, width) every frame is resized to: Qwen3-VL's smart_resize over the whole clip."""
    factor, tp = spec.patch_size * spec.merge_size, spec.temporal_patch_size
    if frames < tp:
        raise ValueError(f"{frames} frame(s): Qwen3-VL needs at least temporal_patch_size {tp}")
    max_pixels = spec.proc_max_pixels
    if spec.cap_pixels_per_frame:
        per_frame = min(spec.max_video_tokens * factor * factor, spec.proc_max_pixels // frames)
        max_pixels = max(per_frame, int(spec.proc_min_pixels * 1.05)) * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / tp) * tp
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < spec.proc_min_pixels:
        beta = math.sqrt(spec.proc_min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def timestamps(indices: list[int], fps: float, group: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's index / fps (the index
    list padded with its last to a multiple of `group`)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % group)
    seconds = [i / fps for i in padded]
    return [(seconds[i] + seconds[i + group - 1]) / 2 for i in range(0, len(seconds), group)]


@dataclass
class Qwen3Clip:
    frames: list[Any]  # the frames the processor keeps (PIL)
    indices: list[int]  # their indices in LF's frames
    size: tuple[int, int]  # (height, width) after the processor's resize
    grid: tuple[int, int, int]  # (t, h, w) in patches


def clip(decoded: Decoded, spec: Qwen3VideoSpec) -> Qwen3Clip:
    """The processor's frames, resize and grid of one LF-decoded video."""
    indices = processor_indices(len(decoded.frames), spec)
    frames = [decoded.frames[i] for i in indices]
    size = resized_size(len(frames), frames[0].height, frames[0].width, spec)
    t = -(-len(frames) // spec.temporal_patch_size)
    return Qwen3Clip(frames, indices, size, (t, size[0] // spec.patch_size, size[1] // spec.patch_size))


def video_text(decoded: Decoded, spec: Qwen3VideoSpec) -> tuple[str, int]:
    """(the text one `<video>` becomes, its `<|video_pad|>` count)."""
    c = clip(decoded, spec)
    t, h, w = c.grid
    per_frame = h * w // spec.merge_size**2
    start, pad, end = VIDEO_TOKENS
    stamps = timestamps(c.indices, spec.fps, spec.temporal_patch_size)
    text = "".join(f"<{stamps[i]:.1f} seconds>{start}{pad * per_frame}{end}" for i in range(t))
    return text, t * per_frame


def video_inputs(decoded: list[Decoded], spec: Qwen3VideoSpec) -> dict:
    """pixel_values_videos [patches, C*T*P*P] and video_grid_thw [videos, 3] of a batch's videos."""
    import numpy as np
    import torch

    if not decoded:
        return {}
    clips = [clip(d, spec) for d in decoded]
    pieces = [patchify(c.frames, spec, c.size)[0] for c in clips]
    return {
        "pixel_values_videos": torch.from_numpy(np.concatenate(pieces)),
        "video_grid_thw": torch.tensor([c.grid for c in clips], dtype=torch.long),
    }
