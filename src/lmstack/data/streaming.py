"""`streaming: true`: tokenize while training instead of up front.

The records are read (files are cheap to read; tokenizing is what costs) and mixed in record order
by `mix_strategy`; each record is converted and encoded only when the training loop asks for it,
through a shuffle buffer of `buffer_size` records (reseeded every pass with `seed` + pass number).
Nothing is cached. Invalid records are dropped and counted exactly as in the eager path; the counts
are logged at the end of every pass. Before training starts, the stream is read until the first
valid sample, so data in which no record is valid fails before the model loads, with the breakdown.

A stream has no length, so `max_steps` must be set (checked in `check_data_args`); `max_samples`
and `val_size` need a length too and are refused (use `eval_dataset` for evaluation).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.data.encode import DropExample, EncodeOptions, encode_example
from lmstack.data.formats import RecordError, convert
from lmstack.data.loader import RawRecord, read_records
from lmstack.data.mix import interleave_order, parse_probs
from lmstack.data.registry import DatasetAttr, get_dataset_attrs
from lmstack.data.stats import (
    DatasetStats,
    check_ranking,
    encode_options,
    log_stats,
    no_valid_samples,
    placeholders_in,
)

logger = logging.getLogger(__name__)


def _base_class() -> type:
    import torch.utils.data

    return torch.utils.data.IterableDataset


class StreamingDataset(_base_class()):  # type: ignore[misc]
    """Iterable of encoded samples; `stats` holds the counts of the pass in progress / last pass."""

    def __init__(
        self,
        sources: list[tuple[DatasetAttr, list[RawRecord]]],
        tokenizer: Any,
        template: Any,
        opts: EncodeOptions,
        order: list[tuple[int, int]],
        buffer_size: int,
        seed: int,
    ):
        self.sources, self.tokenizer, self.template, self.opts = sources, tokenizer, template, opts
        self.order, self.buffer_size, self.seed = order, buffer_size, seed
        self.passes = 0
        self.stats = [DatasetStats(attr.name, field_chars=opts.field_chars) for attr, _ in sources]

    def _encode(self, d: int, i: int) -> dict | None:
        attr, records = self.sources[d]
        raw, stats = records[i], self.stats[d]
        stats.records += 1
        try:
            if raw.error:
                raise RecordError("", "bad JSON line", raw.error.removeprefix("bad JSON line: "))
            sample, was_cut, n_cut = encode_example(
                convert(raw.data, attr), self.tokenizer, self.template, self.opts
            )
        except (RecordError, DropExample) as err:
            stats.dropped[err.kind] += 1
            stats.problems.append(
                {
                    "file": raw.file,
                    "position": raw.position,
                    "field": err.field or None,
                    "kind": err.kind,
                    "reason": err.reason,
                }
            )
            return None
        stats.kept += 1
        stats.truncated += bool(was_cut)
        stats.fields_cut += n_cut
        stats.placeholders.update(placeholders_in(raw.data))
        return sample

    def samples(self) -> Iterator[dict]:
        """One pass in stream order (no shuffle); with data-loader workers, each takes every n-th record."""
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        order = self.order if info is None else self.order[info.id :: info.num_workers]
        for d, i in order:
            sample = self._encode(d, i)
            if sample is not None:
                yield sample

    def __iter__(self) -> Iterator[dict]:
        self.stats = [DatasetStats(attr.name, field_chars=self.opts.field_chars) for attr, _ in self.sources]
        rng = random.Random(self.seed + self.passes)
        self.passes += 1
        buffer: list[dict] = []
        for sample in self.samples():
            if len(buffer) < self.buffer_size:
                buffer.append(sample)
                continue
            j = rng.randrange(len(buffer))
            yield buffer[j]
            buffer[j] = sample
        rng.shuffle(buffer)
        yield from buffer
        for stats in self.stats:
            log_stats(stats, self.opts.cutoff_len)


def build_streaming(cfg: Config, tokenizer: Any, template: Any) -> StreamingDataset:
    """The training stream (the pipeline adds the evaluation split, which is always tokenized up front)."""
    if cfg.data.max_samples is not None:
        raise ConfigError(
            "max_samples: not available with streaming: true (a stream has no length); remove one"
        )
    if cfg.data.val_size > 0:
        raise ConfigError("val_size: not available with streaming: true; use eval_dataset for evaluation")
    sources = []
    for attr in get_dataset_attrs(cfg.data.dataset, cfg.data.dataset_dir, "dataset"):
        check_ranking(attr, cfg.finetuning.stage)
        if attr.num_samples is not None:
            logger.warning("dataset %s: num_samples has no effect with streaming: true", attr.name)
        sources.append((attr, read_records(attr)))
    sizes = [len(records) for _, records in sources]
    probs = parse_probs(cfg.data.interleave_probs, len(sizes), cfg.data.mix_strategy)
    order = interleave_order(sizes, cfg.data.mix_strategy, probs, cfg.training.seed)
    stream = StreamingDataset(
        sources, tokenizer, template, encode_options(cfg), order, cfg.data.buffer_size, cfg.training.seed
    )
    if next(stream.samples(), None) is None:  # read until the first valid sample
        raise no_valid_samples(stream.stats)
    logger.info(
        "streaming: %d records from %s, tokenized while training (shuffle buffer %d)",
        len(order),
        ", ".join(a.name for a, _ in sources),
        cfg.data.buffer_size,
    )
    return stream
