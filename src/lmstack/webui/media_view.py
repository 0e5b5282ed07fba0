"""The Preview data tab's media part: the example's images as thumbnails, its videos' sampled frame counts
and first frames, its audios' durations and sampling rates, and each item's model tokens, counted by the
functions the encoder counts them with (data/mm.py, data/mm_av.py), so the preview and training agree."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

THUMB_PX = 128  # a thumbnail's longest side


def thumbnail_url(image: Any) -> str:
    """A PIL image as a data URL of a PNG at most THUMB_PX on its longest side."""
    small = image.convert("RGB")
    small.thumbnail((THUMB_PX, THUMB_PX))
    buf = io.BytesIO()
    small.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _image_item(path: str, spec: Any) -> tuple[str, str]:
    from PIL import Image

    from lmstack.data.mm import image_seqlen, regularized_size

    with Image.open(path) as image:
        w, h = regularized_size(image.width, image.height, spec)
        facts = f"{image.width}x{image.height} (resized {w}x{h}), {image_seqlen(w, h, spec)} image tokens"
        return thumbnail_url(image), facts


def _video_item(path: str, spec: Any) -> tuple[str, str]:
    from lmstack.data.mm_av import load_videos, video_text

    decoded = load_videos([path], spec)[0]
    _, tokens = video_text(path, spec)
    frames = f"{decoded.sampled} sampled frames ({len(decoded.frames)} fed to the model)"
    return thumbnail_url(decoded.frames[0]), f"{frames}, {tokens} video tokens"


def _audio_item(path: str, spec: Any) -> tuple[str, str]:
    import soundfile

    from lmstack.data.mm_av import audio_text

    info = soundfile.info(path)
    _, tokens = audio_text(path, spec)
    facts = (
        f"{info.frames / info.samplerate:.2f} s at {info.samplerate} Hz (read at {spec.audio.sampling_rate} "
        f"Hz), {tokens} audio tokens"
    )
    return "", facts


ITEMS = {"images": _image_item, "videos": _video_item, "audios": _audio_item}


def media_spec_of(flat: dict[str, Any]) -> Any:
    """The media spec training builds from this YAML (None for a text-only model)."""
    from lmstack.config.load import build_config
    from lmstack.data.mm import media_spec
    from lmstack.infer.trained import NO_OUTPUT_DIR

    flat = dict(flat)
    flat["output_dir"] = flat.get("output_dir") or NO_OUTPUT_DIR
    return media_spec(build_config(flat))


def media_html(flat: dict[str, Any], report: dict) -> str:
    """The example's media as HTML; "" when the example has none (a text-only dataset)."""
    media = report.get("example_media") or {}
    if not media:
        return ""
    spec = media_spec_of(flat)
    rows = []
    for key, paths in media.items():
        for i, path in enumerate(paths):
            url, facts = ITEMS[key](path, spec)
            img = f'<img src="{url}" alt="{html.escape(key)}[{i}]"> ' if url else ""
            name = html.escape(f"{key}[{i}] {Path(path).name}: {facts}")
            rows.append(f'<div class="lm-media-item">{img}<span>{name}</span></div>')
    return '<div class="lm-media">' + "".join(rows) + "</div>"
