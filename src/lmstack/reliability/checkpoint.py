"""Atomic checkpoints. A `checkpoint-N` folder counts only when its `manifest.json` (written last)
lists every file with its size and sha256 and every file matches. Saves go to a staging folder in
the same parent (`.checkpoint-N.staging/checkpoint-N`), are fsynced, get the manifest, then one
rename puts them in place. Resume takes the newest checkpoint that verifies and logs every skipped
candidate with the reason."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from lmstack.config.errors import ConfigError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "lmstack-checkpoint/1"
_CKPT = re.compile(r"^checkpoint-(\d+)$")
_STAGING = re.compile(r"^\.checkpoint-(\d+)\.(staging|replaced|deleting)$")


def checkpoint_step(path: Path) -> int | None:
    match = _CKPT.match(path.name)
    return int(match.group(1)) if match else None


def is_staging(path: Path) -> bool:
    """A folder left by a save (`.checkpoint-N.staging|replaced|deleting`): lmstack's, never resumed."""
    return path.is_dir() and bool(_STAGING.match(path.name))


def staging_root(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f".checkpoint-{step}.staging"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directory entries: the rename/creation itself)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:  # some filesystems refuse to open directories; the data files are what matter
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path, meta: dict | None = None) -> dict:
    """fsync every file, then write manifest.json atomically (tmp + fsync + replace). Returns it."""
    files = {}
    for path in _files(folder):
        fsync_path(path)
        files[path.relative_to(folder).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": sha256_file(path),
        }
    for sub in sorted({p.parent for p in _files(folder)} | {folder}, reverse=True):
        fsync_path(sub)
    manifest = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(meta or {}),
        "files": files,
    }
    tmp = folder / f".{MANIFEST}.tmp"
    with tmp.open("w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)
    fsync_path(folder)
    return manifest


def verify_checkpoint(folder: Path, deep: bool = True) -> str | None:
    """None when `folder` is a complete checkpoint; otherwise the reason it is not."""
    path = folder / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} (the save did not finish, or it was not written by lmstack)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
            raise ValueError("unknown format")
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    for name, entry in files.items():
        target = folder / name
        if not target.is_file():
            return f"{name} is listed in {MANIFEST} but missing"
        size = target.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, {MANIFEST} says {entry['size']} (truncated or rewritten)"
    extra = [p.relative_to(folder).as_posix() for p in _files(folder)]
    extra = [name for name in extra if name not in files and not name.startswith(".")]
    if extra:
        return f"{', '.join(extra)} not listed in {MANIFEST} (added after the save)"
    if deep:
        for name, entry in files.items():
            if sha256_file(folder / name) != entry["sha256"]:
                return f"{name}: sha256 differs from {MANIFEST} (the file is corrupted)"
    return None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """checkpoint-N folders, newest (highest N) first. A symbolic link named checkpoint-N is not one:
    resuming from it or rotating it would read or delete a folder outside output_dir."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if p.is_dir() and not p.is_symlink() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0, reverse=True)


def linked_checkpoints(output_dir: str | Path) -> list[Path]:
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.is_symlink() and checkpoint_step(p) is not None)


def read_manifest(folder: Path) -> dict | None:
    """The manifest.json of an lmstack checkpoint (None: absent, unreadable or another format)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def select_resume_checkpoint(output_dir: str | Path, deep: bool = True, quiet: bool = False) -> Path | None:
    """The newest checkpoint that verifies (sizes, and sha256 when `deep`); logs each skipped one and
    why (unless `quiet`)."""
    if not quiet:
        for link in linked_checkpoints(output_dir):
            logger.warning(
                "resume: skipping %s: a symbolic link to %s (lmstack neither resumes from nor rotates a "
                "checkpoint outside output_dir; copy it in, or give it as resume_from_checkpoint: <folder>)",
                link,
                link.resolve(),
            )
    for folder in list_checkpoints(output_dir):
        reason = verify_checkpoint(folder, deep=deep)
        if reason is None:
            return folder
        if not quiet:
            logger.warning("resume: skipping %s: %s", folder, reason)
    return None


def refuse_linked(out: Path) -> None:
    links = linked_checkpoints(out)
    if links:
        raise ConfigError(
            f"output_dir: {out} holds "
            + ", ".join(f"{p.name} -> {p.resolve()}" for p in links)
            + ": a symbolic link named like a checkpoint. lmstack neither resumes from nor rotates (deletes) "
            "a checkpoint outside output_dir; remove the link, copy the checkpoint into output_dir, or give "
            "its folder as resume_from_checkpoint: <path>"
        )


def check_trainer_state(checkpoint: Path) -> None:
    """The checkpoint's trainer_state.json is a JSON object whose global_step is the N of checkpoint-N
    (the manifest proves the bytes are those saved, not that they make sense)."""
    path = checkpoint / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
        step = state.get("global_step") if isinstance(state, dict) else None
        problem = None if isinstance(step, int) else f"its global_step is {step!r}, not a step number"
    except OSError as err:
        problem = f"it cannot be read ({err.strerror})"
    except ValueError as err:
        problem = f"it is not valid JSON ({err})"
    expected = checkpoint_step(checkpoint)
    if problem is None and expected is not None and step != expected:
        problem = f"its global_step is {step}, the folder is checkpoint-{expected}"
    if problem:
        raise ConfigError(
            f"resume_from_checkpoint: {path}: {problem}; the checkpoint cannot be resumed from. Resume from "
            "another checkpoint-N (delete this one, and `auto` takes the newest other), or set "
            "overwrite_output_dir: true to train again"
        )


def clean_staging(output_dir: str | Path) -> list[Path]:
    """Remove folders left by saves that were killed midway (`.checkpoint-N.staging` etc.)."""
    out = Path(output_dir)
    removed = []
    if out.is_dir():
        for path in out.iterdir():
            if is_staging(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                logger.warning("removed %s, left by a save that did not finish", path)
    return removed


def commit_checkpoint(staged: Path, final: Path, meta: dict | None = None) -> Path:
    """Manifest into `staged`, then rename it to `final` (a same-named older folder is replaced)."""
    write_manifest(staged, meta)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def delete_checkpoint(folder: Path) -> None:
    """Manifest first (so a half-deleted folder never verifies), then the rest. Never through a link."""
    if folder.is_symlink():
        raise OSError(f"{folder} is a symbolic link; lmstack deletes no checkpoint outside output_dir")
    (folder / MANIFEST).unlink(missing_ok=True)
    trash = folder.parent / f".{folder.name}.deleting"
    try:
        os.replace(folder, trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


def rotate_checkpoints(output_dir: str | Path, limit: int | None, keep: tuple[str, ...] = ()) -> list[Path]:
    """At most `limit` complete checkpoints, `keep` (the best one) counted among them as transformers
    counts it: the newest ones fill the rest, and the newest always stays (limit 1 with an older best
    keeps two until the Trainer drops the newest at the end). Older complete ones are deleted; folders
    without a manifest are left alone (they are never resumed from)."""
    if not limit:
        return []
    complete = [p for p in list_checkpoints(output_dir) if verify_checkpoint(p, deep=False) is None]
    keep_paths = {Path(k).resolve() for k in keep if k}
    kept = [p for p in complete if p.resolve() in keep_paths]
    newest = max(limit, 1)
    while newest > 1 and len({*complete[:newest], *kept}) > limit:
        newest -= 1
    retained = {*complete[:newest], *kept}
    deleted = []
    for folder in complete:
        if folder in retained:
            continue
        delete_checkpoint(folder)
        deleted.append(folder)
        logger.info("save_total_limit: %d -> deleted %s", limit, folder)
    return deleted
