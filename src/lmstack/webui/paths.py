"""Which files Load/Save YAML may touch: the UI's working folder (the cwd at launch), the folders given
with `--allow-dir`, and Gradio's upload cache (for the upload button). Anything else is refused, after
resolving symlinks and `..`; errors never show what a file holds."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lmstack.config.errors import ConfigError


def upload_dir() -> Path:
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()


def roots(allow_dirs: list[str] | None = None, cwd: str | None = None) -> list[Path]:
    return [Path(cwd or os.getcwd()).resolve(), *(Path(d).expanduser().resolve() for d in allow_dirs or [])]


def confine(path: str, allowed: list[Path], uploads: bool = False) -> Path:
    """`path` resolved (relative to the first root), if it lies in one of `allowed`; else a ConfigError."""
    given = Path(str(path).strip()).expanduser()
    target = (given if given.is_absolute() else allowed[0] / given).resolve()
    ok = [*allowed, upload_dir()] if uploads else allowed
    if not any(target == root or target.is_relative_to(root) for root in ok):
        raise ConfigError(
            f"{path}: outside the folders this UI may read and write ({', '.join(map(str, allowed))}); "
            "start `lmstack webui` with --allow-dir DIR to add one"
        )
    return target
