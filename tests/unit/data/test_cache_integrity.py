"""The tokenized cache keys a hub entry by the files it reads (not by its name), and rebuilds an entry
one of whose files was deleted instead of training a dataset without that column."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from _data_helpers import DATA_DIR

from lmstack.data.pipeline import load_split


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "lmstack" / "tokenized"


def run(cfg, tokenizer, template, caplog, name) -> tuple[list[dict], str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmstack.data"):
        data, _ = load_split(cfg, cfg.data.dataset, "dataset", tokenizer, template)
    return data.to_samples(), "\n".join(
        r.getMessage() for r in caplog.records if f"{name}:" in r.getMessage()
    )


def test_a_hub_entry_read_from_a_local_folder_is_keyed_by_its_files(
    cache_dir, tmp_path, make_cfg, tiny_tokenizer, qwen, caplog
):
    data = tmp_path / "data"
    (data / "hubset").mkdir(parents=True)
    records = json.loads((DATA_DIR / "identity.json").read_text())
    path = data / "hubset" / "train.json"
    path.write_text(json.dumps(records))
    entry = {"hf_hub_url": str(data / "hubset"), "columns": {"prompt": "instruction", "response": "output"}}
    (data / "dataset_info.json").write_text(json.dumps({"hubset": entry}))
    cfg = make_cfg(dataset="hubset", dataset_dir=str(data))
    first, log = run(cfg, tiny_tokenizer, qwen, caplog, "hubset")
    assert "tokenizing (cache miss, no earlier entry)" in log
    again, log = run(cfg, tiny_tokenizer, qwen, caplog, "hubset")
    assert "reusing tokenized cache" in log and again == first
    stat = path.stat()
    path.write_text(json.dumps([{**r, "output": r["output"].replace("I am", "U am")} for r in records]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the mtime does not tell
    edited, log = run(cfg, tiny_tokenizer, qwen, caplog, "hubset")
    assert "tokenizing (cache miss, changed: data (train.json))" in log
    assert edited != first


def test_an_entry_with_a_deleted_file_is_rebuilt(cache_dir, tmp_path, make_cfg, tiny_tokenizer, qwen, caplog):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("dataset_info.json", "identity.json"):
        shutil.copy2(DATA_DIR / name, data / name)
    cfg = make_cfg(dataset="identity", dataset_dir=str(data))
    first, _ = run(cfg, tiny_tokenizer, qwen, caplog, "identity")
    (entry,) = [p for p in cache_dir.iterdir() if p.name.startswith("identity-")]
    labels = sorted(entry.glob("ragged.labels.*"))
    assert labels
    labels[0].unlink()
    again, log = run(cfg, tiny_tokenizer, qwen, caplog, "identity")
    assert f"is unreadable ({labels[0].name} is missing); tokenizing again" in log
    assert again == first and all("labels" in s for s in again)
    assert labels[0].is_file()  # the rebuilt entry is whole again
    _, log = run(cfg, tiny_tokenizer, qwen, caplog, "identity")
    assert "reusing tokenized cache" in log


def _hub_cache_repo(hub: os.PathLike, repo: str, files: dict[str, bytes]) -> None:
    """A dataset repo laid out as huggingface_hub caches it: refs/main names a snapshot whose files
    link to blobs named by their sha256 (LFS) or git blob sha1."""
    import hashlib
    from pathlib import Path

    base = Path(hub) / f"datasets--{repo.replace('/', '--')}"
    rev = "0" * 40
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(rev)
    (base / "blobs").mkdir()
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True)
    for i, (name, body) in enumerate(files.items()):
        blob = (
            hashlib.sha256(body).hexdigest()
            if i % 2 == 0
            else hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()
        )
        (base / "blobs" / blob).write_bytes(body)
        (snap / name).symlink_to(Path("..", "..", "blobs", blob))


def test_a_hub_cache_blob_edited_in_place_is_refused_naming_the_file(tmp_path, monkeypatch):
    from lmstack.config.errors import DataError
    from lmstack.data.cache import data_digest
    from lmstack.data.registry import DatasetAttr

    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    records = json.dumps(json.loads((DATA_DIR / "identity.json").read_text())).encode()
    _hub_cache_repo(hub, "someone/hubset", {"train.json": records, "README.md": b"# data\n"})
    attr = DatasetAttr(name="hubset", load_from="hf_hub", source="someone/hubset")
    before = data_digest(attr)
    assert before is not None and "train.json" in before and "README.md" in before
    for name in ("train.json", "README.md"):  # an LFS (sha256) blob and a git (sha1) one
        blob = (hub / "datasets--someone--hubset" / "snapshots" / ("0" * 40) / name).resolve()
        original = blob.read_bytes()
        blob.write_bytes(original.replace(b"I am", b"U am") if name == "train.json" else b"# edited\n")
        with pytest.raises(
            DataError, match=f"dataset hubset: .*{name} .*changed after it was downloaded.*download"
        ):
            data_digest(attr)
        blob.write_bytes(original)
    assert data_digest(attr) == before
