"""A folder replaced as a whole (an export): the new content is written into a staging folder beside
it (same parent, so the rename never turns into a copy), fsynced, given a manifest.json (the
checkpoint format, `kind` says what it is), verified, and then swapped in with one atomic exchange
(Linux renameat2 RENAME_EXCHANGE). A kill at any point leaves the previous complete folder or the new
one, never a mix; the staging folder a killed write leaves is removed by the next write.

Files in the old folder that the old content did not write (a user's notes) are carried into the new
one and listed under `kept`, so the next replacement carries them again."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from lmstack.reliability.checkpoint import (
    MANIFEST,
    fsync_path,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)

logger = logging.getLogger(__name__)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.staging"


def begin(final: Path) -> Path:
    """An empty staging folder for `final` (whatever a killed write left there is removed first)."""
    staged, old = staging_dir(final), final.parent / f".{final.name}.replaced"
    if old.is_dir() and not final.exists():  # killed between the two renames of `commit`'s fallback
        os.replace(old, final)
        logger.warning("restored %s, moved aside by a write that did not finish", final)
    shutil.rmtree(old, ignore_errors=True)
    if staged.exists():
        logger.warning("removed %s, left by a write of %s that did not finish", staged, final)
        shutil.rmtree(staged)
    final.parent.mkdir(parents=True, exist_ok=True)
    staged.mkdir()
    return staged


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (True), or False where the platform/file system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return done == 0


def _owned(folder: Path, is_output: Callable[[str], bool]) -> set[str]:
    """Names of `folder`'s files that its writer produced: its manifest's files (less what it kept
    from before), or without a manifest the names `is_output` recognises."""
    manifest = read_manifest(folder)
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if manifest is None:
        return {n for n in names if is_output(n)}
    return (set(manifest.get("files") or {}) - set(manifest.get("kept") or [])) | {MANIFEST}


def _carry_foreign(final: Path, staged: Path, is_output: Callable[[str], bool]) -> list[str]:
    if not final.is_dir():
        return []
    owned = _owned(final, is_output)
    kept = []
    for path in sorted(p for p in final.rglob("*") if p.is_file()):
        name = path.relative_to(final).as_posix()
        if name in owned or name == f".{MANIFEST}.tmp" or (staged / name).exists():
            continue
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, staged / name)
        except OSError:
            shutil.copy2(path, staged / name)
        kept.append(name)
    return kept


def _discard(old: Path) -> None:
    shutil.rmtree(old, ignore_errors=True)


def commit(staged: Path, final: Path, meta: dict, is_output: Callable[[str], bool]) -> Path:
    """Manifest into `staged`, verify it, then put it in `final`'s place in one step."""
    kept = _carry_foreign(final, staged, is_output)
    write_manifest(staged, {**meta, "kept": kept})
    reason = verify_checkpoint(staged)
    if reason:
        raise OSError(f"{staged}: the written files do not verify ({reason}); {final} is left as it was")
    if not final.exists():
        os.replace(staged, final)
    elif _exchange(staged, final):
        _discard(staged)  # now the old content
    else:  # no atomic exchange here: the old folder is moved aside for the instant of the rename
        old = final.parent / f".{final.name}.replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        _discard(old)
    fsync_path(final.parent)
    return final


def incomplete(folder: Path, kind: str) -> str | None:
    """Why `folder` (written by this module as `kind`) is not complete, or None. A folder without a
    manifest is not judged (written by another tool, or by an older lmstack)."""
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("kind") != kind:
        return None
    for name, entry in (manifest.get("files") or {}).items():  # files added afterwards are the user's
        path = folder / name
        if not path.is_file():
            return f"{name} is listed in {MANIFEST} but missing"
        if path.stat().st_size != entry.get("size"):
            return f"{name} has {path.stat().st_size} bytes, {MANIFEST} says {entry.get('size')}"
    return None
