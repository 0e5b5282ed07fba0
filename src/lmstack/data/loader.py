"""Read a registered dataset's raw records, each tagged with where it came from (file + index/line)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstack.config.errors import DataError
from lmstack.data.registry import FILE_TYPES, TOO_DEEP, DatasetAttr, read_utf8

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
    text = read_utf8(path)
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except RecursionError:
            if not text.lstrip().startswith("["):
                return _read_jsonl_text(path, text)  # one object per line: each line is judged alone
            index = _too_deep_record(text)
            raise DataError(f"{path} record {index}: {TOO_DEEP}") from None
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


_BETWEEN_RECORDS = re.compile(r"[\s,]*")


def _too_deep_record(text: str) -> int | str:
    """The index of the record of a JSON array that the reader cannot parse for its depth (parsed
    one record at a time, so only the error path pays for it)."""
    decoder, pos, index = json.JSONDecoder(), text.index("[") + 1, 0
    while True:
        pos = _BETWEEN_RECORDS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return "?"
        try:
            _, pos = decoder.raw_decode(text, pos)
        except RecursionError:
            return index
        except json.JSONDecodeError:
            return "?"
        index += 1


def _read_jsonl_text(path: Path, text: str) -> list[RawRecord]:
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(RawRecord(str(path), f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as err:
            out.append(RawRecord(str(path), f"line {lineno}", None, error=f"bad JSON line: {err.msg}"))
        except RecursionError:
            out.append(RawRecord(str(path), f"line {lineno}", None, error=f"bad JSON line: {TOO_DEEP}"))
    return out


def _read_text(path: Path) -> list[RawRecord]:
    return [
        RawRecord(str(path), f"line {i}", {"text": line})
        for i, line in enumerate(read_utf8(path).splitlines(), start=1)
        if line.strip()
    ]


def _check_csv(path: Path) -> None:
    """UTF-8, and every row as many fields as the header (a stray comma shifts the columns); blank
    lines are skipped, as the table reader skips them, so row numbers match the records' positions."""
    rows = csv.reader(io.StringIO(read_utf8(path), newline=""))
    header = next(rows, None)
    if header is None:
        return
    index = 0
    try:
        for row in rows:
            if not row:
                continue
            if len(row) != len(header):
                raise DataError(
                    f"{path} row {index} (line {rows.line_num}): {len(row)} field{'s' * (len(row) != 1)}, the header has "
                    f"{len(header)} ({', '.join(header)}); quote values that hold a comma "
                    "and give every row the same number of fields"
                )
            index += 1
    except csv.Error as err:
        raise DataError(f"{path} row {index} (line {rows.line_num}): not valid CSV: {err}") from None


def _read_table(path: Path, kind: str) -> list[RawRecord]:
    import datasets

    if kind == "csv":
        _check_csv(path)
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as err:  # the reader's own error names neither file nor row: add the file
        cause = err.__cause__ or err
        raise DataError(f"{path}: could not be read as {kind}: {type(cause).__name__}: {cause}") from None
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

    # a local folder is read again: datasets' own cache knows its files by mtime, and the content the
    # tokenized cache was keyed by (source_files) is what must be read
    local = Path(os.path.expanduser(attr.source)).exists()
    mode = "force_redownload" if local else None
    try:
        table = datasets.load_dataset(
            attr.source, name=attr.subset, data_dir=attr.folder, split=attr.split, download_mode=mode
        )
    except Exception as err:  # network, auth, missing split: say which dataset and why
        raise DataError(f"dataset {attr.name}: could not load {attr.source!r} from the hub: {err}") from None
    return [RawRecord(attr.source, f"row {i}", rec) for i, rec in enumerate(table)]


def _blob_hash(path: Path, name: str) -> str:
    """The hash the hub cache names a blob by: sha256 of an LFS file, git's blob sha1 of another."""
    h = hashlib.sha256() if len(name) == 64 else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_hub_blobs(attr: DatasetAttr, files: list[Path]) -> None:
    """A hub-cache snapshot's files are links to blobs named by their content's hash: a blob edited in
    place no longer matches its name, and datasets' own cache (keyed by the revision) would keep the
    data read before the edit. Refused, naming the file and the fix."""
    for path in files:
        blob = path.resolve()
        name = blob.name
        if (
            blob.parent.name != "blobs"
            or len(name) not in (40, 64)
            or any(c not in "0123456789abcdef" for c in name)
        ):
            continue
        if _blob_hash(blob, name) != name:
            raise DataError(
                f"dataset {attr.name}: {path} (hub cache blob {blob}) was changed after it was downloaded: its "
                "content no longer matches its hash; delete the dataset's folder in the hub cache and download "
                "it again, or copy the edited data to a folder and point hf_hub_url (or file_name) at it"
            )


def source_files(attr: DatasetAttr) -> tuple[Path, list[Path]] | None:
    """(root, files) of the data a dataset reads, for content digests (the tokenized cache's key, the
    run manifest, the resume check). A hub entry reads a local folder (its `hf_hub_url` is a path) or
    the hub cache's snapshot of the repo (offline, or once downloaded); None when the hub data is not
    on disk yet (its content cannot be told before loading)."""
    if attr.load_from == "file":
        src = Path(attr.source)
        return (
            (src.parent, [src]) if src.is_file() else (src, sorted(p for p in src.rglob("*") if p.is_file()))
        )
    root = Path(os.path.expanduser(attr.source))
    if not root.exists():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(attr.source, repo_type="dataset", local_files_only=True))
        except Exception:  # not in the hub cache (or not a repo id): unknown until loaded
            return None
        _check_hub_blobs(attr, sorted(p for p in root.rglob("*") if p.is_file()))
    if root.is_file():
        return root.parent, [root]
    within = root / attr.folder if attr.folder else root
    return root, sorted(
        p for p in within.rglob("*") if p.is_file() and ".cache" not in p.relative_to(root).parts
    )
