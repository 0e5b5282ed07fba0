"""The model folder's config.json, read without transformers (the run plan's dtype and model-type
decisions read it; a hub id or an unreadable file gives None)."""

from __future__ import annotations

from lmstack.config.schema import Config
from lmstack.memory import model_facts


def config_json(cfg: Config) -> dict | None:
    return model_facts.config_json(cfg.model.model_name_or_path)
