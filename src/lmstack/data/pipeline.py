"""Registry -> raw records -> canonical examples -> encoded, with a report that counts every drop.

`build_datasets(cfg, tokenizer, template)` is what the stages call. A record is never skipped
without being counted by kind in `DatasetStats` and listed with its file, position, field path and
reason; when no record of the training data survives, a `DataError` prints the breakdown before
any model is loaded.

Order of operations per dataset: read -> max_samples (first N records) -> convert + encode (cached,
see cache.py) -> num_samples (seeded draw) ; then the datasets are mixed (`mix_strategy`) and
`val_size` is split off.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from array import array
from collections import Counter
from typing import Any

import numpy as np

from lmstack.config.errors import ConfigError, DataError
from lmstack.config.schema import Config
from lmstack.data import cache as data_cache
from lmstack.data.encode import ENCODERS, DropExample, EncodeOptions, encode_example
from lmstack.data.formats import RecordError, convert
from lmstack.data.loader import RawRecord, read_records
from lmstack.data.mix import mix_datasets, parse_probs
from lmstack.data.mm import media_spec, raise_media_problems
from lmstack.data.mm_checks import check_media_datasets, check_media_template
from lmstack.data.registry import DatasetAttr, get_dataset_attrs
from lmstack.data.stats import (
    MAX_CONTROL_SHOWN,
    DataBundle,
    DatasetStats,
    check_ranking,
    control_chars_in,
    encode_options,
    log_stats,
    no_valid_samples,
    placeholders_in,
    strict_refusal,
)
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)


# ---- encoding (optionally in a fork pool) ------------------------------------------------------
# The job (records, attr, tokenizer, template, options) is put here before the pool forks, so the
# workers inherit it instead of unpickling the tokenizer and the records for every chunk; a worker
# returns numpy arrays, which pickle as raw bytes.
_JOB: dict[str, Any] = {}


def _encode_range(bounds: tuple[int, int]) -> tuple[dict, dict, list, int, int, Counter]:
    """Encode records[start:end]. Returns (ragged {key: (int32 array, lengths)}, dense {key: list},
    problems [(index, field, kind, reason)], truncated count, text fields cut before tokenizing,
    kept records per unfilled `{{name}}` placeholder)."""
    records, attr, tokenizer, template, opts = _JOB["job"]
    flat: dict[str, array] = {}  # int32 buffers: cheap to extend, zero-copy to numpy
    lengths: dict[str, list[int]] = {}
    dense: dict[str, list] = {}
    problems: list[tuple] = []
    truncated = fields_cut = 0
    placeholders: Counter = Counter()
    control: list[tuple[int, list[str]]] = []
    for i in range(*bounds):
        raw = records[i]
        if raw.error:
            problems.append((i, None, "bad JSON line", raw.error))
            continue
        try:
            sample, was_cut, n_cut = encode_example(convert(raw.data, attr), tokenizer, template, opts)
        except RecordError as err:
            problems.append((i, err.field, err.kind, err.reason))
            continue
        except DropExample as err:
            problems.append((i, err.field, err.kind, err.reason))
            continue
        truncated += bool(was_cut)
        fields_cut += n_cut
        placeholders.update(placeholders_in(raw.data))
        if chars := control_chars_in(raw.data):
            control.append((i, sorted(chars)))
        for key, value in sample.items():
            if isinstance(value, list | tuple):
                flat.setdefault(key, array("i")).extend(value)
                lengths.setdefault(key, []).append(len(value))
            else:
                dense.setdefault(key, []).append(value)
    ragged = {k: (np.frombuffer(v, dtype=np.int32), lengths[k]) for k, v in flat.items()}
    return ragged, dense, problems, truncated, fields_cut, placeholders, control


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def encode_records(
    records: list[RawRecord],
    attr: DatasetAttr,
    tokenizer: Any,
    template: Any,
    opts: EncodeOptions,
    workers: int = 1,
    batch_size: int = 1000,
) -> tuple[TokenizedDataset, DatasetStats]:
    stats = DatasetStats(attr.name, records=len(records), field_chars=opts.field_chars)
    if opts.stage not in ENCODERS:
        raise ConfigError(f"stage: {opts.stage!r} has no data encoder; available: {', '.join(ENCODERS)}")
    _JOB["job"] = (records, attr, tokenizer, template, opts)
    try:
        use_pool = workers > 1 and len(records) >= 2 * workers and "fork" in mp.get_all_start_methods()
        if use_pool:
            size = max(1, min(batch_size, -(-len(records) // workers)))
            with mp.get_context("fork").Pool(workers) as pool:
                results = pool.map(_encode_range, _chunks(len(records), size), chunksize=1)
        else:
            if workers > 1 and "fork" not in mp.get_all_start_methods():
                logger.warning(
                    "preprocessing_num_workers: no fork on this platform; tokenizing in one process"
                )
            results = [_encode_range((0, len(records)))]
    finally:
        _JOB.clear()
    ragged: dict[str, tuple[list, list]] = {}
    dense: dict[str, list] = {}
    for part_ragged, part_dense, problems, truncated, fields_cut, placeholders, control in results:
        for key, (values, lens) in part_ragged.items():
            ragged.setdefault(key, ([], []))
            ragged[key][0].append(values)
            ragged[key][1].extend(lens)
        for key, values in part_dense.items():
            dense.setdefault(key, []).extend(values)
        stats.truncated += truncated
        stats.fields_cut += fields_cut
        stats.placeholders.update(placeholders)
        stats.control_records += len(control)
        room = MAX_CONTROL_SHOWN - len(stats.control)
        stats.control += [
            {"file": records[i].file, "position": records[i].position, "chars": c}
            for i, c in control[: max(room, 0)]
        ]
        for idx, fld, kind, reason in problems:
            raw = records[idx]
            stats.dropped[kind] += 1
            stats.problems.append(
                {"file": raw.file, "position": raw.position, "field": fld, "kind": kind, "reason": reason}
            )
    kept = len(records) - sum(stats.dropped.values())
    stats.kept = kept
    return TokenizedDataset.from_arrays(ragged, dense, kept), stats


def read_limited(attr: DatasetAttr, max_samples: int | None) -> list[RawRecord]:
    records = read_records(attr)
    if max_samples is not None and len(records) > max_samples:
        logger.info(
            "dataset %s: max_samples=%d keeps the first %d of %d records",
            attr.name,
            max_samples,
            max_samples,
            len(records),
        )
        records = records[:max_samples]
    return records


def load_one(
    cfg: Config, attr: DatasetAttr, tokenizer: Any, template: Any, opts: EncodeOptions | None = None
) -> tuple[TokenizedDataset, DatasetStats]:
    """One dataset, encoded (from the cache when its inputs are unchanged)."""
    opts = opts or encode_options(cfg)
    key = data_cache.cache_key(attr, tokenizer, template, opts, cfg.data.max_samples)
    hit = data_cache.load(key, attr.name, overwrite=cfg.data.overwrite_cache)
    if hit is not None:
        return hit[0], DatasetStats.from_dict(hit[1])
    records = read_limited(attr, cfg.data.max_samples)
    data, stats = encode_records(
        records,
        attr,
        tokenizer,
        template,
        opts,
        cfg.data.preprocessing_num_workers or 1,
        cfg.data.preprocessing_batch_size,
    )
    raise_media_problems(stats)  # a record whose images do not match is an error, not a drop
    data_cache.store(key, attr.name, data, stats.to_dict())
    return data, stats


def apply_num_samples(data: TokenizedDataset, attr: DatasetAttr, seed: int) -> TokenizedDataset:
    """`num_samples` in dataset_info.json: a random sample of that size; larger than the dataset ->
    every record once (shuffled) plus a draw with replacement for the rest. Seeded by `seed`."""
    n = attr.num_samples
    if n is None or len(data) == 0:
        return data
    order = num_samples_order(len(data), n, seed)
    logger.info(
        "dataset %s: num_samples=%d drawn from %d records%s",
        attr.name,
        n,
        len(data),
        " (oversampled with replacement)" if n > len(data) else "",
    )
    return data.select(order)


def num_samples_order(size: int, n: int, seed: int) -> np.ndarray:
    """The record indices `num_samples: n` draws from `size` records (the planner replays it)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(size)[:n]
    if n > size:
        order = np.concatenate([order, rng.choice(size, n - size, replace=True)])
    return order


