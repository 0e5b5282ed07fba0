"""Images at inference for the vision models lmstack trains (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3,
InternVL): the terminal
chat's `/image PATH` command (and `/video PATH` for Qwen2-VL / Qwen2.5-VL / Qwen3-VL, `/audio PATH` for
Qwen2-Audio, prepared as training prepares them: data/mm_av.py), and OpenAI `image_url` content parts
(a local file or a data URL) for the API. The prompt is built as training builds it (data/mm.py: LLaMA-Factory's resize, the
processor's image tokens; with no `<image>` placeholder in the text, one per image goes before it)."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.data.mm import (
    IMAGE_PLACEHOLDER,
    QWEN_VL_PLUGINS,
    SUPPORTED,
    MediaSpec,
    inference_messages,
    media_spec,
    pixel_inputs,
    regularize,
)
from lmstack.infer.sampling import Generation, Piece, Sampling

IMAGE_COMMAND = "/image "
# Pixels an image may have before it is decoded (its header gives the size): a small compressed file
# can decode to gigabytes (a 12,000 x 12,000 PNG is 0.2 MB and 432 MB of RGB). 64 M pixels covers a
# 48-megapixel photo; prompts use far fewer (the YAML's image_max_pixels resizes it down).
MAX_IMAGE_PIXELS = 1 << 26


def _decoded(image: Any, what: str) -> Any:
    """`image` (opened, not decoded) as RGB, refused when it has more than MAX_IMAGE_PIXELS."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"{what}: {width} x {height} = {width * height} pixels; lmstack decodes at most "
            f"{MAX_IMAGE_PIXELS} pixels per image: send a smaller image"
        )
    return image.convert("RGB")


MEDIA_COMMANDS = {"/video": "videos", "/audio": "audios"}  # chat commands of the other modalities


def open_image(source: str) -> Any:
    """A PIL image from a local path, a file:// URL or a data:image/...;base64 URL (no network)."""
    import binascii

    from PIL import Image, UnidentifiedImageError

    if source.startswith("data:"):
        head, _, data = source.partition(",")
        if ";base64" not in head:
            raise ValueError(
                f"image_url: a data URL must be base64 (data:image/png;base64,...), got {head!r}"
            )
        try:
            return _decoded(Image.open(io.BytesIO(base64.b64decode(data, validate=True))), "image_url")
        except (binascii.Error, UnidentifiedImageError):
            raise ValueError(
                "image_url: the data URL holds no image that PIL reads (PNG, JPEG, WebP, ...)"
            ) from None
        except Image.DecompressionBombError:  # PIL's own bound, for sizes far above ours
            raise ValueError(
                f"image_url: the image has more pixels than lmstack decodes ({MAX_IMAGE_PIXELS} per image)"
            ) from None
    if "://" in source and not source.startswith("file://"):
        raise ValueError(
            f"image_url: {source[:60]!r}: lmstack reads no network; give a local file or a data URL"
        )
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.is_file():
        raise ValueError(f"image: {path}: no such file")
    try:
        with Image.open(path) as image:
            return _decoded(image, f"image: {path}")
    except UnidentifiedImageError:
        raise ValueError(f"image: {path}: not an image that PIL reads (PNG, JPEG, WebP, ...)") from None
    except Image.DecompressionBombError:
        raise ValueError(
            f"image: {path}: more pixels than lmstack decodes ({MAX_IMAGE_PIXELS} per image)"
        ) from None


