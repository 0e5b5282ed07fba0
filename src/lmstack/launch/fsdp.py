"""FSDP through accelerate (as LLaMA-Factory runs it): detect an FSDP launch and fill the layer class to wrap.

`accelerate launch --config_file examples/accelerate/fsdp_config.yaml -m lmstack.cli train x.yaml`
exports the config as environment variables (ACCELERATE_USE_FSDP, FSDP_AUTO_WRAP_POLICY, ...). When
the config leaves `fsdp_transformer_layer_cls_to_wrap` unset, lmstack fills it from the model
class's `_no_split_modules` (e.g. Qwen2DecoderLayer) so one config file serves every model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from lmstack.config.errors import ConfigError
from lmstack.launch.context import _true

logger = logging.getLogger(__name__)


def fsdp_requested(env: Mapping[str, str] | None = None) -> bool:
    """True when accelerate launched this process with an FSDP config."""
    env = os.environ if env is None else env
    return _true(env.get("ACCELERATE_USE_FSDP"))


def read_accelerate_config(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"accelerate config {path} not found")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"accelerate config {path}: expected a mapping")
    return data


def config_is_fsdp(data: Mapping) -> bool:
    return str(data.get("distributed_type", "")).upper() == "FSDP"


def decoder_layer_classes(model_name_or_path: str, trust_remote_code: bool = False) -> list[str]:
    """The model class's `_no_split_modules` (its decoder-layer class names), read without weights."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return []
    return list(getattr(model_cls, "_no_split_modules", None) or [])


def fill_wrap_class(
    model_name_or_path: str, trust_remote_code: bool = False, env: MutableMapping[str, str] | None = None
) -> str | None:
    """Under an FSDP launch with transformer-based wrapping and no class given, set
    FSDP_TRANSFORMER_CLS_TO_WRAP from the model; returns a log line when it did."""
    env = os.environ if env is None else env
    if not fsdp_requested(env) or env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        return None
    if env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").upper() != "TRANSFORMER_BASED_WRAP":
        return None
    classes = decoder_layer_classes(model_name_or_path, trust_remote_code)
    if not classes:
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap: {model_name_or_path} does not declare its decoder-layer "
            "class (_no_split_modules); set fsdp_transformer_layer_cls_to_wrap in the accelerate config"
        )
    env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = ",".join(classes)
    return f"FSDP: wrapping each {', '.join(classes)} (from the model's _no_split_modules)"
