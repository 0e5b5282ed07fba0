"""The final outputs of a run in output_dir (adapter or model, tokenizer, trainer_state.json, results)
are written beside the checkpoints, so they cannot be renamed into place as one folder. Instead a
marker says whether they are whole: `.final_save_pending` is written before the first of them and
removed only after `final_outputs.json` (every top-level file with its size and sha256) is written
last. A save stopped midway (a kill, a full disk) leaves the pending marker, so a truncated
tokenizer.json beside a complete adapter is never taken for a finished run: chat, api, export and a
resume check `incomplete()` (a resume writes the outputs again from the last checkpoint)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lmstack.reliability.checkpoint import fsync_path, sha256_file

PENDING = ".final_save_pending"
FINAL = "final_outputs.json"
FORMAT = "lmstack-final-outputs/1"


def begin(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / PENDING).write_text("the final save of this run did not finish\n")
    fsync_path(out / PENDING)
    (out / FINAL).unlink(missing_ok=True)
    fsync_path(out)


def complete(out: Path) -> None:
    """Lists the files this save wrote (modified since begin()): an earlier run's files left in the
    folder are not this run's outputs, and a user deleting them must not make the folder look torn."""
    files = {}
    started = (out / PENDING).stat().st_mtime_ns if (out / PENDING).is_file() else 0
    for path in sorted(p for p in out.iterdir() if p.is_file() and not p.name.startswith(".")):
        if path.name != FINAL and path.stat().st_mtime_ns >= started:
            fsync_path(path)
            files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    tmp = out / f".{FINAL}.tmp"
    with tmp.open("w") as fh:
        json.dump({"format": FORMAT, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / FINAL)
    (out / PENDING).unlink(missing_ok=True)
    fsync_path(out)


def incomplete(folder: Path) -> str | None:
    """Why the final outputs in `folder` are not whole, or None (also for a folder without either
    marker: written by another tool, a checkpoint-N, or an older lmstack)."""
    if (folder / PENDING).is_file():
        return f"its final save did not finish ({PENDING} is there: the run was stopped or the disk filled)"
    try:
        listed = json.loads((folder / FINAL).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{FINAL} is unreadable ({err})"
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is listed in {FINAL} but missing"
        if path.stat().st_size != entry.get("size"):
            return f"{name} has {path.stat().st_size} bytes, {FINAL} says {entry.get('size')}"
    return None
