"""What the form offers to pick from: the datasets of `dataset_info.json` (with record counts) and the
built-in chat templates."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from lmstack.config.errors import LmstackError
from lmstack.data.registry import FILE_TYPES, get_dataset_attrs, read_registry

_COUNTS: dict[tuple[str, int, int], int | None] = {}  # (path, size, mtime) -> records


def count_records(path: Path) -> int | None:
    """Records in one data file (None when the type cannot be counted cheaply)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _COUNTS:
        _COUNTS[key] = _count(path)
    return _COUNTS[key]


def _count(path: Path) -> int | None:
    kind = FILE_TYPES.get(path.suffix.lower())
    try:
        if path.suffix.lower() == ".jsonl" or kind == "text":
            with path.open(encoding="utf-8") as fh:
                return sum(1 for line in fh if line.strip())
        if kind == "json":
            data = json.loads(path.read_text(encoding="utf-8"))
            return len(data) if isinstance(data, list) else None
        if kind == "csv":
            with path.open(encoding="utf-8", newline="") as fh:
                return max(sum(1 for _ in csv.reader(fh)) - 1, 0)
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
    except (OSError, ValueError, ImportError):
        return None
    return None


def _records(source: Path) -> int | None:
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    counts = [count_records(p) for p in files if p.suffix.lower() in FILE_TYPES]
    return sum(counts) if counts and None not in counts else None


def list_datasets(dataset_dir: str) -> tuple[list[tuple[str, str]], str]:
    """([(label, name)] for a multi-select, a note: '' or why the list is empty or partial)."""
    try:
        _, table = read_registry(dataset_dir)
    except LmstackError as err:
        return [], str(err)
    choices, problems = [], []
    for name in table:
        try:
            (attr,) = get_dataset_attrs(name, dataset_dir)
        except LmstackError as err:
            problems.append(str(err))
            continue
        if attr.load_from != "file":
            size = "hub"
        else:
            n = attr.num_samples or _records(Path(attr.source))
            size = f"{n} records" if n is not None else "? records"
        kind = f"{attr.formatting}, pairwise" if attr.ranking else attr.formatting
        choices.append((f"{name} ({size}, {kind})", name))
    return choices, "\n".join(problems)


def template_choices() -> list[str]:
    from lmstack.templates import list_templates

    return list_templates()