def load_split(
    cfg: Config, names: str, field_name: str, tokenizer: Any, template: Any, mix: bool = True
) -> tuple[TokenizedDataset, list[DatasetStats]]:
    """Every dataset of `names` (a comma list), encoded, num_samples applied, mixed per mix_strategy
    (`mix=False`: concatenated)."""
    parts, all_stats = [], []
    attrs = get_dataset_attrs(names, cfg.data.dataset_dir, field_name)
    check_media_template(media_spec(cfg), template, [a.name for a in attrs if media_columns(a)])
    for attr in attrs:
        check_ranking(attr, cfg.finetuning.stage)
        data, stats = load_one(cfg, attr, tokenizer, template)
        log_stats(stats, cfg.data.cutoff_len)
        parts.append(apply_num_samples(data, attr, cfg.training.seed))
        all_stats.append(stats)
    if not mix or len(parts) == 1:
        return TokenizedDataset.concat(parts), all_stats
    probs = parse_probs(cfg.data.interleave_probs, len(parts), cfg.data.mix_strategy)
    return mix_datasets(
        parts, [s.name for s in all_stats], cfg.data.mix_strategy, probs, cfg.training.seed
    ), all_stats


_no_valid_samples = no_valid_samples  # the name the vertical slice used


def split_validation(
    data: TokenizedDataset, val_size: float, seed: int
) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    if val_size <= 0:
        return data, None
    train, evals = validation_order(len(data), val_size, seed)
    return data.select(train), data.select(evals)


