"""dataset_info.json: the registry of named datasets (LLaMA-Factory's schema)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmstack.config.errors import DataError, did_you_mean

FORMATS = ("alpaca", "sharegpt", "openai")
FILE_TYPES = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
COLUMN_DEFAULTS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": None,
    "messages": "conversations",
    "system": None,
    "tools": None,
    "images": None,
    "videos": None,
    "audios": None,
    "chosen": None,
    "rejected": None,
    "kto_tag": None,
}
TAG_DEFAULTS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
MEDIA_COLUMNS = {"images": "<image>", "videos": "<video>", "audios": "<audio>"}  # column -> placeholder
OPENAI_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "function_call",
    "system_tag": "system",
}
ENTRY_KEYS = {
    "file_name",
    "hf_hub_url",
    "ms_hub_url",
    "om_hub_url",
    "script_url",
    "cloud_file_name",
    "formatting",
    "ranking",
    "subset",
    "split",
    "folder",
    "num_samples",
    "columns",
    "tags",
}


@dataclass
class DatasetAttr:
    name: str
    load_from: str  # file | hf_hub
    source: str  # path (file) or repo id (hub)
    formatting: str = "alpaca"
    ranking: bool = False
    subset: str | None = None
    split: str = "train"
    folder: str | None = None
    num_samples: int | None = None
    columns: dict[str, str | None] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def column(self, key: str) -> str | None:
        return self.columns.get(key, COLUMN_DEFAULTS[key])


def read_registry(dataset_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(dataset_dir) / "dataset_info.json"
    if not path.is_file():
        raise DataError(
            f"dataset_dir: {dataset_dir!s} has no dataset_info.json; create it or point dataset_dir at the "
            "folder that holds it"
        )
    try:
        table = json.loads(read_utf8(path))
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}: not valid JSON (line {err.lineno}, column {err.colno}): {err.msg}"
        ) from None
    except RecursionError:
        raise DataError(f"{path}: {TOO_DEEP}") from None
    if not isinstance(table, dict):
        raise DataError(f"{path}: expected an object keyed by dataset name")
    return path, table


def read_utf8(path: Path) -> str:
    """The file's text, a leading UTF-8 byte-order mark dropped (Windows editors write one; `json`
    refuses it and JSON-lines reading would then drop every record); a file that is not UTF-8 is
    refused naming the byte offset (and its line)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{path}: not UTF-8 text: byte 0x{data[err.start]:02x} at byte offset {err.start} (line {line}) "
            f"cannot be decoded ({err.reason}); save the file as UTF-8 (for a latin-1 file: "
            f"iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix})"
        ) from None


TOO_DEEP = "nested deeper than the JSON reader allows; flatten the value or remove the record"


def _parse_entry(name: str, entry: Any, registry: Path) -> DatasetAttr:
    where = f"{registry} [{name}]"
    if not isinstance(entry, dict):
        raise DataError(
            f"{where}: the entry is {json.dumps(entry)[:80]}, not an object; write it as "
            '{"file_name": "<file or folder in dataset_dir>", ...} or remove it'
        )
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise DataError(f"{where}: unknown key {key!r}{did_you_mean(key, ENTRY_KEYS)}")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATS:
        raise DataError(f"{where}: formatting: got {formatting!r}; allowed: {' | '.join(FORMATS)}")
    for key in ("file_name", "hf_hub_url"):
        if key in entry and not (isinstance(entry[key], str) and entry[key].strip()):
            raise DataError(
                f"{where}: {key}: got {json.dumps(entry[key])[:80]}; expected a non-empty string "
                f"({'a file or folder in dataset_dir' if key == 'file_name' else 'a hub dataset id'})"
            )
    _check_shapes(entry, where)
    if "file_name" in entry:
        load_from, source = "file", _safe_path(entry["file_name"], registry.parent, where)
    elif "hf_hub_url" in entry:
        load_from, source = "hf_hub", entry["hf_hub_url"]
    else:
        raise DataError(f"{where}: needs `file_name` (a file or folder in dataset_dir) or `hf_hub_url`")
    _refuse_local_escape(entry, registry.parent, where)
    columns = dict(entry.get("columns") or {})
    bad = set(columns) - set(COLUMN_DEFAULTS)
    if bad:
        key = sorted(bad)[0]
        raise DataError(f"{where}: columns: unknown key {key!r}{did_you_mean(key, COLUMN_DEFAULTS)}")
    tags = dict(OPENAI_TAGS if formatting == "openai" else TAG_DEFAULTS)
    bad_tags = set(entry.get("tags") or {}) - set(TAG_DEFAULTS)
    if bad_tags:
        key = sorted(bad_tags)[0]
        raise DataError(f"{where}: tags: unknown key {key!r}{did_you_mean(key, TAG_DEFAULTS)}")
    tags.update(entry.get("tags") or {})
    num_samples = entry.get("num_samples")
    if num_samples is not None and (
        isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0
    ):
        raise DataError(f"{where}: num_samples: got {num_samples!r}; expected a positive whole number")
    if not isinstance(entry.get("ranking", False), bool):
        raise DataError(f"{where}: ranking: got {entry['ranking']!r}; expected true or false")
    return DatasetAttr(
        name=name,
        load_from=load_from,
        source=source,
        formatting=formatting,
        ranking=bool(entry.get("ranking", False)),
        subset=entry.get("subset"),
        split=entry.get("split", "train"),
        folder=entry.get("folder"),
        num_samples=num_samples,
        columns=columns,
        tags=tags,
    )


