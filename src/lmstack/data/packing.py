"""Contamination-free packing: samples are bin-packed into fixed-capacity rows.

Each row keeps its samples whole and in order; `position_ids` restart at 0 for every sample, which is
what transformers' packed-sequence detection (attention_mask=None, no KV cache) turns into a
block-diagonal (document-causal) attention mask — flex_attention's BlockMask on the GPU, a dense
mask for SDPA/eager on the CPU. The first label of every sample is set to -100 so the last token of
one sample is never trained to predict the first token of the next; with the label shift of causal
LM losses that position is never a target in unpacked training either, so the trained tokens — and
therefore the mean loss — are exactly those of unpacked training.
"""

from __future__ import annotations

import bisect
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmstack.data.encode import IGNORE_INDEX
from lmstack.data.tokenized import TokenizedDataset

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackSpec:
    """How rows are packed (decided by the run plan): tokens per row, the shuffle seed, and the number
    of rows every micro-batch step consumes across all processes."""

    capacity: int
    seed: int = 0
    rows_multiple: int = 1


def pack_bins(lengths: list[int] | np.ndarray, capacity: int, seed: int = 0) -> list[list[int]]:
    """Best-fit decreasing: each sample (longest first; ties by index) goes into the open row with the
    least room that still fits it, else a new row. Deterministic; rows are then shuffled with `seed`
    and the samples inside a row keep their dataset order."""
    lengths = [int(n) for n in lengths]
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"samples {too_long[:5]} are longer than the row capacity {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, bin id)
    for i in order:
        n = lengths[i]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            room, b = free.pop(pos)
            bins[b].append(i)
            bisect.insort(free, (room - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (capacity - n, len(bins) - 1))
    for b in bins:
        b.sort()
    random.Random(seed).shuffle(bins)
    return bins


def round_rows(bins: list[list[int]], multiple: int) -> list[list[int]]:
    """Split rows until their count is a multiple of `multiple` (the global micro-batch), so every
    micro-batch has the same shape: a short last batch would recompile flex_attention / torch.compile
    kernels mid-run. Nothing is dropped; an empty row is added only when no row holds two samples."""
    bins = [list(b) for b in bins]
    while multiple > 1 and len(bins) % multiple:
        donor = max(range(len(bins)), key=lambda j: (len(bins[j]), -j))
        bins.append([bins[donor].pop()] if len(bins[donor]) > 1 else [])
    return bins


class PackedDataset:
    """Rows of whole samples: {"input_ids", "labels", "position_ids"} (unpadded; the collator pads)."""

    def __init__(self, data: TokenizedDataset, capacity: int, seed: int = 0, rows_multiple: int = 1):
        self.data = data
        self.capacity = capacity
        self.bins = round_rows(pack_bins(data.lengths(), capacity, seed), rows_multiple)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, Any]:
        all_ids, offsets = self.data.ragged["input_ids"]
        all_labels, label_offsets = self.data.ragged["labels"]
        ids, labels, positions = [np.zeros(0, np.int32)], [np.zeros(0, np.int32)], [np.zeros(0, np.int64)]
        for i in self.bins[index]:
            a, b = int(offsets[i]), int(offsets[i + 1])
            ids.append(all_ids[a:b])
            lab = all_labels[label_offsets[i] : label_offsets[i + 1]].copy()
            lab[0] = IGNORE_INDEX  # never predicted from the previous sample's last token
            labels.append(lab)
            positions.append(np.arange(b - a))
        return {
            "input_ids": np.concatenate(ids).tolist(),
            "labels": np.concatenate(labels).tolist(),
            "position_ids": np.concatenate(positions).tolist(),
        }

    def lengths(self) -> np.ndarray:
        sample_lengths = self.data.lengths()
        return np.array([int(sample_lengths[b].sum()) for b in self.bins], dtype=np.int64)

    def efficiency(self) -> float:
        """Real tokens over row capacity (1.0 = no padding)."""
        return float(self.lengths().sum()) / max(len(self) * self.capacity, 1)


def pack_dataset(data: TokenizedDataset | None, spec: PackSpec) -> PackedDataset | None:
    if data is None:
        return None
    packed = PackedDataset(data, spec.capacity, spec.seed, rows_multiple=spec.rows_multiple)
    logger.info(
        "packing: %d samples -> %d rows of %d tokens (%.1f%% filled; attention never crosses samples)",
        len(data),
        len(packed),
        packed.capacity,
        100 * packed.efficiency(),
    )
    return packed
