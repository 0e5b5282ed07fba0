"""Mixing several datasets (`mix_strategy`, `interleave_probs`), as LLaMA-Factory / HF `datasets` do.

- concat: dataset 1, then dataset 2, ... (the Trainer shuffles afterwards). Every sample once.
- interleave_under ("first_exhausted"): take one sample at a time, from the datasets in turn (or, with
  interleave_probs, from a dataset drawn at random with those probabilities); stop as soon as one
  dataset has no sample left. The result is *under*-sampled: larger datasets are cut short.
  Without probs a round is finished first. Example, sizes [2, 5]: a0 b0 a1 b1 (4 samples).
- interleave_over ("all_exhausted"): same draw, but a dataset that runs out starts again from its
  first sample; stop once every dataset has been used up at least once. Smaller datasets are
  *over*-sampled (repeated). Example, sizes [2, 5]: a0 b0 a1 b1 a0 b2 a1 b3 a0 b4 (10 samples).

Draws are seeded with the run's `seed`, so a rerun mixes the same way. Within a dataset the order
is the dataset's own.
"""

from __future__ import annotations

import logging

import numpy as np

from lmstack.config.errors import ConfigError
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)


def parse_probs(raw: str | list[float] | None, count: int, strategy: str) -> list[float] | None:
    if raw is None or strategy == "concat":
        return None
    try:
        probs = [float(x) for x in (raw.split(",") if isinstance(raw, str) else raw)]
    except ValueError:
        raise ConfigError(f"interleave_probs: got {raw!r}; expected numbers like '0.7,0.3'") from None
    if len(probs) != count:
        raise ConfigError(
            f"interleave_probs: got {len(probs)} probabilities for {count} datasets; give one per dataset"
        )
    if any(p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-4:
        raise ConfigError(f"interleave_probs: got {raw!r}; they must be >= 0 and sum to 1")
    if strategy == "interleave_over" and any(p == 0 for p in probs):
        raise ConfigError(
            "interleave_probs: a probability of 0 with mix_strategy: interleave_over never uses that "
            "dataset up; give it a positive probability or remove it from `dataset`"
        )
    return probs


def interleave_order(
    sizes: list[int], strategy: str, probs: list[float] | None, seed: int
) -> list[tuple[int, int]]:
    """(dataset index, sample index) pairs in mixed order."""
    if strategy == "concat":
        return [(d, i) for d, n in enumerate(sizes) for i in range(n)]
    if strategy not in ("interleave_under", "interleave_over"):
        raise ConfigError(
            f"mix_strategy: got {strategy!r}; allowed: concat | interleave_under | interleave_over"
        )
    rng = np.random.default_rng(seed)
    cursor = [0] * len(sizes)
    exhausted = [False] * len(sizes)
    order: list[tuple[int, int]] = []
    step = 0
    while True:
        d = step % len(sizes) if probs is None else int(rng.choice(len(sizes), p=probs))
        step += 1
        if cursor[d] >= sizes[d]:
            if strategy == "interleave_under":
                break
            cursor[d] = 0  # interleave_over: start that dataset again
        order.append((d, cursor[d]))
        cursor[d] += 1
        if cursor[d] >= sizes[d]:
            exhausted[d] = True
        done = any(exhausted) if strategy == "interleave_under" else all(exhausted)
        if done and (probs is not None or step % len(sizes) == 0):  # round robin: finish the round
            break
    return order


def mix_datasets(
    parts: list[TokenizedDataset], names: list[str], strategy: str, probs: list[float] | None, seed: int
) -> TokenizedDataset:
    if strategy == "concat":
        return TokenizedDataset.concat(parts)
    empty = [n for n, p in zip(names, parts) if len(p) == 0]
    if empty:  # already reported with its drop reasons; mixing it would stop interleave at once
        logger.warning("%s: no valid record, left out of the %s mix", ", ".join(empty), strategy)
        keep = [i for i, p in enumerate(parts) if len(p)]
        if probs is not None:
            total = sum(probs[i] for i in keep)
            probs = [probs[i] / total for i in keep] if total > 0 else None
        parts = [parts[i] for i in keep]
    if not parts:
        return TokenizedDataset.concat(parts)
    order = interleave_order([len(p) for p in parts], strategy, probs, seed)
    offsets = np.cumsum([0] + [len(p) for p in parts])
    whole = TokenizedDataset.concat(parts)
    mixed = whole.select([int(offsets[d]) + i for d, i in order])
    counts = np.bincount([d for d, _ in order], minlength=len(parts))
    logger.info(
        "mix_strategy %s: %d samples (%s)",
        strategy,
        len(mixed),
        ", ".join(f"{int(c)} from {len(p)}" for c, p in zip(counts, parts)),
    )
    return mixed
