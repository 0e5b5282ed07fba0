"""Content-keyed cache of tokenized datasets.

Key = sha256 over: the data files' content hashes (not their mtimes), the tokenizer (vocab, merges,
special tokens, chat template), the template definition, the encode options (stage, cutoff_len,
masking flags), max_samples, the lmstack version and a hash of the data/template code. A miss logs
which of these inputs changed, compared with the closest earlier entry of the same dataset.

Entries are written to a temporary folder (`.tmp-*`) and renamed into place with a COMPLETE marker
written last (it lists every file and its size, checked on each read), so an interrupted write or a
damaged entry is never read (it is rebuilt); `.tmp-*` folders older than an hour (left by a
killed run) are removed on the next write. Only successful results are stored (a dataset with no
valid record is not cached, so fixing the data or the mapping is always picked up). Arrays are
.npy (no pickle). The root is $XDG_CACHE_HOME/lmstack/tokenized (default ~/.cache/...).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lmstack
from lmstack.data.loader import source_files
from lmstack.data.registry import DatasetAttr
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)
STALE_TMP_SECONDS = 3600


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmstack" / "tokenized"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_digest(attr: DatasetAttr) -> dict | None:
    """file -> sha256 of every file the dataset reads (a hub entry: its local folder or hub-cache
    snapshot too, not just its name); None when the hub data is not on disk before loading."""
    found = source_files(attr)
    if found is None:
        return None
    root, files = found
    digests = {p.relative_to(root).as_posix(): _file_digest(p) for p in files}
    if attr.load_from != "file":
        digests = {"hub": f"{attr.source} subset={attr.subset} split={attr.split}", **digests}
    return digests


def _tokenizer_digest(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    parts = [
        backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())),
        repr(tokenizer.all_special_tokens),
        str(tokenizer.eos_token),
        str(tokenizer.pad_token),
        str(getattr(tokenizer, "chat_template", "")),
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


@functools.cache
def _code_digest() -> str:
    """The data and template code itself: an edited converter or template never reuses old entries,
    even when the lmstack version string did not change (a development install)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for folder in ("data", "templates"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".yaml", ".json") and path.is_file():
                h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def key_parts(attr: DatasetAttr, tokenizer: Any, template: Any, opts: Any, max_samples: int | None) -> dict:
    # num_samples is applied after the cache (a seeded draw from the cached records)
    entry = {k: v for k, v in asdict(attr).items() if k not in ("source", "num_samples")}
    return {
        "data": data_digest(attr),
        "entry": entry,
        "tokenizer": _tokenizer_digest(tokenizer),
        "template": repr(template),
        "options": asdict(opts),
        "max_samples": max_samples,
        "lmstack": lmstack.__version__,
        "code": _code_digest(),
    }


def cache_key(attr: DatasetAttr, tokenizer: Any, template: Any, opts: Any, max_samples: int | None) -> dict:
    parts = key_parts(attr, tokenizer, template, opts, max_samples)
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return {"digest": digest, "parts": parts}


def _key_text(parts: dict) -> str:
    """key.json: the key's inputs as text, token-like values masked as in every file lmstack writes
    (the digest is taken over the real values, so two secrets never share an entry)."""
    from lmstack.config.secrets import redact

    return redact(json.dumps(parts, sort_keys=True, default=str))


def _entry_dir(name: str, digest: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return cache_root() / f"{safe}-{digest}"


def _diff(old: dict, new: dict) -> list[str]:
    changed = []
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        if isinstance(value, dict) and isinstance(before, dict):  # name the file / option inside
            inner = sorted(k for k in set(value) | set(before) if value.get(k) != before.get(k))
            changed += [f"{key} ({k})" for k in inner] if key == "data" else inner
        else:
            changed.append(key)
    return changed


def _changed_inputs(name: str, parts: dict) -> list[str]:
    """Which inputs differ from the closest complete earlier entry of the same dataset (fewest
    differences; the most recently used one on a tie)."""
    root = cache_root()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    if not root.is_dir():
        return []
    new = json.loads(_key_text(parts))  # as key.json holds it: token-like text masked
    best: tuple[int, float, list[str]] | None = None
    for key_file in root.glob(f"{safe}-*/key.json"):
        if not (key_file.parent / "COMPLETE").is_file():
            continue
        try:
            changed = _diff(json.loads(key_file.read_text()), new)
            rank = (len(changed), -key_file.stat().st_mtime, changed)
        except (OSError, ValueError):
            continue
        if best is None or rank[:2] < best[:2]:
            best = rank
    return best[2] if best else []


def load(key: dict, name: str, overwrite: bool = False) -> tuple[TokenizedDataset, dict] | None:
    path = _entry_dir(name, key["digest"])
    if overwrite:
        logger.info("dataset %s: tokenizing (overwrite_cache: true)", name)
        return None
    if key["parts"]["data"] is None:
        logger.info("dataset %s: tokenizing (not cached: the hub data is not on disk before loading)", name)
        return None
    if not (path / "COMPLETE").is_file():
        changed = _changed_inputs(name, key["parts"])
        why = f"changed: {', '.join(changed)}" if changed else "no earlier entry"
        logger.info("dataset %s: tokenizing (cache miss, %s)", name, why)
        return None
    try:
        _check_entry(path)
        ds = TokenizedDataset.load(path)
        stats = json.loads((path / "stats.json").read_text())
    except (OSError, ValueError) as err:  # a damaged entry is rebuilt, never trusted
        logger.warning("dataset %s: cache entry %s is unreadable (%s); tokenizing again", name, path, err)
        return None
    try:
        os.utime(path / "key.json")  # most recently used: preferred when naming what changed
    except OSError:
        pass
    logger.info("dataset %s: reusing tokenized cache %s", name, path)
    return ds, stats


def _check_entry(path: Path) -> None:
    """COMPLETE lists every file of the entry with its size: one deleted, added or truncated (a partial
    copy, a cleanup by hand) makes the entry damaged, not a dataset without that column."""
    listed = json.loads((path / "COMPLETE").read_text())
    if not isinstance(listed, dict):
        raise ValueError("COMPLETE lists no files (written by an older lmstack)")
    found = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file() and p.name != "COMPLETE"}
    for name in sorted(set(listed) | set(found)):
        if name not in found:
            raise ValueError(f"{name} is missing")
        if name not in listed:
            raise ValueError(f"{name} was not written with the entry")
        if found[name] != listed[name]:
            raise ValueError(f"{name} has {found[name]} bytes, {listed[name]} were written")


def clean_stale_tmp(root: Path, max_age: float = STALE_TMP_SECONDS) -> None:
    """Remove `.tmp-*` folders older than `max_age` seconds (left behind by an interrupted write)."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > max_age:
                shutil.rmtree(tmp, ignore_errors=True)
                logger.debug("removed stale cache temp folder %s", tmp)
        except OSError:
            pass


def store(key: dict, name: str, dataset: TokenizedDataset, stats: dict) -> None:
    if len(dataset) == 0 or key["parts"]["data"] is None:
        return  # never cache a dataset without a valid record (the user is about to fix it), nor unknown data
    final = _entry_dir(name, key["digest"])
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        dataset.save(tmp)
        (tmp / "stats.json").write_text(json.dumps(stats))
        (tmp / "key.json").write_text(_key_text(key["parts"]))
        sizes = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        (tmp / "COMPLETE").write_text(json.dumps(sizes, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as err:
        logger.warning("could not write the tokenized cache (%s); continuing without it", err)
        shutil.rmtree(tmp, ignore_errors=True)
