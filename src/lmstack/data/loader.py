"""Read a registered dataset's raw records, each tagged with where it came from (file + index/line)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstack.config.errors import DataError
from lmstack.data.registry import FILE_TYPES, DatasetAttr

logger = logging.getLogger(__name__)


@dataclass
class RawRecord:
    file: str
    position: str  # "record 12" (json array) or "line 13" (jsonl/txt) or "row 4" (tables)
    data: Any
    error: str | None = None  # set when the raw line itself is unreadable (bad JSON line)


def _files(source: str) -> list[Path]:
    path = Path(source)
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    types = {FILE_TYPES.get(p.suffix) for p in files}
    if not files:
        raise DataError(f"{source}: folder is empty")
    if None in types or len(types) > 1:
        raise DataError(
            f"{source}: all files in a dataset folder must share one type "
            f"({', '.join(sorted(FILE_TYPES))}); found {', '.join(sorted(p.name for p in files))}"
        )
    return files


def _read_json(path: Path) -> list[RawRecord]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            if text.lstrip().startswith("["):
                raise DataError(
                    f"{path}: not valid JSON (line {err.lineno}, column {err.colno}): {err.msg}"
                ) from None
            return _read_jsonl_text(path, text)  # a .json file holding JSON lines
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON array of records, got {type(data).__name__}")
        return [RawRecord(str(path), f"record {i}", rec) for i, rec in enumerate(data)]
    return _read_jsonl_text(path, text)


def _read_jsonl_text(path: Path, text: str) -> list[RawRecord]:
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(RawRecord(str(path), f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as err:
            out.append(RawRecord(str(path), f"line {lineno}", None, error=f"bad JSON line: {err.msg}"))
    return out


def _read_text(path: Path) -> list[RawRecord]:
    return [
        RawRecord(str(path), f"line {i}", {"text": line})
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if line.strip()
    ]


def _read_table(path: Path, kind: str) -> list[RawRecord]:
    import datasets

    table = datasets.load_dataset(kind, data_files=str(path), split="train")
    return [RawRecord(str(path), f"row {i}", rec) for i, rec in enumerate(table)]


def read_records(attr: DatasetAttr) -> list[RawRecord]:
    if attr.load_from == "hf_hub":
        return _read_hub(attr)
    records: list[RawRecord] = []
    for path in _files(attr.source):
        kind = FILE_TYPES.get(path.suffix)
        if kind is None:
            raise DataError(
                f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_TYPES)}"
            )
        if kind == "json":
            records += _read_json(path)
        elif kind == "text":
            records += _read_text(path)
        else:
            records += _read_table(path, kind)
    return records


def _read_hub(attr: DatasetAttr) -> list[RawRecord]:
    """The real `datasets` hub path (online use only; tests use local files)."""
    import datasets

    try:
        table = datasets.load_dataset(attr.source, name=attr.subset, data_dir=attr.folder, split=attr.split)
    except Exception as err:  # network, auth, missing split: say which dataset and why
        raise DataError(f"dataset {attr.name}: could not load {attr.source!r} from the hub: {err}") from None
    return [RawRecord(attr.source, f"row {i}", rec) for i, rec in enumerate(table)]
