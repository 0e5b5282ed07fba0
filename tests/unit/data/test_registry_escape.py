"""Local paths reached through hf_hub_url / folder / script_url stay inside dataset_dir, as file_name
does; malformed entries (NUL in file_name, columns not an object) are refused with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.config.errors import DataError
from lmstack.data.registry import get_dataset_attrs

RECORDS = [{"instruction": "hi", "output": "hello"}]


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, Path]:
    ddir, outside = tmp_path / "data", tmp_path / "outside"
    ddir.mkdir()
    outside.mkdir()
    (outside / "secret.json").write_text(json.dumps(RECORDS))
    (ddir / "inside").mkdir()
    (ddir / "inside" / "a.json").write_text(json.dumps(RECORDS))
    return ddir, outside


def _attrs(ddir: Path, entry: dict):
    (ddir / "dataset_info.json").write_text(json.dumps({"d": entry}))
    return get_dataset_attrs("d", ddir)


@pytest.mark.parametrize(
    "entry",
    [
        {"hf_hub_url": "OUT"},
        {"hf_hub_url": "json", "folder": "OUT"},
        {"hf_hub_url": "json", "folder": "../outside"},
        {"hf_hub_url": "json", "script_url": "OUT/load.py"},
    ],
)
def test_local_paths_outside_dataset_dir_are_refused(dirs, entry):
    ddir, outside = dirs
    entry = {k: v.replace("OUT", str(outside)) for k, v in entry.items()}
    with pytest.raises(DataError, match="local path outside dataset_dir"):
        _attrs(ddir, entry)


def test_hub_ids_and_inside_paths_pass(dirs):
    ddir, _ = dirs
    assert _attrs(ddir, {"hf_hub_url": "org/name"})[0].source == "org/name"
    assert _attrs(ddir, {"hf_hub_url": "json", "folder": str(ddir / "inside")})[0].folder


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"file_name": "a\x00.json"}, "NUL byte"),
        ({"file_name": "inside", "columns": ["prompt"]}, "columns: got"),
        ({"file_name": "inside", "columns": "prompt"}, "columns: got"),
    ],
)
def test_malformed_entries_are_refused(dirs, entry, message):
    with pytest.raises(DataError, match=message):
        _attrs(dirs[0], entry)
