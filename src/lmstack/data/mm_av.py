"""Videos and audio of a record, next to its images (data/mm.py): the `videos` / `audios` columns checked
(paths inside dataset_dir, one file per `<video>` / `<audio>` placeholder, counted over all messages, as
LLaMA-Factory's `_validate_messages`), the placeholders expanded into the model's tokens
(media_video.py, media_audio.py), and the encoded sample's `videos` / `audios` columns (JSON lists of
absolute paths) that the collator reads.

Media tokens are never cut by cutoff_len: a sample whose video or audio tokens truncation would cut is
dropped and counted ("video tokens cut by cutoff_len" / "audio tokens cut by cutoff_len" in the run's
data summary and `lmstack check`), as images are; LLaMA-Factory instead truncates the ids and the model
then fails on a token/feature count mismatch.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from lmstack.data.encode_common import DropExample
from lmstack.data.formats import RecordError
from lmstack.data.media_audio import AUDIO_PLACEHOLDER, AUDIO_TOKENS, audio_frames, audio_seqlen, load_audio
from lmstack.data.media_video import VIDEO_PLACEHOLDER, VIDEO_TOKENS, decode_video, grid_thw, video_seqlen
from lmstack.data.media_video import video_inputs as qwen2_video_inputs
from lmstack.data.media_video_qwen3 import Qwen3VideoSpec
from lmstack.data.media_video_qwen3 import video_inputs as qwen3_video_inputs
from lmstack.data.media_video_qwen3 import video_text as qwen3_video_text

VIDEOS_CUT = "video tokens cut by cutoff_len"
AUDIOS_CUT = "audio tokens cut by cutoff_len"
KINDS = {"videos": (VIDEO_PLACEHOLDER, "video"), "audios": (AUDIO_PLACEHOLDER, "audio")}


def frame_resizer(spec: Any) -> Any:
    """PIL frame -> PIL frame: LLaMA-Factory's image resize under video_max_pixels / video_min_pixels."""
    from lmstack.data.mm import regularize

    frame_spec = replace(spec, image_max_pixels=spec.video.max_pixels, image_min_pixels=spec.video.min_pixels)
    return lambda image: regularize(image, frame_spec)


def load_videos(paths: list[str], spec: Any) -> list[Any]:
    """The decoded, sampled, regularized videos (media_video.Decoded) of `paths`."""
    resize = frame_resizer(spec)
    return [decode_video(p, spec.video, resize) for p in paths]


def load_audios(paths: list[str], spec: Any) -> list[Any]:
    return [load_audio(p, spec.audio.sampling_rate) for p in paths]


def _paths(example: dict, key: str, spec: Any) -> tuple[list[str], str]:
    from lmstack.data.mm import media_list, resolve_media

    column = example.get(f"{key}_field") or key
    raw = media_list(example.get(key), column)
    return [resolve_media(p, spec, f"{column}[{i}]") for i, p in enumerate(raw)], column


def _count(example: dict, placeholder: str) -> int:
    return sum(m["content"].count(placeholder) for m in example["prompt"] + example["response"])


def _unreadable(field: str, path: str, err: Exception) -> RecordError:
    return RecordError(field, "unreadable media file", f"{path}: {type(err).__name__}: {err}")


def expand_av(example: dict, spec: Any) -> tuple[dict, dict[str, list[str]], dict[str, int]]:
    """(example with each `<video>` / `<audio>` replaced by its tokens, the absolute paths per kind, the
    token count per kind); placeholders and files must match one for one."""
    paths: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    for key, (placeholder, noun) in KINDS.items():
        if getattr(spec, noun) is None:  # a model without it: its column was refused before any record
            continue
        files, column = _paths(example, key, spec)
        found = _count(example, placeholder)
        if found != len(files):
            raise RecordError(
                column,
                "media count mismatch",
                f"{found} {placeholder} placeholder(s) in the messages but {len(files)} {noun} file(s) in "
                f"{column}; put one {placeholder} in the text where each {noun} goes",
            )
        if not files:
            continue
        texts = []
        for i, path in enumerate(files):
            try:
                texts.append(video_text(path, spec) if noun == "video" else audio_text(path, spec))
            except (OSError, ValueError, RuntimeError) as err:  # av / soundfile errors derive from these
                raise _unreadable(f"{column}[{i}]", path, err) from None
        example = _expand(example, placeholder, [text for text, _ in texts])
        paths[key], tokens[key] = files, sum(n for _, n in texts)
    return example, paths, tokens


def video_text(path: str, spec: Any) -> tuple[str, int]:
    """(the text one `<video>` of this file becomes, its `<|video_pad|>` count): Qwen3-VL's timestamped
    frame groups (media_video_qwen3.py), else one `<|vision_start|>` pads `<|vision_end|>` block."""
    decoded = load_videos([path], spec)[0]
    if isinstance(spec.video, Qwen3VideoSpec):
        return qwen3_video_text(decoded, spec.video)
    first = decoded.frames[0]
    n = video_seqlen(grid_thw(len(decoded.frames), first.width, first.height, spec.video), spec.video)
    return VIDEO_TOKENS[0] + VIDEO_TOKENS[1] * n + VIDEO_TOKENS[2], n


