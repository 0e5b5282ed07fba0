"""A tokenized dataset stored as flat numpy columns (compact, fast to cache, no pickle).

Any sample layout works: a key whose values are lists of ints (input_ids, labels, chosen_input_ids,
...) is a *ragged* column (one flat int32 array + int64 offsets); a key whose values are scalars
(a KTO tag, a length) is a *dense* column. Every sample must have the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

IGNORE_INDEX = -100


class TokenizedDataset:
    """Indexable sequence of sample dicts (a torch-style map Dataset)."""

    def __init__(
        self, ragged: dict[str, tuple[np.ndarray, np.ndarray]], dense: dict[str, np.ndarray], size: int
    ):
        self.ragged = ragged  # key -> (flat values, offsets with size + 1 entries)
        self.dense = dense  # key -> array of size entries
        self.size = size

    @classmethod
    def from_samples(cls, samples: Sequence[dict], pad_id: int | None = None) -> TokenizedDataset:
        if not samples:
            return cls({}, {}, 0)
        ragged, dense = {}, {}
        for key, first in samples[0].items():
            if isinstance(first, list | tuple | np.ndarray):
                lengths = np.fromiter((len(s[key]) for s in samples), dtype=np.int64, count=len(samples))
                offsets = np.zeros(len(samples) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                values = np.fromiter(
                    (t for s in samples for t in s[key]), dtype=np.int32, count=int(offsets[-1])
                )
                ragged[key] = (values, offsets)
            else:
                dense[key] = np.asarray([s[key] for s in samples])
        return cls(ragged, dense, len(samples))

    @classmethod
    def from_arrays(cls, ragged: dict[str, tuple[list[np.ndarray], list[int]]], dense: dict, size: int):
        """Build from per-key chunks: {key: ([flat int arrays], [lengths])} — what the workers return."""
        out = {}
        for key, (chunks, lengths) in ragged.items():
            offsets = np.zeros(size + 1, dtype=np.int64)
            np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
            values = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros(0, np.int32)
            out[key] = (values, offsets)
        return cls(out, {k: np.asarray(v) for k, v in dense.items()}, size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(index)
        out: dict = {}
        for key, (values, offsets) in self.ragged.items():
            out[key] = values[offsets[index] : offsets[index + 1]].tolist()
        for key, arr in self.dense.items():
            out[key] = arr[index].item()
        return out

    def keys(self) -> list[str]:
        return [*self.ragged, *self.dense]

    def lengths(self, key: str = "input_ids") -> np.ndarray:
        if key not in self.ragged:
            return np.zeros(self.size, dtype=np.int64)
        return np.diff(self.ragged[key][1])

    def trainable_tokens(self) -> int:
        """Tokens whose label is not IGNORE_INDEX, over every *labels column."""
        return sum(
            int((v != IGNORE_INDEX).sum()) for k, (v, _) in self.ragged.items() if k.endswith("labels")
        )

    def to_samples(self) -> list[dict]:
        return [self[i] for i in range(self.size)]

    # ---- selection and concatenation (no Python-level copy of the tokens) ---------------------
    def select(self, indices: Sequence[int] | np.ndarray) -> TokenizedDataset:
        idx = np.asarray(indices, dtype=np.int64)
        ragged = {}
        for key, (values, offsets) in self.ragged.items():
            starts, ends = offsets[idx], offsets[idx + 1]
            lengths = ends - starts
            new_offsets = np.zeros(len(idx) + 1, dtype=np.int64)
            np.cumsum(lengths, out=new_offsets[1:])
            # gather positions: for each selected sample, start + arange(length)
            pos = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(int(new_offsets[-1]))
            ragged[key] = (values[pos], new_offsets)
        dense = {k: v[idx] for k, v in self.dense.items()}
        return TokenizedDataset(ragged, dense, len(idx))

    @staticmethod
    def concat(parts: Sequence[TokenizedDataset]) -> TokenizedDataset:
        parts = [p for p in parts if len(p)]
        if not parts:
            return TokenizedDataset({}, {}, 0)
        keys = parts[0].keys()
        for p in parts[1:]:
            if p.keys() != keys:
                raise ValueError(f"cannot concatenate datasets with columns {keys} and {p.keys()}")
        ragged = {}
        for key in parts[0].ragged:
            values = np.concatenate([p.ragged[key][0] for p in parts])
            lengths = np.concatenate([np.diff(p.ragged[key][1]) for p in parts])
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            ragged[key] = (values, offsets)
        dense = {k: np.concatenate([p.dense[k] for p in parts]) for k in parts[0].dense}
        return TokenizedDataset(ragged, dense, sum(len(p) for p in parts))

    # ---- storage ------------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        for key, (values, offsets) in self.ragged.items():
            np.save(folder / f"ragged.{key}.values.npy", values)
            np.save(folder / f"ragged.{key}.offsets.npy", offsets)
        for key, arr in self.dense.items():
            np.save(folder / f"dense.{key}.npy", arr)
        (folder / "size.txt").write_text(str(self.size))

    @classmethod
    def load(cls, folder: Path) -> TokenizedDataset:
        size = int((folder / "size.txt").read_text())
        ragged, dense = {}, {}
        for path in sorted(folder.glob("ragged.*.values.npy")):
            key = path.name[len("ragged.") : -len(".values.npy")]
            ragged[key] = (
                np.load(path, allow_pickle=False),
                np.load(folder / f"ragged.{key}.offsets.npy", allow_pickle=False),
            )
        for path in sorted(folder.glob("dense.*.npy")):
            dense[path.name[len("dense.") : -len(".npy")]] = np.load(path, allow_pickle=False)
        return cls(ragged, dense, size)