class VisionInputs:
    """The model's image side: its media spec and image processor, loaded once per engine."""

    def __init__(self, engine: Any):
        from lmstack.models.vision import load_image_processor

        spec = media_spec(engine.cfg)
        if spec is None:
            raise ConfigError(
                f"images: {engine.cfg.model.model_name_or_path} is not a supported vision model "
                f"(model types {SUPPORTED})"
            )
        self.engine, self.spec = engine, spec
        audio_only = spec.plugin == "qwen2_audio"
        self.image_processor = None if audio_only else load_image_processor(engine.cfg)
        self.image_token_id = -1 if audio_only else engine.tokenizer.convert_tokens_to_ids(spec.tokens[1])
        self.feature_extractor = None
        if spec.audio is not None:
            from lmstack.data.mm_av_collate import load_feature_extractor

            self.feature_extractor = load_feature_extractor(engine.cfg)
        self.stop_ids = set(engine.stop_ids)
        self.lock = threading.Lock()

    def prompt(
        self,
        messages: list[dict],
        images: list[Any],
        system: str | None = None,
        videos: list[str] = (),
        audios: list[str] = (),
    ) -> tuple[list[int], dict]:
        """(prompt ids, the extra model inputs) of a conversation ending with a user turn; `videos` /
        `audios`: file paths, in the order of their placeholders."""
        from lmstack.data.media_audio import audio_inputs
        from lmstack.data.mm_av import expand_inference, load_audios, load_videos, video_inputs

        images = [regularize(im, self.spec) for im in images]
        messages = inference_messages(messages, images, self.spec)
        messages = expand_inference(messages, list(videos), list(audios), self.spec)
        ids = self.engine.prompt_ids(messages, system)
        extra = pixel_inputs(images, self.spec, self.image_processor)
        if videos:
            extra.update(video_inputs(load_videos(list(videos), self.spec), self.spec))
        if audios:
            extra.update(
                audio_inputs(load_audios(list(audios), self.spec), self.spec.audio, self.feature_extractor)
            )
        return ids, extra

    def generate(
        self,
        messages: list[dict],
        images: list[Any],
        system: str | None = None,
        cancel: Any = None,
        videos: list[str] = (),
        audios: list[str] = (),
        **overrides: Any,
    ) -> Generation:
        """One reply (an engine `Generation`) to `messages` showing `images` (and `videos` / `audios`
        files); `overrides` as `engine.sampling` takes them."""
        ids, extra = self.prompt(messages, images, system, videos, audios)
        return self.run(ids, extra, self.engine.sampling(**overrides), cancel)

    def run(self, ids: list[int], extra: dict, sampling: Sampling, cancel: Any = None) -> Generation:
        """Generates from a `prompt()` with transformers' `generate`, not the engine's continuous
        batcher (which feeds no pixels): one image generation at a time (`self.lock`), while the
        batcher keeps serving text. Qwen2-VL keeps its rope deltas on the model between generate
        calls, which only these serialized calls write (the batcher passes its own position ids);
        Qwen3-VL too.
        `cancel.is_set()` stops it at the next token."""
        import torch

        unsupported = _unsupported(sampling)
        if unsupported:
            raise ValueError(
                f"{unsupported}: not supported with images (replies to images use plain sampling)"
            )
        engine = self.engine
        device = engine.model.device
        input_ids = torch.tensor([ids], device=device)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        inputs.update({k: v.to(device) for k, v in extra.items()})
        if extra and _needs_token_types(self.spec):
            from lmstack.data.media_video import VIDEO_TOKENS

            types = (input_ids == self.image_token_id).long()
            types[input_ids == engine.tokenizer.convert_tokens_to_ids(VIDEO_TOKENS[1])] = 2
            inputs["mm_token_type_ids"] = types
        if extra:  # Gemma 3's token_type_ids (1 at its image soft tokens)
            from lmstack.data.mm_tiles import token_types

            inputs.update(token_types(input_ids, self.spec, self.image_token_id))
        kwargs = self._generate_kwargs(sampling, cancel)
        with self.lock, torch.inference_mode():
            if not sampling.greedy and sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            output = engine.model.generate(**inputs, **kwargs)
        return self._finish(ids, output[0, len(ids) :].tolist(), sampling)

    def _generate_kwargs(self, sampling: Sampling, cancel: Any) -> dict:
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                import torch

                done = cancel is not None and cancel.is_set()
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        kwargs: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "do_sample": not sampling.greedy,
            "num_beams": 1,
            "repetition_penalty": sampling.repetition_penalty,
            "eos_token_id": sorted(self.stop_ids),
            "pad_token_id": self.engine.tokenizer.pad_token_id,
            "stopping_criteria": StoppingCriteriaList([Cancelled()]),
        }
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.engine.tokenizer)
        return kwargs

    def _finish(self, ids: list[int], new: list[int], sampling: Sampling) -> Generation:
        stopped = bool(new) and new[-1] in self.stop_ids
        text_ids = new[:-1] if stopped else new
        skip = self.engine.cfg.generating.skip_special_tokens
        text = self.engine.tokenizer.decode(text_ids, skip_special_tokens=skip)
        cuts = [i for i in (text.find(s) for s in sampling.stop) if i >= 0]
        if cuts:
            text, stopped = text[: min(cuts)], True
        reason = "length" if not stopped and len(new) >= sampling.max_tokens else "stop"
        return Generation(text, len(ids), len(new), reason)


def _unsupported(sampling: Sampling) -> str | None:
    """The first Sampling setting an image generation cannot honour (None: all can be)."""
    for name, value in (
        ("logprobs", sampling.logprobs),
        ("presence_penalty", sampling.presence_penalty),
        ("frequency_penalty", sampling.frequency_penalty),
        ("logit_bias", sampling.logit_bias),
        ("json_object", sampling.json_object),
    ):
        if value:
            return name
    return None


