"""The checks of a run's media datasets against its model, made before the tokenizer or the model loads:
which modality this model reads, which stages and options go with media, and whether the template
writes images the way the model reads them (data/mm.py holds the families' tables these checks read)."""

from __future__ import annotations

import logging
from typing import Any

from lmstack.config.errors import ConfigError, DataError
from lmstack.data.mm import (
    AUDIO_SUPPORTED,
    FAMILY_IMAGE_OPTIONS,
    MEDIA_STAGES,
    NO_VIDEO_WHY,
    PLUGIN_TEMPLATES,
    QWEN_VL_PLUGINS,
    SUPPORTED,
    VIDEO_SUPPORTED,
    MediaSpec,
    media_spec,
    model_type,
)

logger = logging.getLogger("lmstack.data.mm")


def check_media_datasets(
    cfg: Any, datasets: list[str], videos: list[str] | tuple = (), audios: list[str] | tuple = ()
) -> None:
    """A dataset with an images / videos / audios column needs a model that reads that modality, stage
    sft (images: also dpo) and no packing; refused before the tokenizer or the model loads, naming what
    to change. LF's image options of other families (pan-and-scan, crop_to_patches) are refused when on."""
    spec = media_spec(cfg)
    _check_media_options(cfg, spec)
    if not (datasets or videos or audios):
        return
    names = ", ".join(dict.fromkeys([*datasets, *videos, *audios]))
    kinds = [k for k, v in (("images", datasets), ("videos", videos), ("audios", audios)) if v]
    if spec is None:
        raise DataError(
            f"dataset {names} has {' and '.join(kinds)}, but model_name_or_path {cfg.model.model_name_or_path} "
            f"is a {model_type(cfg) or 'text'} model without a supported vision tower; image fine-tuning works "
            f"with model types {SUPPORTED}; video with {VIDEO_SUPPORTED}; audio with {AUDIO_SUPPORTED}"
        )
    for noun, sets, supported, ok in (
        ("image", datasets, SUPPORTED, spec.plugin != "qwen2_audio"),
        ("video", videos, VIDEO_SUPPORTED, spec.video is not None),
        ("audio", audios, AUDIO_SUPPORTED, spec.audio is not None),
    ):
        if sets and not ok:
            raise DataError(
                f"dataset {', '.join(sets)} has {noun} input, but {cfg.model.model_name_or_path} is a "
                f"{spec.model_type} model, which lmstack feeds no {noun}s"
                + (
                    f" ({NO_VIDEO_WHY[spec.model_type]})"
                    if noun == "video" and spec.model_type in NO_VIDEO_WHY
                    else ""
                )
                + f"; {noun} input works with model types {supported}"
            )
    if cfg.finetuning.stage not in MEDIA_STAGES or (cfg.finetuning.stage != "sft" and (videos or audios)):
        allowed = " or ".join(MEDIA_STAGES) if not (videos or audios) else "sft"
        raise ConfigError(
            f"stage: {cfg.finetuning.stage} with the {' and '.join(kinds)} of dataset {names} is not "
            f"supported yet; these datasets train with stage: {allowed}"
        )
    if cfg.finetuning.stage == "dpo" and cfg.finetuning.pref_loss in ("orpo", "simpo"):
        raise ConfigError(
            f"pref_loss: {cfg.finetuning.pref_loss} with images is not supported yet; use sigmoid, hinge or ipo"
        )
    if cfg.data.streaming:
        raise ConfigError(
            f"streaming: not available with {' and '.join(kinds)} (dataset {names}) yet; set streaming: false"
        )


def check_media_template(spec: MediaSpec | None, template: Any, datasets: list[str]) -> None:
    """The template must write images the way this model reads them (its mm_plugin)."""
    if not datasets or spec is None:
        return
    plugin = getattr(template, "mm_plugin", "")
    if plugin != spec.plugin:
        raise ConfigError(
            f"template: {getattr(template, 'name', template)!r} "
            + (f"writes images for {plugin}, not for" if plugin else "has no image support for")
            + f" this {spec.model_type} model (dataset {', '.join(datasets)} has images); use template: "
            f"{PLUGIN_TEMPLATES[spec.plugin]} (supported: {SUPPORTED})"
        )


def _check_media_options(cfg: Any, spec: MediaSpec | None) -> None:
    """The image / video / audio options and packing against what this model reads: a moved option with
    no effect warns, an option of another family or packing of media rows is refused."""
    defaults = type(cfg.data).model_fields
    changed = [
        f for f in ("image_max_pixels", "image_min_pixels") if getattr(cfg.data, f) != defaults[f].default
    ]
    if spec is None and changed:
        logger.warning(
            "%s: no effect on the text model %s", " / ".join(changed), cfg.model.model_name_or_path
        )
    for name, (family, what, plugin) in FAMILY_IMAGE_OPTIONS.items():
        if getattr(cfg.data, name) and (spec is None or spec.plugin != plugin):
            model = f"this {spec.model_type} model" if spec else f"model {cfg.model.model_name_or_path}"
            raise ConfigError(
                f"{name}: true is {family}'s {what} in LLaMA-Factory, and {model} has no such option "
                f"(lmstack reads images for model types {SUPPORTED}; of them only {family} has it); set "
                f"{name}: false or remove it"
            )
    av_fields = {
        "video": ("video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen"),
        "audio": ("audio_sampling_rate",),
    }
    for noun, fields in av_fields.items():
        moved = [f for f in fields if getattr(cfg.data, f) != defaults[f].default]
        if moved and (spec is None or getattr(spec, noun) is None):
            logger.warning("%s: no effect on %s, which reads no %s", " / ".join(moved),
                           cfg.model.model_name_or_path, noun)  # fmt: skip
    if spec is not None and spec.video is not None and cfg.data.video_max_pixels < cfg.data.video_min_pixels:
        raise ConfigError(
            f"video_max_pixels: got {cfg.data.video_max_pixels}, less than video_min_pixels "
            f"{cfg.data.video_min_pixels}; raise video_max_pixels or lower video_min_pixels"
        )
    if spec is not None and spec.audio is not None and spec.audio.sampling_rate != spec.audio.model_rate:
        raise ConfigError(
            f"audio_sampling_rate: got {spec.audio.sampling_rate}, but the feature extractor of "
            f"{cfg.model.model_name_or_path} reads audio at {spec.audio.model_rate} Hz only; set "
            f"audio_sampling_rate: {spec.audio.model_rate}"
        )
    for name in ("packing", "neat_packing") if spec is not None else ():
        if getattr(cfg.data, name):
            raise ConfigError(
                f"{name}: not available with the {'audio' if spec.plugin == 'qwen2_audio' else 'vision'} model {cfg.model.model_name_or_path}: it computes "
                f"{'its 3D rope positions' if spec.plugin in QWEN_VL_PLUGINS else 'its positions'} per sample "
                f"and packed rows would mix them; set {name}: false"
            )