def audio_text(path: str, spec: Any) -> tuple[str, int]:
    """(the text one `<audio>` of this file becomes, its `<|AUDIO|>` count)."""
    n = audio_seqlen(audio_frames(len(load_audios([path], spec)[0]), spec.audio))
    return AUDIO_TOKENS[0] + AUDIO_TOKENS[1] * n + AUDIO_TOKENS[2], n


def video_inputs(decoded: list[Any], spec: Any) -> dict:
    """The model inputs of decoded videos (media_video.Decoded) under the media spec's video spec."""
    if isinstance(spec.video, Qwen3VideoSpec):
        return qwen3_video_inputs(decoded, spec.video)
    return qwen2_video_inputs(decoded, spec.video)


def _expand(example: dict, placeholder: str, texts: list[str]) -> dict:
    queue = iter(texts)

    def expand(text: str) -> str:
        parts = text.split(placeholder)
        return parts[0] + "".join(next(queue) + part for part in parts[1:])

    out = dict(example)
    for key in ("prompt", "response"):
        out[key] = [dict(m, content=expand(m["content"])) for m in example[key]]
    return out


def expand_inference(messages: list[dict], videos: list[str], audios: list[str], spec: Any) -> list[dict]:
    """Chat / API messages with their videos' and audios' tokens (paths already resolved); no placeholder
    at all: LLaMA-Factory's inference rule, one per file at the start of the first message."""
    for files, (placeholder, noun) in ((videos, KINDS["videos"]), (audios, KINDS["audios"])):
        if not files:
            continue
        if getattr(spec, noun) is None:
            raise ValueError(f"this {spec.model_type} model takes no {noun}")
        if not any(placeholder in m["content"] for m in messages):
            messages = [
                dict(messages[0], content=placeholder * len(files) + messages[0]["content"])
            ] + messages[1:]
        example = {"prompt": messages, "response": []}
        if _count(example, placeholder) != len(files):
            raise ValueError(
                f"{_count(example, placeholder)} {placeholder} placeholder(s) for {len(files)} {noun}(s)"
            )
        texts = [video_text(p, spec) if noun == "video" else audio_text(p, spec) for p in files]
        messages = _expand(example, placeholder, [text for text, _ in texts])["prompt"]
    return messages


def finish_av(sample: dict, paths: dict[str, list[str]], tokens: dict[str, int], tokenizer: Any) -> dict:
    """The encoded sample with its `videos` / `audios` columns; dropped when truncation cut their tokens."""
    for key, want in tokens.items():
        token = (VIDEO_TOKENS if key == "videos" else AUDIO_TOKENS)[1]
        token_id = tokenizer.convert_tokens_to_ids(token)
        for ids in [k for k in sample if k.endswith("input_ids")]:  # sft: one row; dpo: two
            kept = sum(1 for t in sample[ids] if t == token_id)
            if kept != want:
                raise DropExample(
                    f"cutoff_len keeps {kept} of the {want} {key[:-1]} tokens of this record (the model needs "
                    f"all of them); raise cutoff_len or lower {'video_max_pixels / video_maxlen' if key == 'videos' else 'the audio length'}",
                    kind=VIDEOS_CUT if key == "videos" else AUDIOS_CUT,
                )
    return {**sample, **{key: json.dumps(paths.get(key, [])) for key in KINDS}}


def sample_paths(feature: dict, key: str) -> list[str]:
    """The absolute media paths of one encoded sample's `videos` / `audios` column."""
    return json.loads(feature.get(key) or "[]")


def av_stats(key: str, path_lists: list[str], rows: Any, tokenizer: Any) -> dict:
    """`lmstack check`'s summary of a dataset's kept samples' videos / audio: files, samples with one,
    and their tokens (from the ids, as training feeds them)."""
    token_id = tokenizer.convert_tokens_to_ids((VIDEO_TOKENS if key == "videos" else AUDIO_TOKENS)[1])
    # dpo rows: the chosen ids' tokens (the rejected ids hold the same media)
    ids = "chosen_input_ids" if path_lists and "chosen_input_ids" in rows[0] else "input_ids"
    per = [(len(json.loads(text)), sum(1 for t in rows[i][ids] if t == token_id))
           for i, text in enumerate(path_lists)]  # fmt: skip
    tokens = [n for files, n in per if files]
    return {
        "files": sum(files for files, _ in per),
        "samples": len(tokens),
        "tokens": sum(tokens),
        "tokens_per_sample": {"min": min(tokens, default=0), "max": max(tokens, default=0)},
    }


def format_av(key: str, stats: dict) -> str:
    """One line of `lmstack check`'s text report."""
    if not stats["files"]:
        return f"    {key}: none"
    per = stats["tokens_per_sample"]
    return (
        f"    {key}: {stats['files']} in {stats['samples']} samples, {stats['tokens']} {key[:-1]} tokens "
        f"({per['min']}..{per['max']} per sample, counted in the lengths)"
    )
