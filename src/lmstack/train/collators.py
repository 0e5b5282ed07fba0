"""Collators for packed rows (see data/packing.py for the row layout)."""

from __future__ import annotations

from typing import Any


class PackedCollator:
    """Stacks packed rows into [B, width] with `position_ids` and no `attention_mask`.

    Without an attention mask (and with use_cache off), transformers reads the position resets as
    sample boundaries and masks attention block-diagonally. Row tails are padded with the pad id,
    labels -100 and positions restarting at 0, so the padding is a segment of its own that no real
    token attends to. `width` fixes the row length (static shapes for flex_attention/torch.compile);
    otherwise rows are padded to the longest, rounded up to `multiple_of`.
    """

    def __init__(self, pad_id: int, width: int | None = None, multiple_of: int = 1):
        self.pad_id = pad_id
        self.width = width
        self.multiple_of = multiple_of

    def __call__(self, features: list[dict]) -> dict[str, Any]:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        width = self.width or -(-longest // self.multiple_of) * self.multiple_of
        if longest > width:
            raise ValueError(f"a packed row has {longest} tokens, more than the row width {width}")
        batch = len(features)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        positions = torch.arange(width, dtype=torch.long).repeat(batch, 1)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            positions[i, :n] = torch.tensor(f["position_ids"])
            positions[i, n:] = torch.arange(width - n)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
