"""The videos and audio of a batch (data/mm_av.py): decoded and processed per batch, as images are
(the tokenized cache holds ids and paths only). Videos: `pixel_values_videos`, `video_grid_thw` (+
`second_per_grid_ts` for Qwen2.5-VL; Qwen3-VL's frames and resize: media_video_qwen3.py), and `mm_token_type_ids` 2 at the video tokens (transformers' Qwen2-VL
rope index reads 1 = image, 2 = video). Audio: `input_features`, `feature_attention_mask`. Each sample must
still hold the tokens its files make now (a file replaced since tokenizing is named, not fed)."""

from __future__ import annotations

from typing import Any

from lmstack.config.errors import DataError
from lmstack.data.media_audio import AUDIO_TOKENS, audio_inputs, audio_seqlen
from lmstack.data.media_video import VIDEO_TOKENS
from lmstack.data.mm_av import load_audios, load_videos, sample_paths, video_inputs


class AVBatcher:
    def __init__(self, spec: Any, tokenizer: Any, feature_extractor: Any = None, token_types: bool = False):
        self.spec = spec
        self.feature_extractor = feature_extractor
        self.token_types = token_types
        self.video_id = tokenizer.convert_tokens_to_ids(VIDEO_TOKENS[1]) if spec.video is not None else None
        self.audio_id = tokenizer.convert_tokens_to_ids(AUDIO_TOKENS[1]) if spec.audio is not None else None

    def add(self, batch: dict, features: list[dict]) -> None:
        ids = batch["input_ids"]
        if self.spec.video is not None:
            per_sample = [sample_paths(f, "videos") for f in features]
            decoded = load_videos([p for s in per_sample for p in s], self.spec)
            if decoded:
                inputs = video_inputs(decoded, self.spec)
                per_video = (inputs["video_grid_thw"].prod(-1) // self.spec.video.merge_size**2).tolist()
                self._check(ids, per_sample, per_video, self.video_id, "video")
                batch.update(inputs)
            if self.token_types and "mm_token_type_ids" in batch:
                batch["mm_token_type_ids"][ids == self.video_id] = 2
        if self.spec.audio is not None:
            per_sample = [sample_paths(f, "audios") for f in features]
            waves = load_audios([p for s in per_sample for p in s], self.spec)
            if waves:
                inputs = audio_inputs(waves, self.spec.audio, self.feature_extractor)
                per_audio = [audio_seqlen(int(n)) for n in inputs["feature_attention_mask"].sum(-1).tolist()]
                self._check(ids, per_sample, per_audio, self.audio_id, "audio")
                batch.update(inputs)

    @staticmethod
    def _check(ids: Any, per_sample: list[list[str]], counts: list[int], token_id: int, noun: str) -> None:
        queue = iter(counts)
        for i, paths in enumerate(per_sample):
            want = sum(next(queue) for _ in paths)
            have = int((ids[i] == token_id).sum())
            if have != want:
                raise DataError(
                    f"{noun} {', '.join(paths)}: the tokenized sample holds {have} {noun} tokens, lmstack makes "
                    f"{want} for these files now (changed since they were tokenized?); set overwrite_cache: "
                    "true to tokenize again"
                )


def load_feature_extractor(cfg: Any) -> Any:
    """The model's Whisper-style feature extractor (numpy; needs no torchvision)."""
    from transformers import AutoFeatureExtractor

    m = cfg.model
    token = m.hf_hub_token.get_secret_value() if m.hf_hub_token else None
    return AutoFeatureExtractor.from_pretrained(
        m.model_name_or_path, cache_dir=m.cache_dir, revision=m.model_revision, token=token
    )


def media_collator(cfg: Any, tokenizer: Any, spec: Any, load_image_processor: Any) -> Any:
    """The collator of a multimodal model's batches: images (the processor `load_image_processor(cfg)`
    loads), videos, audio (its feature extractor). An audio model loads no image processor."""
    from lmstack.data.mm_collate import MediaCollator

    audio_only = spec.plugin == "qwen2_audio"
    image_processor = None if audio_only else load_image_processor(cfg)
    image_id = -1 if audio_only else tokenizer.convert_tokens_to_ids(spec.tokens[1])
    collator = MediaCollator(tokenizer.pad_token_id, spec, image_processor, image_id)
    if spec.video is not None or spec.audio is not None:
        extractor = load_feature_extractor(cfg) if spec.audio is not None else None
        collator.av = AVBatcher(spec, tokenizer, extractor, collator.token_types)
    return collator
