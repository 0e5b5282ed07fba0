"""The record of what a run's final save wrote into output_dir (lmstack_outputs.json): every file at
the top of output_dir that the save created or rewrote, with its size and mtime. An overwrite_output_dir
run removes the recorded files still as written (the adapter or model, tokenizer files, README.md, ...),
so a LoRA run's adapter never outlives it into a later full run's folder; a file changed since the save
is someone else's now and stays (output_dir.py)."""

from __future__ import annotations

import json
from pathlib import Path

OUTPUTS_RECORD = "lmstack_outputs.json"


def output_files(out: str | Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file at the top of `out`: taken before a final save, so the record of
    what the save wrote (record_outputs) holds only the files it wrote or rewrote."""
    folder = Path(out)
    if not folder.is_dir():
        return {}
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}


def record_outputs(out: str | Path, before: dict[str, tuple[int, int]]) -> None:
    """Writes the record: the files at the top of `out` that are new or changed since `before`."""
    written = {
        name: {"size": size, "mtime_ns": mtime}
        for name, (size, mtime) in output_files(out).items()
        if before.get(name) != (size, mtime) and name != OUTPUTS_RECORD
    }
    (Path(out) / OUTPUTS_RECORD).write_text(json.dumps({"files": written}, indent=1), encoding="utf-8")


def recorded_outputs(out: str | Path) -> set[str]:
    """The recorded files still as the final save wrote them (same size and mtime)."""
    try:
        files = json.loads((Path(out) / OUTPUTS_RECORD).read_text(encoding="utf-8")).get("files", {})
    except (OSError, ValueError, AttributeError):
        return set()
    now = output_files(out)
    return {
        name
        for name, seen in files.items()
        if isinstance(seen, dict) and now.get(name) == (seen.get("size"), seen.get("mtime_ns"))
    }
