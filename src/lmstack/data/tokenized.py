"""A tokenized dataset stored as flat int32 arrays + offsets (compact, fast to cache, no pickle)."""

from __future__ import annotations

import numpy as np


class TokenizedDataset:
    """Indexable sequence of {"input_ids": list[int], "labels": list[int]} (a torch-style Dataset)."""

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray):
        self.input_ids = input_ids
        self.labels = labels
        self.offsets = offsets  # len(samples) + 1 entries

    @classmethod
    def from_samples(cls, samples: list[dict], pad_id: int | None = None) -> TokenizedDataset:
        lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter(
            (t for s in samples for t in s["input_ids"]), dtype=np.int32, count=int(offsets[-1])
        )
        labels = np.fromiter(
            (t for s in samples for t in s["labels"]), dtype=np.int32, count=int(offsets[-1])
        )
        return cls(ids, labels, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += len(self)
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return {"input_ids": self.input_ids[a:b].tolist(), "labels": self.labels[a:b].tolist()}

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def trainable_tokens(self) -> int:
        return int((self.labels != -100).sum())

    def to_samples(self) -> list[dict]:
        return [self[i] for i in range(len(self))]
