"""`tokenized_path`: keep the tokenized training (and eval) data in a folder of your choice.

First run (folder absent or without COMPLETE): the data is built as usual and saved there, written to
a temporary sibling folder and renamed into place, so a killed run leaves nothing half-written.
Later runs load it and ignore the data fields (dataset, template, cutoff_len, ...), as in
LLaMA-Factory — the log says so. The content-keyed cache (cache.py) makes this unnecessary on one
machine; it is useful to tokenize once and copy the folder to other machines.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from lmstack.config.errors import DataError
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)


def load_saved(path: str) -> tuple[TokenizedDataset, TokenizedDataset | None, list[dict]] | None:
    folder = Path(path)
    if not (folder / "COMPLETE").is_file():
        if folder.exists() and any(folder.iterdir()):
            raise DataError(
                f"tokenized_path: {folder} exists but holds no complete tokenized data (no COMPLETE "
                "marker); remove it or point tokenized_path at an empty or new folder"
            )
        return None
    train = TokenizedDataset.load(folder / "train")
    evals = TokenizedDataset.load(folder / "eval") if (folder / "eval").is_dir() else None
    stats = json.loads((folder / "stats.json").read_text())
    logger.info(
        "tokenized_path: loaded %d training samples%s from %s; dataset, template, cutoff_len and the "
        "other data fields are ignored (delete the folder to tokenize again)",
        len(train),
        f" and {len(evals)} eval samples" if evals is not None else "",
        folder,
    )
    return train, evals, stats


def save(path: str, train: TokenizedDataset, evals: TokenizedDataset | None, stats: list[dict]) -> None:
    folder = Path(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        (tmp / "train").mkdir()
        train.save(tmp / "train")
        if evals is not None:
            (tmp / "eval").mkdir()
            evals.save(tmp / "eval")
        (tmp / "stats.json").write_text(json.dumps(stats))
        (tmp / "COMPLETE").write_text("ok")
        if folder.exists():
            shutil.rmtree(folder)  # empty (checked in load_saved)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("tokenized_path: saved the tokenized data to %s", folder)