def validation_order(size: int, val_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) record indices of the `val_size` split, each in record order (the planner replays it)."""
    count = int(val_size) if val_size >= 1 else max(1, round(size * val_size))
    if count >= size:
        raise DataError(f"val_size: {val_size} leaves no training record (only {size} records)")
    order = np.random.default_rng(seed).permutation(size)
    return np.sort(order[count:]), np.sort(order[:count])


def media_columns(attr: DatasetAttr) -> list[str]:
    """The media columns (images, videos, audios) a dataset names."""
    return [k for k in ("images", "videos", "audios") if attr.column(k)]


def check_data_args(cfg: Config) -> None:
    """Field combinations that cannot work; raised before anything is tokenized."""
    d = cfg.data
    if d.streaming and d.tokenized_path:
        raise ConfigError(
            "tokenized_path: not available with streaming: true (nothing is tokenized up front)"
        )
    if d.streaming and cfg.training.max_steps <= 0:
        raise ConfigError(
            "max_steps: streaming: true needs max_steps > 0 (a stream has no length, so the number of "
            "epochs cannot be turned into steps); set max_steps"
        )
    if d.streaming and d.strict:
        raise ConfigError(
            "strict: not available with streaming: true (records are read while training, so a dropped "
            "one cannot refuse the run up front); run `lmstack check --strict` on the data instead"
        )
    if d.eval_dataset and d.val_size > 0:
        raise ConfigError("val_size and eval_dataset: set only one of them")
    if d.interleave_probs is not None and d.mix_strategy == "concat":
        logger.warning("interleave_probs has no effect with mix_strategy: concat")
    attrs = [
        a
        for names, field in ((d.dataset, "dataset"), (d.eval_dataset, "eval_dataset"))
        for a in get_dataset_attrs(names, d.dataset_dir, field)
    ]
    check_media_datasets(
        cfg, *([a.name for a in attrs if a.column(k)] for k in ("images", "videos", "audios"))
    )


def build_datasets(cfg: Config, tokenizer: Any, template: Any) -> DataBundle:
    if not cfg.data.dataset:
        raise DataError("dataset: required for training; name one or more datasets from dataset_info.json")
    check_data_args(cfg)
    if cfg.data.streaming:
        from lmstack.data.streaming import build_streaming

        stream = build_streaming(cfg, tokenizer, template)
        evals = None
        if cfg.data.eval_dataset:
            evals, _ = load_split(cfg, cfg.data.eval_dataset, "eval_dataset", tokenizer, template, mix=False)
        return DataBundle(stream, evals if evals is not None and len(evals) else None, stream.stats)
    saved_key = None
    if cfg.data.tokenized_path:
        from lmstack.data import saved

        saved_key = saved.saved_key(cfg, tokenizer, template)  # saved data from other inputs is refused
        hit = saved.load_saved(cfg.data.tokenized_path, saved_key)
        if hit is not None:
            return DataBundle(hit[0], hit[1], [DatasetStats.from_dict(d) for d in hit[2]])
    train, stats = load_split(cfg, cfg.data.dataset, "dataset", tokenizer, template)
    if len(train) == 0:
        raise no_valid_samples(stats)
    evals: TokenizedDataset | None = None
    if cfg.data.eval_dataset:
        evals, eval_stats = load_split(
            cfg, cfg.data.eval_dataset, "eval_dataset", tokenizer, template, mix=False
        )
        stats += eval_stats
        evals = evals if len(evals) else None
    else:
        train, evals = split_validation(train, cfg.data.val_size, cfg.training.seed)
    refusal = strict_refusal(stats) if cfg.data.strict else None
    if refusal is not None:
        raise refusal
    logger.info(
        "training data: %d samples, %d trainable tokens%s",
        len(train),
        train.trainable_tokens(),
        f"; evaluation: {len(evals)} samples" if evals is not None else "",
    )
    if cfg.data.tokenized_path and _is_main_process():
        from lmstack.data import saved

        saved.save(cfg.data.tokenized_path, train, evals, [st.to_dict() for st in stats], saved_key)
    return DataBundle(train, evals, stats)


def _is_main_process() -> bool:
    from lmstack.launch.context import topology

    return topology().is_main
