"""The collator of image samples (data/mm.py): text padded as for text samples, plus the pixels of
the batch's images from the model's image processor (Qwen2-VL: `pixel_values` of patches and
`image_grid_thw`; LLaVA: `pixel_values` [images, 3, H, W]). No position ids: the model computes its
own (Qwen2-VL's 3D rope index from input_ids, image_grid_thw and the attention mask)."""

from __future__ import annotations

import json
from typing import Any

from lmstack.data.mm import MediaSpec, load_image


class MediaCollator:
    def __init__(self, pad_id: int, spec: MediaSpec, image_processor: Any):
        self.pad_id = pad_id
        self.spec = spec
        self.image_processor = image_processor

    def __call__(self, features: list[dict]) -> dict:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(features), width), -100, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        paths = [p for f in features for p in json.loads(f.get("images") or "[]")]
        if paths:
            images = [load_image(p, self.spec) for p in paths]
            batch.update(self.image_processor(images=images, return_tensors="pt"))
        return batch
