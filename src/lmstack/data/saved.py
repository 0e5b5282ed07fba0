"""`tokenized_path`: keep the tokenized training (and eval) data in a folder of your choice.

First run (folder absent or without COMPLETE): the data is built as usual and saved there, written to
a temporary sibling folder and renamed into place, so a killed run leaves nothing half-written, with
`key.json`: what it was tokenized from, keyed like the cache (cache.py `key_parts`: the data files'
sha256, the dataset_info.json entry, the tokenizer, the template, the encode options, max_samples)
plus what the pipeline does after the cache (num_samples, mix_strategy, interleave_probs, val_size,
seed) and the dataset names in order.

Later runs load it when the config names the same inputs; any other dataset, data file content,
template, tokenizer, cutoff_len or masking option is refused (DataError naming what changed), never
trained silently while lmstack_config.yaml and run_manifest.json name the new inputs. A different
lmstack version or data/template code alone does not invalidate the folder (logged): reusing it across
upgrades and machines is what it is for. A folder saved before keys were recorded loads with a warning.
The content-keyed cache (cache.py) makes this unnecessary on one machine; it is useful to tokenize
once and copy the folder to other machines.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lmstack.config.errors import DataError
from lmstack.config.schema import Config
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)
KEY_FILE = "key.json"
VERSION_PARTS = ("lmstack", "code")  # differences here alone are logged, not refused
ABSENT = "(absent)"


def saved_key(cfg: Config, tokenizer: Any, template: Any) -> dict:
    """What the tokenized data of this config is made from (JSON-normalised)."""
    from lmstack.data.cache import key_parts
    from lmstack.data.registry import get_dataset_attrs
    from lmstack.data.stats import encode_options

    opts, d = encode_options(cfg), cfg.data

    def parts(names: str | None, field: str) -> dict:
        return {
            attr.name: {
                **key_parts(attr, tokenizer, template, opts, d.max_samples),
                "num_samples": attr.num_samples,
            }
            for attr in get_dataset_attrs(names, d.dataset_dir, field)
        }

    key = {
        "datasets": d.dataset,
        "eval_datasets": d.eval_dataset,
        "dataset": parts(d.dataset, "dataset"),
        "eval_dataset": parts(d.eval_dataset, "eval_dataset"),
        "mix_strategy": d.mix_strategy,
        "interleave_probs": d.interleave_probs,
        "val_size": d.val_size,
        "seed": cfg.training.seed,
    }
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def key_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(changes that make the saved data another dataset, lmstack version/code changes): the plain
    fields first, then per dataset what differs inside its key."""
    changed, versions = [], []
    per_dataset = ("dataset", "eval_dataset")
    for name in sorted(set(old) | set(new), key=lambda n: (n in per_dataset, n)):
        a, b = old.get(name, ABSENT), new.get(name, ABSENT)
        if a == b:
            continue
        if name not in per_dataset or not (isinstance(a, dict) and isinstance(b, dict)):
            changed.append(f"{name}: {_short(a)} -> {_short(b)}")
            continue
        for ds in sorted(set(a) | set(b)):
            if ds not in b or ds not in a:
                changed.append(
                    f"{name} {ds}: {'in the saved data only' if ds not in b else 'not in the saved data'}"
                )
                continue
            x, y = _flat(a[ds]), _flat(b[ds])
            for leaf in sorted(k for k in set(x) | set(y) if x.get(k, ABSENT) != y.get(k, ABSENT)):
                line = f"{name} {ds} {leaf}: {_short(x.get(leaf, ABSENT))} -> {_short(y.get(leaf, ABSENT))}"
                (versions if leaf.rsplit(".", 1)[-1] in VERSION_PARTS else changed).append(line)
    return changed, versions


def saved_key_of(path: str) -> dict | None:
    """The key of a complete tokenized_path folder (None: absent, incomplete or saved without one)."""
    folder = Path(path)
    if not (folder / "COMPLETE").is_file() or not (folder / KEY_FILE).is_file():
        return None
    try:
        return json.loads((folder / KEY_FILE).read_text())
    except ValueError:
        return None


def _check_key(folder: Path, key: dict) -> None:
    if not (folder / KEY_FILE).is_file():
        logger.warning(
            "tokenized_path: %s was saved without %s (by an older lmstack): it cannot be checked against "
            "dataset, template, cutoff_len and the other data fields of this config; delete the folder "
            "to tokenize again if they changed",
            folder,
            KEY_FILE,
        )
        return
    try:
        stored = json.loads((folder / KEY_FILE).read_text())
    except ValueError as err:
        raise DataError(
            f"tokenized_path: {folder / KEY_FILE} is unreadable ({err}); delete the folder to tokenize again"
        ) from None
    changed, versions = key_changes(stored, key)
    if changed:
        shown = "; ".join(changed[:12]) + (f"; and {len(changed) - 12} more" if len(changed) > 12 else "")
        raise DataError(
            f"tokenized_path: {folder} holds data tokenized from other inputs than this config names "
            f"(changed: {shown}); training on it would train the old data. Delete the folder or point "
            "tokenized_path at a new one to tokenize again, or restore the settings it was made with"
        )
    if versions:
        logger.info(
            "tokenized_path: %s was tokenized by other lmstack code (%s); reusing it",
            folder,
            "; ".join(versions),
        )


def load_saved(
    path: str, key: dict | None = None
) -> tuple[TokenizedDataset, TokenizedDataset | None, list[dict]] | None:
    """The saved data (None when the folder is absent or empty). With `key` (saved_key of this config),
    data saved from other inputs is refused."""
    folder = Path(path)
    if not (folder / "COMPLETE").is_file():
        if folder.exists() and any(folder.iterdir()):
            raise DataError(
                f"tokenized_path: {folder} exists but holds no complete tokenized data (no COMPLETE "
                "marker); remove it or point tokenized_path at an empty or new folder"
            )
        return None
    if key is not None:
        _check_key(folder, key)
    train = TokenizedDataset.load(folder / "train")
    evals = TokenizedDataset.load(folder / "eval") if (folder / "eval").is_dir() else None
    stats = json.loads((folder / "stats.json").read_text())
    logger.info(
        "tokenized_path: loaded %d training samples%s from %s%s (delete the folder to tokenize again)",
        len(train),
        f" and {len(evals)} eval samples" if evals is not None else "",
        folder,
        "; tokenized from the datasets, template and options this config names" if key is not None else "",
    )
    return train, evals, stats


def save(
    path: str,
    train: TokenizedDataset,
    evals: TokenizedDataset | None,
    stats: list[dict],
    key: dict | None = None,
) -> None:
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
        if key is not None:
            (tmp / KEY_FILE).write_text(json.dumps(key, sort_keys=True, indent=1))
        (tmp / "COMPLETE").write_text("ok")
        if folder.exists():
            shutil.rmtree(folder)  # empty (checked in load_saved)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("tokenized_path: saved the tokenized data to %s", folder)
