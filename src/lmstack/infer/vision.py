"""Images at inference for the vision models lmstack trains (Qwen2-VL, Qwen2.5-VL, LLaVA): the terminal
chat's `/image PATH` command, and OpenAI `image_url` content parts (a local file or a data URL) for
the API. The prompt is built as training builds it (data/mm.py: LLaMA-Factory's resize, the
processor's image tokens; with no `<image>` placeholder in the text, one per image goes before it)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.data.mm import (
    IMAGE_PLACEHOLDER,
    MediaSpec,
    inference_messages,
    media_spec,
    pixel_inputs,
    regularize,
)

IMAGE_COMMAND = "/image "


def open_image(source: str) -> Any:
    """A PIL image from a local path, a file:// URL or a data:image/...;base64 URL (no network)."""
    from PIL import Image

    if source.startswith("data:"):
        head, _, data = source.partition(",")
        if ";base64" not in head:
            raise ValueError(
                f"image_url: a data URL must be base64 (data:image/png;base64,...), got {head!r}"
            )
        return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
    if "://" in source and not source.startswith("file://"):
        raise ValueError(
            f"image_url: {source[:60]!r}: lmstack reads no network; give a local file or a data URL"
        )
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.is_file():
        raise ValueError(f"image: {path}: no such file")
    with Image.open(path) as image:
        return image.convert("RGB")


class VisionInputs:
    """The model's image side: its media spec and image processor, loaded once per engine."""

    def __init__(self, engine: Any):
        from lmstack.models.vision import load_image_processor

        spec = media_spec(engine.cfg)
        if spec is None:
            raise ConfigError(
                f"images: {engine.cfg.model.model_name_or_path} is not a supported vision model "
                "(qwen2_vl, qwen2_5_vl, llava)"
            )
        self.engine, self.spec = engine, spec
        self.image_processor = load_image_processor(engine.cfg)
        self.image_token_id = engine.tokenizer.convert_tokens_to_ids(spec.tokens[1])

    def prompt(
        self, messages: list[dict], images: list[Any], system: str | None = None
    ) -> tuple[list[int], dict]:
        """(prompt ids, the extra model inputs) of a conversation ending with a user turn."""
        images = [regularize(im, self.spec) for im in images]
        ids = self.engine.prompt_ids(inference_messages(messages, images, self.spec), system)
        return ids, pixel_inputs(images, self.spec, self.image_processor)

    def generate(self, messages: list[dict], images: list[Any], system: str | None = None, **overrides: Any):
        """One reply (an engine `Generation`) to `messages` showing `images`."""
        import torch

        ids, extra = self.prompt(messages, images, system)
        inputs = {**self.engine._inputs(ids), **{k: v.to(self.engine.model.device) for k, v in extra.items()}}
        if extra and _needs_token_types(self.spec):
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).long()
        kwargs = self.engine.generate_kwargs(**overrides)
        with self.engine.lock, torch.inference_mode():
            output = self.engine.model.generate(**inputs, **kwargs)
        return self.engine._finish(len(ids), output, kwargs)


def _needs_token_types(spec: MediaSpec) -> bool:
    from lmstack.data.mm_collate import takes_token_types

    return spec.plugin == "qwen2_vl" and takes_token_types(spec.model_type)


class VisionChatSession:
    """The terminal chat of a vision model: `/image PATH` attaches an image to the next message (its
    `<image>` placeholders say where; none: before the text). Every image of the conversation stays
    in the prompt. Replies come whole (no token streaming)."""

    def __init__(self, engine: Any, system: str | None = None):
        self.vision = VisionInputs(engine)
        self.system = system
        self.messages: list[dict] = []
        self.images: list[Any] = []  # every image of the history, in order
        self.pending: list[Any] = []  # attached to the next user message

    def clear(self) -> None:
        self.messages, self.images, self.pending = [], [], []

    def send(self, text: str) -> Iterator[str]:
        if text.strip().startswith(IMAGE_COMMAND.strip()):
            source = text.strip()[len(IMAGE_COMMAND.strip()) :].strip()
            try:
                self.pending.append(open_image(source))
            except (ValueError, OSError) as err:
                yield f"[{err}]"
                return
            yield f"[image {len(self.pending)} attached to your next message: {source}]"
            return
        content = text
        if self.pending and IMAGE_PLACEHOLDER not in text:
            content = IMAGE_PLACEHOLDER * len(self.pending) + text
        turn = [*self.messages, {"role": "user", "content": content}]
        images = [*self.images, *self.pending]
        try:
            reply = self.vision.generate(turn, images, self.system).text
        except ValueError as err:
            yield f"[{err}]"
            return
        self.messages, self.images, self.pending = (
            [*turn, {"role": "assistant", "content": reply}],
            images,
            [],
        )
        yield reply


def session_for(engine: Any) -> Any:
    """The chat session of `engine`'s model: VisionChatSession for a vision model, else None."""
    return VisionChatSession(engine) if media_spec(engine.cfg) is not None else None


def openai_messages(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """OpenAI chat messages whose content may be a list of parts ({"type": "text", "text": ...} and
    {"type": "image_url", "image_url": {"url": ...}}) -> (messages with string content, an `<image>`
    where each image part was, the images in order). For the API: pass the result to
    VisionInputs(engine).generate(messages, images)."""
    out, images = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        text = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(str(part.get("text", "")))
            elif kind == "image_url":
                url = part.get("image_url", {})
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"messages[{i}].content[{j}].image_url.url: expected a string")
                images.append(open_image(url))
                text.append(IMAGE_PLACEHOLDER)
            else:
                raise ValueError(f"messages[{i}].content[{j}].type: got {kind!r}; allowed: text | image_url")
        out.append({**msg, "content": "".join(text)})
    return out, images
