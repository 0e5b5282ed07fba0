"""The one reader of a model folder's config.json (no torch, no transformers): the run plan, the memory
model, the data layer's media plugins and the loader's checks all read the same parsed dict.

A hub id, a missing file or a file that is not JSON gives None; callers say what that means for them.
The parse is cached on the file's identity (path, size, mtime), so a folder rewritten between two
reads (a test's tiny model, an export) is read again."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any


def config_json(model_dir: str | Path) -> dict[str, Any] | None:
    """config.json of `model_dir` as a dict (a fresh copy: callers may change it), or None."""
    path = Path(model_dir) / "config.json"
    try:
        st = os.stat(path)
    except OSError:
        return None
    parsed = _parse(str(path.resolve()), st.st_size, st.st_mtime_ns)
    return None if parsed is None else json.loads(parsed)


def model_type(model_dir: str | Path) -> str | None:
    """config.json's model_type, or None when there is none to read."""
    d = config_json(model_dir)
    kind = None if d is None else d.get("model_type")
    return kind if isinstance(kind, str) else None


@lru_cache(maxsize=64)
def _parse(path: str, size: int, mtime_ns: int) -> str | None:
    """The file's JSON text, normalised (kept as text so each caller gets its own dict)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return json.dumps(d) if isinstance(d, dict) else None
