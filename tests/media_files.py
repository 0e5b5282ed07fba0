"""Test media made on the spot (no downloads): tiny videos encoded with PyAV (mp4 / avi) and tones written
with soundfile (wav, flac, mp3), laid out as LLaMA-Factory's mllm_demo_data/ folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}


def write_video(path: Path, frames: int, size: tuple[int, int], fps: int = 4, seed: int = 0) -> Path:
    """A video of `frames` frames of `size` (width, height): a moving bright square on a coloured ground,
    mpeg4 in .mp4 / mjpeg in .avi."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 200, size=3)
    w, h = size
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mjpeg" if path.suffix == ".avi" else "mpeg4", rate=fps)
        stream.width, stream.height = w, h
        stream.pix_fmt = "yuvj420p" if path.suffix == ".avi" else "yuv420p"
        for i in range(frames):
            img = np.empty((h, w, 3), dtype=np.uint8)
            img[:] = base
            x = (i * 7) % max(1, w - 8)
            img[4:12, x : x + 8] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def write_audio(path: Path, seconds: float, rate: int, hz: float = 440.0, channels: int = 1) -> Path:
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    soundfile.write(str(path), np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate)
    return path


def demo_dir(root: Path, kind: str) -> Path:
    """LF's mllm_video_demo / mllm_audio_demo layout: dataset_info.json, <name>.json, mllm_demo_data/."""
    folder = root / "data"
    media = folder / "mllm_demo_data"
    media.mkdir(parents=True, exist_ok=True)
    answers = ["A red square moves right.", "A blue square moves right.", "The square slides along."]
    records = []
    for i, answer in enumerate(answers):
        if kind == "videos":
            name = f"{i}.avi" if i == 2 else f"{i}.mp4"
            write_video(media / name, frames=5 + 2 * i, size=(64 + 16 * i, 48), seed=i)
            question = "<video>What happens in this video?"
        else:
            name = f"{i}.{['wav', 'flac', 'mp3'][i]}"
            write_audio(media / name, seconds=0.5 + 0.25 * i, rate=[16000, 22050, 8000][i], hz=300 + 200 * i)
            question = "<audio>What is this sound?"
        records.append(
            {
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                kind: [f"mllm_demo_data/{name}"],
            }
        )
    dataset = f"mllm_{kind[:-1]}_demo"
    (folder / f"{dataset}.json").write_text(json.dumps(records))
    entry = {"file_name": f"{dataset}.json", "formatting": "sharegpt", "tags": TAGS}
    entry["columns"] = {"messages": "messages", kind: kind}
    (folder / "dataset_info.json").write_text(json.dumps({dataset: entry}))
    return folder


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def image_demo_dir(folder: Path) -> Path:
    """LF's mllm_demo layout: dataset_info.json, mllm_demo.json, mllm_demo_data/<n>.png (one coloured
    picture per record of different sizes, the colour's name the answer)."""
    from PIL import Image

    (folder / "mllm_demo_data").mkdir(parents=True, exist_ok=True)
    records = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        Image.new("RGB", (64 + 16 * i, 48), rgb).save(folder / "mllm_demo_data" / f"{i}.png")
        records.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>What colour is this picture?"},
                    {"role": "assistant", "content": name},
                ],
                "images": [f"mllm_demo_data/{i}.png"],
            }
        )
    (folder / "mllm_demo.json").write_text(json.dumps(records))
    entry = {"file_name": "mllm_demo.json", "formatting": "sharegpt", "tags": TAGS}
    entry["columns"] = {"messages": "messages", "images": "images"}
    (folder / "dataset_info.json").write_text(json.dumps({"mllm_demo": entry}))
    return folder
