"""The collator of image samples (data/mm.py): text padded as for text samples, plus the pixels of
the batch's images from the model's image processor (Qwen2-VL / Qwen3-VL: `pixel_values` of patches and
`image_grid_thw`; LLaVA: `pixel_values` [images, 3, H, W]). No position ids: the model computes its
own (the Qwen-VLs' 3D rope index from input_ids, image_grid_thw and the attention mask; Qwen3-VL, and
Qwen2-VL in transformers >= 5.2x, also want `mm_token_type_ids`, 1 at the image tokens, as their
processors return them). Gemma 3 and InternVL: `pixel_values` of every crop / tile (data/mm_tiles.py),
and Gemma 3's `token_type_ids`."""

from __future__ import annotations

import json
from typing import Any

from lmstack.config.errors import DataError
from lmstack.data.mm import QWEN_VL_PLUGINS, MediaSpec, load_image
from lmstack.data.mm_tiles import TILED_PLUGINS, token_types
from lmstack.data.padding import pad_right


class MediaCollator:
    def __init__(
        self, pad_id: int, spec: MediaSpec, image_processor: Any, image_token_id: int, av: Any = None
    ):
        self.pad_id = pad_id
        self.spec = spec
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.token_types = spec.plugin in QWEN_VL_PLUGINS and takes_token_types(spec.model_type)
        self.av = av  # data/mm_av_collate.AVBatcher of a model that reads videos or audio

    def __call__(self, features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        batch = pad_right(features, width, self.pad_id)
        ids = batch["input_ids"]
        if self.token_types:
            batch["mm_token_type_ids"] = (ids == self.image_token_id).long()
        per_sample = [json.loads(f.get("images") or "[]") for f in features]
        paths = [p for sample in per_sample for p in sample]
        if paths:
            self.add_pixels(batch, paths, per_sample)
        if self.av is not None:
            self.av.add(batch, features)
        return batch

    def add_pixels(self, batch: dict, paths: list[str], per_sample: list[list[str]]) -> None:
        """The pixels of the batch's images (in sample order) and, for Gemma 3, its token types."""
        images = [load_image(p, self.spec) for p in paths]
        if self.spec.plugin in TILED_PLUGINS:
            from lmstack.data.mm_tiles import pixel_inputs

            inputs, counts = pixel_inputs(images, self.spec, self.image_processor)
        else:
            inputs = dict(self.image_processor(images=images, return_tensors="pt"))
            grid = inputs.get("image_grid_thw")
            counts = (
                [n // self.spec.merge_size**2 for n in grid.prod(-1).tolist()]
                if grid is not None
                else [self.spec.image_seqlen] * len(images)
            )
        batch.update(inputs)
        batch.update(token_types(batch["input_ids"], self.spec, self.image_token_id))
        self._check_tokens(batch["input_ids"], per_sample, counts)

    def _check_tokens(self, ids: Any, per_sample: list[list[str]], counts: list[int]) -> None:
        """Each sample holds as many image tokens as the processor now makes for its images (an image
        file replaced by one of another size after tokenizing would otherwise fail deep in the model)."""
        rows = iter(counts)
        for i, paths in enumerate(per_sample):
            want = sum(next(rows) for _ in paths)
            have = int((ids[i] == self.image_token_id).sum())
            if have != want:
                raise DataError(
                    f"images {', '.join(paths)}: the tokenized sample holds {have} image tokens, the processor "
                    f"makes {want} for these files now (changed since they were tokenized?); set "
                    "overwrite_cache: true to tokenize again"
                )


def takes_token_types(model_type: str) -> bool:
    """Whether this transformers' Qwen-VL reads `mm_token_type_ids` (Qwen3-VL always: its rope index
    is built from them; Qwen2-VL / Qwen2.5-VL in newer 5.x, older ones refuse it)."""
    import inspect

    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        return True
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as Model
    return "mm_token_type_ids" in inspect.signature(Model.forward).parameters


class PreferenceMediaCollator:
    """DPO batches of image pairs: `inner` (TRL's preference collator) pads the chosen rows then the
    rejected rows; each pair's images go in twice, in the same order (chosen half, rejected half)."""

    def __init__(self, inner: Any, spec: MediaSpec, image_processor: Any, image_token_id: int):
        self.inner = inner
        self.media = MediaCollator(0, spec, image_processor, image_token_id)

    def __call__(self, features: list[dict]) -> dict:
        batch = self.inner(features)
        per_sample = [json.loads(f.get("image_paths") or "[]") for f in features] * 2
        paths = [p for sample in per_sample for p in sample]
        if paths:
            self.media.add_pixels(batch, paths, per_sample)
            ids = batch["input_ids"]
            if self.media.token_types:
                batch["mm_token_type_ids"] = (ids == self.media.image_token_id).long()
        return batch
