"""Content-keyed cache of tokenized datasets.

Key = sha256 over: the data files' content hashes (not their mtimes), the tokenizer (vocab, merges,
special tokens, chat template), the template definition, the encode options (stage, cutoff_len,
masking flags), max_samples and the lmstack version. Entries are written to a temporary folder and
renamed into place, so an interrupted write is never read. Arrays are .npy (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

import lmstack
from lmstack.data.registry import DatasetAttr
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmstack" / "tokenized"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _data_digest(attr: DatasetAttr) -> dict:
    if attr.load_from != "file":
        return {"hub": attr.source, "subset": attr.subset, "split": attr.split}
    src = Path(attr.source)
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    return {str(p.relative_to(src.parent if src.is_file() else src)): _file_digest(p) for p in files}


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


def key_parts(attr: DatasetAttr, tokenizer: Any, template: Any, opts: Any, max_samples: int | None) -> dict:
    entry = {k: v for k, v in asdict(attr).items() if k not in ("source",)}
    return {
        "data": _data_digest(attr),
        "entry": entry,
        "tokenizer": _tokenizer_digest(tokenizer),
        "template": repr(template),
        "options": asdict(opts),
        "max_samples": max_samples,
        "lmstack": lmstack.__version__,
    }


def cache_key(attr: DatasetAttr, tokenizer: Any, template: Any, opts: Any, max_samples: int | None) -> dict:
    parts = key_parts(attr, tokenizer, template, opts, max_samples)
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return {"digest": digest, "parts": parts}


def _entry_dir(name: str, digest: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return cache_root() / f"{safe}-{digest}"


def _changed_inputs(name: str, parts: dict) -> list[str]:
    """Compare with the newest earlier entry of the same dataset: which inputs changed."""
    root = cache_root()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    previous = (
        sorted(root.glob(f"{safe}-*/key.json"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    )
    if not previous:
        return []
    old = json.loads(previous[-1].read_text())
    return [
        k
        for k in parts
        if json.dumps(old.get(k), sort_keys=True, default=str)
        != json.dumps(parts[k], sort_keys=True, default=str)
    ]


def load(key: dict, name: str) -> tuple[list[dict], dict] | None:
    path = _entry_dir(name, key["digest"])
    if not (path / "COMPLETE").is_file():
        changed = _changed_inputs(name, key["parts"])
        why = f"changed: {', '.join(changed)}" if changed else "no earlier entry"
        logger.info("dataset %s: tokenizing (cache miss, %s)", name, why)
        return None
    ds = TokenizedDataset(
        np.load(path / "input_ids.npy", allow_pickle=False),
        np.load(path / "labels.npy", allow_pickle=False),
        np.load(path / "offsets.npy", allow_pickle=False),
    )
    stats = json.loads((path / "stats.json").read_text())
    logger.info("dataset %s: reusing tokenized cache %s", name, path)
    return ds.to_samples(), stats


def store(key: dict, name: str, samples: list[dict], stats: dict) -> None:
    final = _entry_dir(name, key["digest"])
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        ds = TokenizedDataset.from_samples(samples)
        np.save(tmp / "input_ids.npy", ds.input_ids)
        np.save(tmp / "labels.npy", ds.labels)
        np.save(tmp / "offsets.npy", ds.offsets)
        (tmp / "stats.json").write_text(json.dumps(stats))
        (tmp / "key.json").write_text(json.dumps(key["parts"], sort_keys=True, default=str))
        (tmp / "COMPLETE").write_text("ok")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as err:
        logger.warning("could not write the tokenized cache (%s); continuing without it", err)
        shutil.rmtree(tmp, ignore_errors=True)
