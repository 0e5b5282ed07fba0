"""The model folder's config.json, read without transformers (the run plan's dtype and model-type
decisions read it; a hub id or an unreadable file gives None)."""

from __future__ import annotations

import json
from pathlib import Path

from lmstack.config.schema import Config


def config_json(cfg: Config) -> dict | None:
    try:
        return json.loads((Path(cfg.model.model_name_or_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
