"""Right padding of encoded rows into a batch: the one place SFT-style collators build
input_ids / labels / attention_mask tensors."""

from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100


def pad_right(features: list[dict], width: int, pad_id: int) -> dict[str, Any]:
    """{"input_ids", "labels", "attention_mask"} of shape [len(features), width]; labels padded with -100."""
    import torch

    ids = torch.full((len(features), width), pad_id, dtype=torch.long)
    labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
