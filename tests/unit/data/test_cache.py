"""The content-keyed tokenized cache: reuse, every kind of change named in the log, interrupted
writes never read, failing results never stored, stale temp folders cleaned."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
from _data_helpers import BAD_DIR, DATA_DIR
from transformers import AutoTokenizer

from lmstack.config.errors import DataError
from lmstack.data import cache as data_cache
from lmstack.data.pipeline import build_datasets, load_split
from lmstack.templates import get_template


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "lmstack" / "tokenized"


@pytest.fixture
def data_dir(tmp_path):
    dst = tmp_path / "data"
    dst.mkdir()
    for name in ("dataset_info.json", "identity.json"):
        shutil.copy2(DATA_DIR / name, dst / name)
    return dst


def run(cfg, tokenizer, template, caplog) -> tuple[list[dict], str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmstack.data"):
        data, _ = load_split(cfg, cfg.data.dataset, "dataset", tokenizer, template)
    return data.to_samples(), "\n".join(
        r.getMessage() for r in caplog.records if "identity:" in r.getMessage()
    )


def test_unchanged_inputs_reuse_the_cache(cache_dir, data_dir, make_cfg, tiny_tokenizer, qwen, caplog):
    cfg = make_cfg(dataset="identity", dataset_dir=str(data_dir))
    first, log = run(cfg, tiny_tokenizer, qwen, caplog)
    assert "tokenizing (cache miss, no earlier entry)" in log
    again, log = run(cfg, tiny_tokenizer, qwen, caplog)
    assert "reusing tokenized cache" in log and "tokenizing" not in log
    assert again == first


def test_one_byte_edit_with_the_same_mtime_rebuilds(
    cache_dir, data_dir, make_cfg, tiny_tokenizer, qwen, caplog
):
    cfg = make_cfg(dataset="identity", dataset_dir=str(data_dir))
    first, _ = run(cfg, tiny_tokenizer, qwen, caplog)
    path = data_dir / "identity.json"
    stat = path.stat()
    raw = bytearray(path.read_bytes())
    pos = raw.index(b"I am")
    raw[pos] = ord("U")  # "I am" -> "U am": same size
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_size == stat.st_size
    second, log = run(cfg, tiny_tokenizer, qwen, caplog)
    assert "tokenizing (cache miss, changed: data (identity.json))" in log
    assert second != first


def test_tokenizer_template_and_cutoff_changes_are_named(
    cache_dir, data_dir, make_cfg, tiny_model, tiny_tokenizer, qwen, caplog
):
    cfg = make_cfg(dataset="identity", dataset_dir=str(data_dir))
    run(cfg, tiny_tokenizer, qwen, caplog)
    other_tok = AutoTokenizer.from_pretrained(tiny_model)
    other_tok.add_tokens(["<extra_token>"])
    _, log = run(cfg, other_tok, qwen, caplog)
    assert "changed: tokenizer" in log
    run(cfg, tiny_tokenizer, qwen, caplog)  # back to the original: reused
    _, log = run(cfg, tiny_tokenizer, get_template("chatml", tiny_tokenizer), caplog)
    assert "changed: template" in log
    _, log = run(
        make_cfg(dataset="identity", dataset_dir=str(data_dir), cutoff_len=64), tiny_tokenizer, qwen, caplog
    )
    assert "changed: cutoff_len" in log
    _, log = run(
        make_cfg(dataset="identity", dataset_dir=str(data_dir), train_on_prompt=True),
        tiny_tokenizer,
        qwen,
        caplog,
    )
    assert "changed: train_on_prompt" in log
    _, log = run(cfg, tiny_tokenizer, qwen, caplog)
    assert "reusing tokenized cache" in log


def test_overwrite_cache_forces_a_rebuild(cache_dir, data_dir, make_cfg, tiny_tokenizer, qwen, caplog):
    cfg = make_cfg(dataset="identity", dataset_dir=str(data_dir))
    first, _ = run(cfg, tiny_tokenizer, qwen, caplog)
    again, log = run(
        make_cfg(dataset="identity", dataset_dir=str(data_dir), overwrite_cache=True),
        tiny_tokenizer,
        qwen,
        caplog,
    )
    assert "tokenizing (overwrite_cache: true)" in log and again == first
    _, log = run(cfg, tiny_tokenizer, qwen, caplog)
    assert "reusing tokenized cache" in log


def test_interrupted_writes_are_never_used(cache_dir, data_dir, make_cfg, tiny_tokenizer, qwen, caplog):
    cfg = make_cfg(dataset="identity", dataset_dir=str(data_dir))
    first, _ = run(cfg, tiny_tokenizer, qwen, caplog)
    (entry,) = [p for p in cache_dir.iterdir() if p.name.startswith("identity-")]
    # 1. an entry without COMPLETE (a write killed before its marker) is ignored and rebuilt
    (entry / "COMPLETE").unlink()
    (entry / "ragged.input_ids.values.npy").write_bytes(b"garbage")
    again, log = run(cfg, tiny_tokenizer, qwen, caplog)
    assert "tokenizing (cache miss" in log and again == first
    assert (entry / "COMPLETE").is_file()
    # 2. a leftover temp folder, even a complete-looking one, is never read as an entry
    shutil.rmtree(entry)
    tmp = cache_dir / ".tmp-killed"
    tmp.mkdir()
    (tmp / "COMPLETE").write_text("ok")
    _, log = run(cfg, tiny_tokenizer, qwen, caplog)
    assert "tokenizing (cache miss" in log


def test_stale_temp_folders_are_cleaned(cache_dir, data_dir, make_cfg, tiny_tokenizer, qwen, caplog):
    cache_dir.mkdir(parents=True)
    old, new = cache_dir / ".tmp-old", cache_dir / ".tmp-new"
    old.mkdir()
    new.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    run(make_cfg(dataset="identity", dataset_dir=str(data_dir)), tiny_tokenizer, qwen, caplog)
    assert not old.exists() and new.exists()  # a fresh one may belong to a run writing right now


def test_a_failing_result_is_never_cached(cache_dir, make_cfg, tiny_tokenizer, qwen):
    cfg = make_cfg(dataset="all_bad", dataset_dir=str(BAD_DIR))
    with pytest.raises(DataError):
        build_datasets(cfg, tiny_tokenizer, qwen)
    assert not cache_dir.exists() or not any(p.name.startswith("all_bad") for p in cache_dir.iterdir())


def test_key_ignores_mtime_but_not_content(data_dir, make_cfg, tiny_tokenizer, qwen):
    from lmstack.data.pipeline import encode_options
    from lmstack.data.registry import get_dataset_attrs

    cfg = make_cfg(dataset="identity", dataset_dir=str(data_dir))
    (attr,) = get_dataset_attrs("identity", data_dir)
    key = data_cache.cache_key(attr, tiny_tokenizer, qwen, encode_options(cfg), None)["digest"]
    os.utime(data_dir / "identity.json", (1, 1))
    assert data_cache.cache_key(attr, tiny_tokenizer, qwen, encode_options(cfg), None)["digest"] == key
    assert data_cache.cache_key(attr, tiny_tokenizer, qwen, encode_options(cfg), 5)["digest"] != key
