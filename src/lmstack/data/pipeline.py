"""Registry -> raw records -> canonical examples -> encoded, with a report that counts every drop.

`build_datasets(cfg, tokenizer, template)` is what the stages call. A record is never skipped
without being counted by reason in `DataReport`; when no record of the training data survives,
a `DataError` prints the breakdown before any model is loaded.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lmstack.config.errors import DataError
from lmstack.config.schema import Config
from lmstack.data import cache as data_cache
from lmstack.data.encode import ENCODERS, DropExample, EncodeOptions
from lmstack.data.formats import RecordError, convert
from lmstack.data.loader import RawRecord, read_records
from lmstack.data.registry import DatasetAttr, get_dataset_attrs
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)
MAX_LOGGED_PROBLEMS = 20


@dataclass
class DatasetStats:
    name: str
    records: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    problems: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "records": self.records,
            "kept": self.kept,
            "truncated": self.truncated,
            "dropped": dict(self.dropped),
            "problems": self.problems,
        }


@dataclass
class DataBundle:
    train: TokenizedDataset | None
    eval: TokenizedDataset | None
    stats: list[DatasetStats]


def _process_chunk(args: tuple) -> tuple[list[dict], list[tuple[int, str | None, str]], int]:
    """Convert + encode a chunk of raw records. Returns (encoded, problems, truncated_count);
    a problem is (index in chunk, field or None, reason)."""
    records, attr, tokenizer, template, opts = args
    encoder = ENCODERS[opts.stage]
    encoded, problems, truncated = [], [], 0
    for i, raw in enumerate(records):
        if raw.error:
            problems.append((i, None, raw.error))
            continue
        try:
            example = convert(raw.data, attr)
            sample, was_cut = encoder(example, tokenizer, template, opts)
        except RecordError as err:
            problems.append((i, err.field, err.reason))
            continue
        except DropExample as err:
            problems.append((i, None, err.reason))
            continue
        truncated += was_cut
        encoded.append(sample)
    return encoded, problems, truncated


def _encode_records(
    records: list[RawRecord],
    attr: DatasetAttr,
    tokenizer: Any,
    template: Any,
    opts: EncodeOptions,
    workers: int,
) -> tuple[list[dict], DatasetStats]:
    stats = DatasetStats(attr.name, records=len(records))
    if workers > 1 and len(records) >= 2 * workers:
        size = -(-len(records) // (workers * 4))
        chunks = [records[i : i + size] for i in range(0, len(records), size)]
        with mp.get_context("fork").Pool(workers) as pool:
            results = pool.map(_process_chunk, [(c, attr, tokenizer, template, opts) for c in chunks])
        offsets = [i * size for i in range(len(chunks))]
    else:
        results, offsets = [_process_chunk((records, attr, tokenizer, template, opts))], [0]
    encoded: list[dict] = []
    for (samples, problems, truncated), offset in zip(results, offsets):
        encoded += samples
        stats.truncated += truncated
        for idx, fld, reason in problems:
            raw = records[offset + idx]
            stats.dropped[reason if fld is None else f"{reason}"] += 1
            stats.problems.append(
                {"file": raw.file, "position": raw.position, "field": fld, "reason": reason}
            )
    stats.kept = len(encoded)
    return encoded, stats


def _log_stats(stats: DatasetStats, cutoff_len: int) -> None:
    dropped = sum(stats.dropped.values())
    logger.info(
        "dataset %s: %d records, %d kept, %d dropped, %d truncated to cutoff_len=%d",
        stats.name,
        stats.records,
        stats.kept,
        dropped,
        stats.truncated,
        cutoff_len,
    )
    for reason, count in stats.dropped.most_common():
        logger.warning("dataset %s: dropped %d record(s): %s", stats.name, count, reason)
    for p in stats.problems[:MAX_LOGGED_PROBLEMS]:
        where = f"{p['file']} {p['position']}" + (f", field {p['field']}" if p["field"] else "")
        logger.warning("  %s: %s", where, p["reason"])
    if len(stats.problems) > MAX_LOGGED_PROBLEMS:
        logger.warning(
            "  ... and %d more (all listed by `lmstack check`)", len(stats.problems) - MAX_LOGGED_PROBLEMS
        )


def encode_options(cfg: Config) -> EncodeOptions:
    return EncodeOptions(
        stage=cfg.finetuning.stage,
        cutoff_len=cfg.data.cutoff_len,
        train_on_prompt=cfg.data.train_on_prompt,
        mask_history=cfg.data.mask_history,
        default_system=cfg.data.default_system,
        enable_thinking=cfg.data.enable_thinking,
        preserve_thinking=cfg.data.preserve_thinking,
    )


def load_split(
    cfg: Config, names: str, field_name: str, tokenizer: Any, template: Any
) -> tuple[list[dict], list[DatasetStats]]:
    opts = encode_options(cfg)
    all_samples, all_stats = [], []
    for attr in get_dataset_attrs(names, cfg.data.dataset_dir, field_name):
        check_ranking(attr, cfg.finetuning.stage)
        key = data_cache.cache_key(attr, tokenizer, template, opts, cfg.data.max_samples)
        hit = None if cfg.data.overwrite_cache else data_cache.load(key, attr.name)
        if hit is not None:
            samples, stats_dict = hit
            stats = DatasetStats(
                attr.name,
                stats_dict["records"],
                stats_dict["kept"],
                stats_dict["truncated"],
                Counter(stats_dict["dropped"]),
                stats_dict["problems"],
            )
        else:
            records = read_records(attr)
            if cfg.data.max_samples is not None and len(records) > cfg.data.max_samples:
                logger.info(
                    "dataset %s: max_samples=%d keeps the first %d of %d records",
                    attr.name,
                    cfg.data.max_samples,
                    cfg.data.max_samples,
                    len(records),
                )
                records = records[: cfg.data.max_samples]
            samples, stats = _encode_records(
                records, attr, tokenizer, template, opts, cfg.data.preprocessing_num_workers or 1
            )
            data_cache.store(key, attr.name, samples, stats.to_dict())
        _log_stats(stats, cfg.data.cutoff_len)
        all_samples += samples
        all_stats.append(stats)
    return all_samples, all_stats


def check_ranking(attr: DatasetAttr, stage: str) -> None:
    pairwise = stage in ("rm", "dpo")
    if attr.ranking and not pairwise:
        raise DataError(
            f"dataset {attr.name}: a ranking (chosen/rejected) dataset cannot be used with stage "
            f"{stage}; use stage rm or dpo, or pick an instruction dataset"
        )
    if pairwise and not attr.ranking:
        raise DataError(
            f'dataset {attr.name}: stage {stage} needs a ranking dataset ("ranking": true with '
            "chosen/rejected columns in dataset_info.json)"
        )


def _no_valid_samples(stats: list[DatasetStats]) -> DataError:
    lines = ["no trainable record in the training data. Breakdown:"]
    for s in stats:
        lines.append(
            f"  {s.name}: {s.records} records, all dropped: "
            + ", ".join(f"{n} x {r}" for r, n in s.dropped.most_common())
        )
        for p in s.problems[:5]:
            lines.append(
                f"    {p['file']} {p['position']}"
                + (f", field {p['field']}" if p["field"] else "")
                + f": {p['reason']}"
            )
    lines.append(
        "Fix the records or the `columns`/`tags` mapping in dataset_info.json; `lmstack check` lists all."
    )
    return DataError("\n".join(lines))


def split_validation(samples: list[dict], val_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    if val_size <= 0:
        return samples, []
    count = int(val_size) if val_size >= 1 else max(1, round(len(samples) * val_size))
    if count >= len(samples):
        raise DataError(f"val_size: {val_size} leaves no training record (only {len(samples)} records)")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    val_idx = set(order[:count])
    return [s for i, s in enumerate(samples) if i not in val_idx], [samples[i] for i in sorted(val_idx)]


def build_datasets(cfg: Config, tokenizer: Any, template: Any) -> DataBundle:
    if not cfg.data.dataset:
        raise DataError("dataset: required for training; name one or more datasets from dataset_info.json")
    train, stats = load_split(cfg, cfg.data.dataset, "dataset", tokenizer, template)
    if not train:
        raise _no_valid_samples(stats)
    evals: list[dict] = []
    if cfg.data.eval_dataset:
        if cfg.data.val_size > 0:
            raise DataError("val_size and eval_dataset: set only one of them")
        evals, eval_stats = load_split(cfg, cfg.data.eval_dataset, "eval_dataset", tokenizer, template)
        stats += eval_stats
    else:
        train, evals = split_validation(train, cfg.data.val_size, cfg.training.seed)
    pad_id = tokenizer.pad_token_id
    return DataBundle(
        TokenizedDataset.from_samples(train, pad_id),
        TokenizedDataset.from_samples(evals, pad_id) if evals else None,
        stats,
    )
