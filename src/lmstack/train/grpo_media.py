"""Image prompts for stage grpo (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA) through the multimodal plugin
of sft (data/mm.py: LF's `<image>` placeholders, image_max_pixels resizing, the image-token count of each
image, checked against cutoff_len), and TRL's GRPOTrainer's own vision path: each rollout's pixels go to
model.generate, and every log-prob forward (policy, sampling-time, reference) gets the same
pixel_values / image_grid_thw (+ mm_token_type_ids), split per answer by TRL (num_images).

TRL builds that path from conversational prompts with image blocks and a processor (a ProcessorMixin:
`apply_chat_template` renders and tokenizes a conversation, `__call__` turns text + images into model
inputs). lmstack's prompts are its template's rendering, so each prompt becomes one user message of text
blocks (the rendering, cut where each image was) and image blocks, and `ImagePromptProcessor` renders it
back as it was: the text as it is, each image as data/mm.py expands it (the same tokens as sft), the
pixels from the model's image processor, as the sft collator (data/mm_collate.py) makes them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from transformers import ProcessorMixin

from lmstack.data.mm import (
    IMAGE_PLACEHOLDER,
    QWEN_VL_PLUGINS,
    MediaSpec,
    expand_text,
    image_seqlen,
    load_image,
    pixel_inputs,
)
from lmstack.data.mm_collate import takes_token_types


def image_run(spec: MediaSpec) -> re.Pattern:
    """One image's expanded tokens in a decoded prompt (Qwen-VL: start, pads, end; LLaVA: a run of <image>)."""
    before, token, after = spec.tokens
    return re.compile(f"{re.escape(before)}(?:{re.escape(token)})+{re.escape(after)}")


def conversational_prompt(text: str, spec: MediaSpec) -> list[dict]:
    """The rendered prompt (image tokens expanded) as one user message of text and image blocks."""
    parts: list[dict] = []
    at = 0
    for m in image_run(spec).finditer(text):
        if m.start() > at:
            parts.append({"type": "text", "text": text[at : m.start()]})
        parts.append({"type": "image"})
        at = m.end()
    if at < len(text):
        parts.append({"type": "text", "text": text[at:]})
    return [{"role": "user", "content": parts}]


def row_columns(row: dict, text: str, spec: MediaSpec) -> dict:
    """A grpo row's prompt and images as TRL's vision path reads them (images resized as for sft)."""
    paths = json.loads(row.get("images") or "[]")
    return {"prompt": conversational_prompt(text, spec), "images": [load_image(p, spec) for p in paths]}


class ImagePromptProcessor(ProcessorMixin):
    """The processor TRL's vision path calls, rendering lmstack's prompts. ProcessorMixin's __init__ is not
    run: it checks every sub-processor class the model names (Qwen-VL's video processor needs torchvision)
    and loads none of them here; saving writes the tokenizer (the image processor's files are copied next
    to the model by the stage, models/vision.save_processor_files)."""

    def __init__(self, tokenizer: Any, image_processor: Any, spec: MediaSpec):
        self.tokenizer, self.image_processor, self.spec = tokenizer, image_processor, spec
        self.image_token_id = tokenizer.convert_tokens_to_ids(spec.tokens[1])
        self.token_types = spec.plugin in QWEN_VL_PLUGINS and takes_token_types(spec.model_type)

    def render(self, conversation: list[dict]) -> tuple[str, list[Any]]:
        """(text with an `<image>` placeholder per image, the images in order)."""
        text, images = [], []
        for message in conversation:
            for part in message["content"]:
                if part["type"] == "image":
                    text.append(IMAGE_PLACEHOLDER)
                    images.append(part.get("image"))
                else:
                    text.append(part["text"])
        return "".join(text), images

    def apply_chat_template(
        self, conversation: list, tokenize: bool = False, return_dict: bool = False, **_: Any
    ):
        batched = bool(conversation) and isinstance(conversation[0], list)
        rendered = [self.render(c) for c in (conversation if batched else [conversation])]
        if not tokenize:
            texts = [t for t, _ in rendered]
            return texts if batched else texts[0]
        out = self.encode([t for t, _ in rendered], [i for _, i in rendered])
        return out if return_dict else out["input_ids"]

    def encode(self, texts: list[str], images: list[list[Any]]) -> dict:
        """Ids (image placeholders expanded as data/mm.py does for sft), pixels, image-token types."""
        ids = []
        for text, imgs in zip(texts, images, strict=True):
            counts = [image_seqlen(im.width, im.height, self.spec) for im in imgs]
            expanded = expand_text(text, counts, self.spec)
            ids.append(self.tokenizer(text=expanded, add_special_tokens=False)["input_ids"])
        out: dict[str, Any] = {"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}
        flat = [im for imgs in images for im in imgs]
        if flat:
            out.update(pixel_inputs(flat, self.spec, self.image_processor))
        if self.token_types:
            out["mm_token_type_ids"] = [[int(t == self.image_token_id) for t in r] for r in ids]
        return out

    def __call__(
        self,
        images: list | None = None,
        text: list | None = None,
        return_tensors: str | None = None,
        **_: Any,
    ):
        """TRL's forward inputs of rendered prompts: left-padded as TRL pads its prompt ids."""
        import torch

        out = self.encode(list(text or []), [list(i or []) for i in images or [[] for _ in text or []]])
        if return_tensors == "pt":
            width = max(len(r) for r in out["input_ids"])
            for key, pad in (
                ("input_ids", self.tokenizer.pad_token_id),
                ("attention_mask", 0),
                ("mm_token_type_ids", 0),
            ):
                if key in out:
                    out[key] = torch.tensor([[pad] * (width - len(r)) + r for r in out[key]])
        return out

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> Any:
        return self.tokenizer.save_pretrained(save_directory, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.decode(*args, **kwargs)


def rollout_processor(cfg: Any, spec: MediaSpec, tokenizer: Any) -> ImagePromptProcessor:
    from lmstack.models.vision import load_image_processor

    return ImagePromptProcessor(tokenizer, load_image_processor(cfg), spec)