def _needs_token_types(spec: MediaSpec) -> bool:
    from lmstack.data.mm_collate import takes_token_types

    return spec.plugin in QWEN_VL_PLUGINS and takes_token_types(spec.model_type)


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
        self.files: dict[str, list[str]] = {"videos": [], "audios": []}  # every video / audio file, in order
        self.pending_files: dict[str, list[str]] = {"videos": [], "audios": []}

    def clear(self) -> None:
        self.messages, self.images, self.pending = [], [], []
        self.files, self.pending_files = {"videos": [], "audios": []}, {"videos": [], "audios": []}

    def _attach(self, key: str, source: str) -> str:
        """`/video PATH` / `/audio PATH`: the file goes with the next message (its placeholder, or one
        before the text); a model that reads no such input says so."""
        from lmstack.data.mm_av import KINDS

        noun = KINDS[key][1]
        if getattr(self.vision.spec, noun) is None:
            return f"[{self.vision.spec.model_type} models read no {noun}]"
        path = Path(source.removeprefix("file://")).expanduser()
        if not path.is_file():
            return f"[{noun}: {path}: no such file]"
        self.pending_files[key].append(str(path.resolve()))
        return f"[{noun} {len(self.pending_files[key])} attached to your next message: {source}]"

    def send(self, text: str) -> Iterator[str]:
        command, _, source = text.strip().partition(" ")
        if command in MEDIA_COMMANDS:
            yield self._attach(MEDIA_COMMANDS[command], source.strip())
            return
        if text.strip().startswith(IMAGE_COMMAND.strip()):
            source = text.strip()[len(IMAGE_COMMAND.strip()) :].strip()
            try:
                self.pending.append(open_image(source))
            except (ValueError, OSError) as err:
                yield f"[{err}]"
                return
            yield f"[image {len(self.pending)} attached to your next message: {source}]"
            return
        from lmstack.data.mm_av import KINDS

        content = text
        if self.pending and IMAGE_PLACEHOLDER not in text:
            content = IMAGE_PLACEHOLDER * len(self.pending) + text
        for key, (placeholder, _) in KINDS.items():
            if self.pending_files[key] and placeholder not in text:
                content = placeholder * len(self.pending_files[key]) + content
        turn = [*self.messages, {"role": "user", "content": content}]
        images = [*self.images, *self.pending]
        files = {k: [*self.files[k], *self.pending_files[k]] for k in self.files}
        try:
            reply = self.vision.generate(
                turn, images, self.system, videos=files["videos"], audios=files["audios"]
            )
        except ValueError as err:
            yield f"[{err}]"
            return
        self.messages, self.images, self.pending = (
            [*turn, {"role": "assistant", "content": reply.text}],
            images,
            [],
        )
        self.files, self.pending_files = files, {"videos": [], "audios": []}
        yield reply.text


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


# ---- the API (infer/server.py) ----------------------------------------------------------
class ImageRun:
    """One image request's reply, generated in a worker thread (`limiter`: one at a time); the same
    events as `Runs` (the whole text as one piece, then the Generation), so a streamed reply comes as
    one content chunk."""

    count = 1

    def __init__(self, job: Callable[[], Generation], limiter: Any):
        self.job, self.limiter = job, limiter

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        import anyio

        result = await anyio.to_thread.run_sync(self.job, limiter=self.limiter)
        if result.text:
            yield 0, Piece(result.text)
        yield 0, result

    async def batches(self) -> AsyncIterator[list[tuple[int, Any]]]:
        async for item in self.events():
            yield [item]

    async def results(self) -> list[Generation]:
        return [event async for _, event in self.events() if isinstance(event, Generation)]


def api_vision(engine: Any) -> VisionInputs | None:
    """The API's image side: a vision model served by the transformers backend (None otherwise)."""
    if getattr(engine, "name", None) != "huggingface" or media_spec(engine.cfg) is None:
        return None
    return VisionInputs(engine)


def check_vision(engine: Any, vision: VisionInputs | None, where: str) -> None:
    """400 for an image part (at `where`) that this server's model or backend cannot take."""
    from lmstack.infer.openai_request import APIError

    if vision is not None:
        return
    if media_spec(engine.cfg) is None:
        raise APIError(
            400,
            f"{where}: image_url needs a vision-language model; this model is text-only",
            param="messages",
        )
    raise APIError(
        400,
        f"{where}: image_url is served by infer_backend: huggingface only; this server runs "
        f"{getattr(engine, 'name', 'another backend')}",
        param="messages",
    )
