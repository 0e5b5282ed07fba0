"""Audio in LLaMA-Factory's multimodal datasets (the `audios` column, `<audio>` placeholders) for
Qwen2-Audio (`Qwen2AudioForConditionalGeneration`).

Loading follows LLaMA-Factory's `_regularize_audios`, which is `librosa.load(path, sr=audio_sampling_rate)`:
the file decoded to float32 (soundfile: wav, flac, mp3 with libsndfile >= 1.1), channels averaged to mono,
resampled with soxr at high quality (librosa's default `soxr_hq`) and fixed to ceil(samples x ratio)
samples. lmstack does this itself with soundfile and soxr, without librosa.

Features: the model's Whisper feature extractor (numpy; no torchvision), as LLaMA-Factory calls it:
padded to its 30 s window (`padding="max_length"`), with the attention mask, renamed
`feature_attention_mask`. Each `<audio>` becomes `<|audio_bos|>` + `<|AUDIO|>` x n + `<|audio_eos|>`,
n = ((L - 1) // 2 + 1 - 2) // 2 + 1 for L mel frames of the audio (LLaMA-Factory's Qwen2AudioPlugin and
transformers' Qwen2AudioProcessor agree on it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUDIO_PLACEHOLDER = "<audio>"
AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
AUDIO_FAMILIES = ("qwen2_audio",)


@dataclass(frozen=True)
class AudioSpec:
    """What turning an audio file into features and tokens needs (plain values: part of the cache key)."""

    sampling_rate: int  # LF's audio_sampling_rate
    model_rate: int = 16000  # the rate the feature extractor reads (it refuses any other)
    hop_length: int = 160  # the feature extractor's
    n_samples: int = 480000  # its window: chunk_length x its sampling rate


def audio_spec(model_dir: str, data: Any) -> AudioSpec:
    """The audio spec of a Qwen2-Audio folder (its preprocessor_config.json) and audio_sampling_rate."""
    conf_path = Path(model_dir) / "preprocessor_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
    return AudioSpec(
        sampling_rate=int(data.audio_sampling_rate),
        model_rate=int(conf.get("sampling_rate", 16000)),
        hop_length=int(conf.get("hop_length", 160)),
        n_samples=int(conf.get("n_samples", 480000)),
    )


def load_audio(path: str, sampling_rate: int) -> Any:
    """The waveform of `path` as LLaMA-Factory reads it: float32 mono at `sampling_rate`."""
    import numpy as np
    import soundfile

    wave, native = soundfile.read(path, dtype="float32", always_2d=True)  # [samples, channels]
    wave = wave.mean(axis=1) if wave.shape[1] > 1 else wave[:, 0]
    if native != sampling_rate:
        import soxr

        size = int(math.ceil(len(wave) * sampling_rate / native))
        wave = soxr.resample(wave, native, sampling_rate, quality="soxr_hq").astype(np.float32)
        wave = wave[:size] if len(wave) >= size else np.pad(wave, (0, size - len(wave)))
    return np.ascontiguousarray(wave, dtype=np.float32)


def audio_frames(samples: int, spec: AudioSpec) -> int:
    """Mel frames the feature extractor's attention mask keeps for `samples` samples (its window caps them)."""
    return -(-min(samples, spec.n_samples) // spec.hop_length)


def audio_seqlen(frames: int) -> int:
    """`<|AUDIO|>` tokens of an audio of `frames` mel frames (the encoder halves twice)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def audio_inputs(waves: list[Any], spec: AudioSpec, feature_extractor: Any) -> dict:
    """The model inputs of a batch's audio: input_features [n, mels, 3000], feature_attention_mask."""
    if not waves:
        return {}
    out = dict(
        feature_extractor(
            waves,
            sampling_rate=spec.sampling_rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
    )
    out["feature_attention_mask"] = out.pop("attention_mask")
    return out
