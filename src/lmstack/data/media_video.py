"""Videos in LLaMA-Factory's multimodal datasets (the `videos` column, `<video>` placeholders) for
Qwen2-VL / Qwen2.5-VL, preprocessed by lmstack itself: transformers' video processors need torchvision,
which has no CPU build for the torch lmstack's CI runs, so frames are decoded with PyAV and patchified
here in numpy, the way the Qwen2-VL video processor lays them out.

LLaMA-Factory's rules, followed exactly (its mm_plugin.py, `_get_video_sample_indices` and the Qwen2-VL
plugin's `_regularize_videos`):

- frames sampled: n = min(frames in the stream, video_maxlen, max(1, floor(duration_s * video_fps))), at
  `linspace(0, frames - 1, n)` truncated to int; a stream that reports 0 frames: the first video_maxlen;
- an odd count gets its last frame again (Qwen's temporal patch is 2 frames);
- each frame resized as an image under video_max_pixels / video_min_pixels (and Qwen's 28-pixel and
  1:200 bounds), RGB.

Then the processor's part: every frame of a video resized (PIL bicubic) to the processor's smart_resize of
the first frame's size under the video processor's own min/max pixels (`video_preprocessor_config.json`,
else `preprocessor_config.json`), rescaled and normalized, and cut into patches of
temporal_patch_size x patch_size x patch_size: `pixel_values_videos` [patches, C*T*P*P] in the video
processor's order, `video_grid_thw` [videos, 3]. Each `<video>` becomes `<|vision_start|>` +
`<|video_pad|>` x (t * h * w / merge_size^2) + `<|vision_end|>`. Qwen2.5-VL also gets
`second_per_grid_ts` = temporal_patch_size / sampled fps per video, as LLaMA-Factory passes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VIDEO_PLACEHOLDER = "<video>"
VIDEO_TOKENS = ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>")
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # Qwen3-VL: media_video_qwen3.py


@dataclass(frozen=True)
class VideoSpec:
    """What turning a video into frames, patches and tokens needs (plain values: part of the cache key)."""

    fps: float  # LF's video_fps
    maxlen: int  # LF's video_maxlen
    max_pixels: int  # LF's video_max_pixels (the frame resize before the processor's)
    min_pixels: int  # LF's video_min_pixels
    proc_min_pixels: int  # the video processor's smart_resize bounds
    proc_max_pixels: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    seconds_per_grid: bool = False  # Qwen2.5-VL: second_per_grid_ts goes with the pixels


def video_spec(model_dir: str, data: Any, model_type: str) -> VideoSpec:
    """The video spec of a Qwen2-VL / Qwen2.5-VL folder and the data section's video_* fields."""
    root = Path(model_dir)
    conf: dict = {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (root / name).is_file():
            conf = json.loads((root / name).read_text())
            break
    size = conf.get("size") or {}
    proc_min = size.get("shortest_edge", conf.get("min_pixels", 128 * 28 * 28))
    proc_max = size.get("longest_edge", conf.get("max_pixels", 28 * 28 * 768))
    return VideoSpec(
        fps=float(data.video_fps),
        maxlen=int(data.video_maxlen),
        max_pixels=int(data.video_max_pixels),
        min_pixels=int(data.video_min_pixels),
        proc_min_pixels=int(proc_min),
        proc_max_pixels=int(proc_max),
        patch_size=int(conf.get("patch_size", 14)),
        merge_size=int(conf.get("merge_size", 2)),
        temporal_patch_size=int(conf.get("temporal_patch_size", 2)),
        image_mean=tuple(conf.get("image_mean", VideoSpec.image_mean)),
        image_std=tuple(conf.get("image_std", VideoSpec.image_std)),
        rescale_factor=float(conf.get("rescale_factor", 1 / 255)),
        seconds_per_grid=model_type == "qwen2_5_vl",
    )


# ---- decoding and sampling (LLaMA-Factory's rules) ------------------------------------------------
def sample_indices(total_frames: int, duration_s: float | None, fps: float, maxlen: int) -> list[int]:
    """The frame indices LLaMA-Factory samples from a stream of `total_frames` lasting `duration_s`."""
    import numpy as np

    if total_frames == 0:  # a stream that does not say how many frames it has
        return list(range(maxlen))
    n = min(total_frames, maxlen) if duration_s is None else max(1, math.floor(duration_s * fps))
    n = min(total_frames, maxlen, n)
    return [int(i) for i in np.linspace(0, total_frames - 1, n).astype(np.int32)]


@dataclass
class Decoded:
    frames: list[Any]  # PIL images, LF-regularized, an even number
    sampled: int  # frame indices sampled (before an odd count's last frame was doubled)
    duration_s: float
    fps: float  # LLaMA-Factory's fps_per_video: sample indices / duration (unknown duration: video_fps)


def decode_video(path: str, spec: VideoSpec, frame_resize: Any) -> Decoded:
    """The sampled, regularized frames of the video at `path` (`frame_resize`: PIL image -> PIL image,
    LLaMA-Factory's image resize under video_max_pixels / video_min_pixels)."""
    import av

    with av.open(path, "r") as container:
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise ValueError(f"{path}: no video stream")
        duration = (
            float(stream.duration * stream.time_base)
            if stream.duration is not None and stream.time_base is not None
            else None
        )
        wanted = set(sample_indices(stream.frames, duration, spec.fps, spec.maxlen))
        frames = [f.to_image() for i, f in enumerate(container.decode(stream)) if i in wanted]
    if not frames:
        raise ValueError(f"{path}: no frame decoded")
    sampled = len(wanted)
    fps = sampled / duration if duration else spec.fps
    if duration is None:  # LF: an unknown duration counts at video_fps
        duration = len(frames) / spec.fps
    if len(frames) % 2:
        frames.append(frames[-1])
    return Decoded([frame_resize(f) for f in frames], sampled, duration, fps)


# ---- the processor's part: resize, normalize, patchify ------------------------------------------------
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: (height, width) divisible by `factor`, the area within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_thw(frames: int, width: int, height: int, spec: VideoSpec) -> tuple[int, int, int]:
    """(t, h, w) patches of a video of `frames` frames of `width` x `height` (after LF's resize)."""
    h, w = smart_resize(
        height, width, spec.patch_size * spec.merge_size, spec.proc_min_pixels, spec.proc_max_pixels
    )
    t = -(-frames // spec.temporal_patch_size)
    return t, h // spec.patch_size, w // spec.patch_size


def video_seqlen(grid: tuple[int, int, int], spec: VideoSpec) -> int:
    """`<|video_pad|>` tokens of a video with this grid."""
    t, h, w = grid
    return t * h * w // spec.merge_size**2


def patchify(
    frames: list[Any], spec: VideoSpec, size: tuple[int, int] | None = None
) -> tuple[Any, tuple[int, int, int]]:
    """(patches [t*h*w, C*T*P*P] float32, (t, h, w)) of one video's regularized PIL frames, in the
    Qwen2-VL video processor's layout (Qwen3-VL's is the same); `size` (height, width): the frames'
    resize target, else Qwen2-VL's smart_resize of the first frame."""
    import numpy as np
    from PIL import Image

    first = frames[0]
    rh, rw = size or smart_resize(
        first.height, first.width, spec.patch_size * spec.merge_size, spec.proc_min_pixels, spec.proc_max_pixels
    )  # fmt: skip
    mean = np.asarray(spec.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(spec.image_std, dtype=np.float32)[:, None, None]
    arrays = []
    for frame in frames:
        im = frame if frame.size == (rw, rh) else frame.resize((rw, rh), Image.Resampling.BICUBIC)
        x = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
        x = (x.astype(np.float64) * spec.rescale_factor).astype(np.float32)
        arrays.append((x - mean) / std)
    video = np.stack(arrays)  # [F, C, H, W]
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -len(video) % tp:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    f, c = video.shape[:2]
    t, gh, gw = f // tp, rh // p, rw // p
    x = video.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, gh/m, gw/m, m, m, C, tp, p, p
    return np.ascontiguousarray(x.reshape(t * gh * gw, c * tp * p * p)), (t, gh, gw)


def video_inputs(decoded: list[Decoded], spec: VideoSpec) -> dict:
    """The model inputs of a batch's videos: pixel_values_videos, video_grid_thw (+ second_per_grid_ts)."""
    import numpy as np
    import torch

    if not decoded:
        return {}
    pieces, grids = zip(*(patchify(d.frames, spec) for d in decoded))
    out = {
        "pixel_values_videos": torch.from_numpy(np.concatenate(pieces)),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
    }
    if spec.seconds_per_grid:
        out["second_per_grid_ts"] = torch.tensor(
            [
                spec.temporal_patch_size / d.fps if d.fps else spec.temporal_patch_size / spec.fps
                for d in decoded
            ]
        )
    return out