def _safe_path(file_name: str, root: Path, where: str) -> str:
    """A registry file_name must stay inside dataset_dir: no `..`, no absolute path, and no link (on
    the way to it, or anywhere inside a dataset folder) that resolves outside dataset_dir."""
    candidate = Path(file_name)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise DataError(f"{where}: file_name {file_name!r} points outside dataset_dir; use a path inside it")
    inside = root.resolve()
    link = _escaping_link(
        [root / Path(*candidate.parts[: i + 1]) for i in range(len(candidate.parts))], inside
    )
    if link is None and (root / candidate).is_dir():
        link = _escaping_link(_folder_entries(root / candidate), inside)
    if link is not None:
        raise DataError(
            f"{where}: file_name {file_name!r}: {link} is a link to {link.resolve()}, outside dataset_dir "
            f"{inside}; refusing it (copy the data into dataset_dir, or point dataset_dir at a folder "
            "that holds it)"
        )
    full = (root / candidate).resolve()
    if not full.is_relative_to(inside):  # no link found on the way, yet outside: refuse all the same
        raise DataError(f"{where}: file_name {file_name!r} resolves outside dataset_dir; refusing it")
    if not full.exists():
        raise DataError(f"{where}: file_name {file_name!r}: no such file in {root}")
    return str(full)


def _check_shapes(entry: dict, where: str) -> None:
    """Values whose wrong type would otherwise surface as a traceback deep in the reader."""
    if "\x00" in str(entry.get("file_name", "")):
        raise DataError(f"{where}: file_name {entry['file_name']!r} holds a NUL byte; no file is named so")
    for key in ("columns", "tags"):
        if entry.get(key) is not None and not isinstance(entry[key], dict):
            raise DataError(
                f"{where}: {key}: got {json.dumps(entry[key])[:80]}; expected an object such as "
                '{"prompt": "instruction", "response": "output"}'
            )


def _refuse_local_escape(entry: dict, root: Path, where: str) -> None:
    """hf_hub_url, folder and script_url reach local paths too (the hub loader reads a local folder
    as readily as a repo id), so a local path given there must stay inside dataset_dir, as file_name
    must; a bare repo id ("org/name", "json") that names nothing on disk is left to the hub."""
    inside = root.resolve()
    for key in ("hf_hub_url", "folder", "script_url"):
        value = entry.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or "\x00" in value:
            raise DataError(
                f"{where}: {key}: got {json.dumps(value)[:80]}; expected a string without NUL bytes"
            )
        path = Path(os.path.expanduser(value))
        local = path.is_absolute() or ".." in path.parts or value.startswith(("./", "~")) or path.exists()
        if not local:
            continue
        full = (path if path.is_absolute() or path.exists() else root / path).resolve()
        if not full.is_relative_to(inside):
            raise DataError(
                f"{where}: {key} {value!r} is a local path outside dataset_dir {inside}; refusing it "
                "(put the data inside dataset_dir and register it with file_name)"
            )


def _folder_entries(folder: Path) -> list[Path]:
    """Every file, folder and link under `folder`, hidden ones too (the cache hashes them); links to
    folders are listed, not followed."""
    out = []
    for parent, dirs, files in os.walk(folder, followlinks=False):
        out += [Path(parent) / n for n in dirs + files]
    return out


def _escaping_link(paths: list[Path], inside: Path) -> Path | None:
    """The first of `paths` that is a symbolic link resolving outside `inside`."""
    for path in paths:
        if path.is_symlink() and not path.resolve().is_relative_to(inside):
            return path
    return None


def get_dataset_attrs(
    names: str | None, dataset_dir: str | Path, field_name: str = "dataset"
) -> list[DatasetAttr]:
    if not names:
        return []
    registry, table = read_registry(dataset_dir)
    attrs = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in table:
            raise DataError(
                f"{field_name}: {name!r} is not in {registry}{did_you_mean(name, table)}; "
                f"registered: {', '.join(sorted(table)) or '(none)'}"
            )
        attrs.append(_parse_entry(name, table[name], registry))
    return attrs
