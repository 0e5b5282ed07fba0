"""Generation shared by `lmstack chat`, `lmstack api`, the web UI and `lmstack export`.

`load_infer_config` reads the YAML; with `adapter_name_or_path` unset it takes what training wrote to
`output_dir` (`infer/trained.py`). The base model is loaded in `infer_dtype`, every adapter of
`adapter_name_or_path` is merged into it in order, and prompts are encoded with the training template
(`template`, `default_system`, `enable_thinking`, `preserve_thinking`), so inference sees exactly the
ids training saw. Generation stops at the template's stop tokens (plus the model's own EOS ids); the
stop token is never part of the returned text. One generation runs at a time (`ChatEngine.lock`);
a `cancel` event set from another thread (the API server does so when its client disconnects) stops a
generation at its next token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config, load_yaml, parse_overrides
from lmstack.config.schema import Config
from lmstack.infer.trained import NO_OUTPUT_DIR, resolve_trained_model

logger = logging.getLogger(__name__)


def load_infer_config(path: str | Path | None, overrides: list[str] | dict | None = None) -> Config:
    """The same YAML as `lmstack train`, for chat/api/export: with adapter_name_or_path unset, what
    training wrote to `output_dir` is used (`resolve_trained_model`); `output_dir` may be left out."""
    flat = load_yaml(path) if path is not None else {}
    flat.update(overrides if isinstance(overrides, dict) else parse_overrides(list(overrides or [])))
    if flat.get("output_dir") in (None, ""):
        flat["output_dir"] = NO_OUTPUT_DIR
    return resolve_trained_model(build_config(flat))


def adapter_dirs(cfg: Config) -> list[str]:
    return [a.strip() for a in (cfg.model.adapter_name_or_path or "").split(",") if a.strip()]


def check_inference(cfg: Config) -> None:
    """Checks that need no model load; each error names the field and the fix."""
    from lmstack.models.load import check_model_path
    from lmstack.templates import get_template

    check_model_path(cfg)
    if cfg.data.template:
        get_template(cfg.data.template)
    adapters = adapter_dirs(cfg)
    if adapters and cfg.finetuning.finetuning_type != "lora":
        raise ConfigError(
            f"adapter_name_or_path: adapters need finetuning_type: lora (got "
            f"{cfg.finetuning.finetuning_type!r}); for a full/freeze run point model_name_or_path at its "
            "output_dir and drop adapter_name_or_path"
        )
    for path in adapters:
        if not (Path(path) / "adapter_config.json").is_file():
            raise ConfigError(
                f"adapter_name_or_path: {path} has no adapter_config.json; give the output_dir (or a "
                "checkpoint-N folder) of a LoRA run"
            )
    if cfg.model.quantization_bit is not None:
        raise ConfigError(
            f"quantization_bit: got {cfg.model.quantization_bit}; chat/api/export load the base unquantized "
            "and merge the adapters into it — remove quantization_bit"
        )


def inference_dtype(cfg: Config) -> Any:
    """`infer_dtype`; auto = the dtype in the model's config.json (float32 when it names none)."""
    import torch
    from transformers import AutoConfig

    from lmstack.models.load import hub_kwargs

    if cfg.model.infer_dtype != "auto":
        return getattr(torch, cfg.model.infer_dtype)
    config = AutoConfig.from_pretrained(cfg.model.model_name_or_path, **hub_kwargs(cfg))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_for_inference(cfg: Config, device: str) -> tuple[Any, Any, Any]:
    """(model with all adapters merged, tokenizer fixed by the template, template)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from lmstack.launch.context import LaunchContext
    from lmstack.models.load import hub_kwargs, load_tokenizer
    from lmstack.models.vision import vision_model_type
    from lmstack.plan.decide import attention
    from lmstack.templates import get_template

    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.data.template, tokenizer, thinking_style=cfg.data.thinking_style)
    for note in template.fix_tokenizer(tokenizer):
        logger.info(note)
    dtype = inference_dtype(cfg)
    vision = vision_model_type(cfg.model.model_name_or_path)  # Qwen2-VL / LLaVA: image-text-to-text
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(
        cfg.model.model_name_or_path,
        dtype=dtype,
        attn_implementation=attention(cfg, LaunchContext.from_env(), device, packed=False)[0],
        low_cpu_mem_usage=cfg.model.low_cpu_mem_usage,
        **hub_kwargs(cfg),
    )
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        if not cfg.model.resize_vocab:
            raise ConfigError(
                f"the tokenizer has {len(tokenizer)} tokens (after template {template.name!r} added its stop "
                f"words) but the model's embedding has {rows} rows; set resize_vocab: true as in training"
            )
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    model.to(device)
    for path in adapter_dirs(cfg):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path).merge_and_unload()
        logger.info("merged adapter %s", path)
    model.to(dtype)
    model.config.use_cache = True
    model.eval()
    logger.info("loaded %s for inference (%s, %s)", cfg.model.model_name_or_path, dtype, device)
    return model, tokenizer, template


def stop_token_ids(model: Any, tokenizer: Any, template: Any) -> list[int]:
    """The template's stop tokens plus the EOS ids of the model's generation config."""
    ids = set(template.stop_token_ids(tokenizer))
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (a stop token or an abort) | "length" (max_new_tokens reached)


class ChatEngine:
    def __init__(self, cfg: Config, model: Any, tokenizer: Any, template: Any):
        self.cfg, self.model, self.tokenizer, self.template = cfg, model, tokenizer, template
        self.stop_ids = stop_token_ids(model, tokenizer, template)
        self.lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Config) -> ChatEngine:
        import torch

        check_inference(cfg)
        if cfg.generating.num_beams > 1:
            raise ConfigError(
                f"num_beams: got {cfg.generating.num_beams}; chat/api stream tokens, which needs num_beams: 1"
            )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(cfg, *load_for_inference(cfg, device))

    @property
    def max_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def prompt_ids(self, messages: list[dict], system: str | None = None) -> list[int]:
        """`messages` alternate user|observation and assistant|function and end with a user turn;
        `system=None` uses `default_system` from the YAML, else the template's own."""
        d = self.cfg.data
        return self.template.encode_prompt(
            self.tokenizer,
            messages,
            system if system is not None else d.default_system,
            enable_thinking=d.enable_thinking,
            preserve_thinking=d.preserve_thinking,
        )

    def generate_kwargs(self, **overrides: Any) -> dict:
        """Generation settings from the YAML; overrides (None = keep) for max_new_tokens,
        temperature, top_p, top_k, do_sample, repetition_penalty. temperature 0 means greedy.
        `stop` (a list of strings) ends the reply before the first of them, on top of the
        template's stop tokens."""
        g = self.cfg.generating
        stop = overrides.pop("stop", None)
        opts = {
            "max_new_tokens": g.max_new_tokens,
            "do_sample": g.do_sample,
            "temperature": g.temperature,
            "top_p": g.top_p,
            "top_k": g.top_k,
            "repetition_penalty": g.repetition_penalty,
        }
        opts.update({k: v for k, v in overrides.items() if v is not None})
        if opts["temperature"] == 0:
            opts["do_sample"] = False
        if not opts["do_sample"]:
            for key in ("temperature", "top_p", "top_k"):
                opts.pop(key)
        kwargs = {
            **opts,
            "num_beams": 1,
            "eos_token_id": self.stop_ids,
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        return kwargs

    def _inputs(self, ids: list[int]) -> dict:
        import torch

        input_ids = torch.tensor([ids], device=self.model.device)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def _finish(self, prompt_len: int, output: Any, kwargs: dict) -> Generation:
        new = output[0, prompt_len:].tolist()
        stopped = bool(new) and new[-1] in self.stop_ids
        text_ids = new[:-1] if stopped else new
        text = self.tokenizer.decode(text_ids, skip_special_tokens=self.cfg.generating.skip_special_tokens)
        cut = first_stop(text, kwargs.get("stop_strings"))
        if cut is not None:
            text, stopped = text[:cut], True
        reason = "length" if not stopped and len(new) >= kwargs["max_new_tokens"] else "stop"
        return Generation(text, prompt_len, len(new), reason)

    def generate(
        self,
        messages: list[dict],
        system: str | None = None,
        cancel: threading.Event | None = None,
        **overrides: Any,
    ) -> Generation:
        return self.generate_ids(self.prompt_ids(messages, system), cancel, **overrides)

    def generate_ids(
        self, ids: list[int], cancel: threading.Event | None = None, **overrides: Any
    ) -> Generation:
        """Generates from prompt ids; setting `cancel` (from any thread) stops at the next token."""
        import torch

        kwargs = self.generate_kwargs(**overrides)
        with self.lock, torch.inference_mode():
            output = self.model.generate(
                **self._inputs(ids), **kwargs, stopping_criteria=stop_when_set(cancel)
            )
        return self._finish(len(ids), output, kwargs)

    def stream(
        self,
        messages: list[dict],
        system: str | None = None,
        cancel: threading.Event | None = None,
        **overrides: Any,
    ) -> Stream:
        """Starts generating in a thread (waiting for the lock first); iterate the result for text."""
        return self.stream_ids(self.prompt_ids(messages, system), cancel, **overrides)

    def stream_ids(self, ids: list[int], cancel: threading.Event | None = None, **overrides: Any) -> Stream:
        """`stream` from prompt ids; setting `cancel` (or `Stream.close`) stops at the next token."""
        return Stream(self, ids, self.generate_kwargs(**overrides), cancel)


def stop_when_set(*events: threading.Event | None) -> Any:
    """Stopping criteria for `generate` that end every sequence once any of `events` is set."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    watched = [e for e in events if e is not None]

    class _Cancelled(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            done = any(e.is_set() for e in watched)
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Cancelled()] if watched else [])


class Stream:
    """Text pieces as they are generated. After iteration: `.result` (a `Generation`); `.close()`
    stops the generation early (the lock is released when the generating thread ends)."""

    def __init__(
        self, engine: ChatEngine, ids: list[int], kwargs: dict, cancel: threading.Event | None = None
    ):
        from transformers import TextIteratorStreamer

        stop_ids = set(engine.stop_ids)
        self.abort = threading.Event()

        class _Streamer(TextIteratorStreamer):  # drops the stop token so it never shows in the text
            def put(self, value: Any) -> None:
                if not self.next_tokens_are_prompt and value.numel() == 1 and int(value) in stop_ids:
                    return
                super().put(value)

        self.engine, self.prompt_len, self.kwargs = engine, len(ids), kwargs
        self.streamer = _Streamer(
            engine.tokenizer,
            skip_prompt=True,
            skip_special_tokens=engine.cfg.generating.skip_special_tokens,
        )
        self.criteria = stop_when_set(self.abort, cancel)
        self.output: Any = None
        self.error: BaseException | None = None
        self.result: Generation | None = None
        engine.lock.acquire()
        self.thread = threading.Thread(target=self._run, args=(ids,), daemon=True)
        self.thread.start()

    def _run(self, ids: list[int]) -> None:
        import torch

        try:
            with torch.inference_mode():
                self.output = self.engine.model.generate(
                    **self.engine._inputs(ids),
                    **self.kwargs,
                    streamer=self.streamer,
                    stopping_criteria=self.criteria,
                )
        except BaseException as err:  # surfaced to the reader by __iter__
            self.error = err
            self.streamer.end()
        finally:
            self.engine.lock.release()

    def __iter__(self) -> Iterator[str]:
        stops = self.kwargs.get("stop_strings") or []
        hold = max((len(s) for s in stops), default=1) - 1  # text that may still become a stop string
        pending, stopped = "", False
        for piece in self.streamer:
            if stopped:
                continue  # drain: generation ends right after the stop string
            pending += piece
            cut = first_stop(pending, stops)
            if cut is not None:
                pending, stopped = pending[:cut], True
                self.close()
            ready = pending if stopped else pending[: len(pending) - hold]
            if ready:
                yield ready
            pending = "" if stopped else pending[len(ready) :]
        if pending:
            yield pending
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"generation failed: {self.error}") from self.error
        self.result = self.engine._finish(self.prompt_len, self.output, self.kwargs)

    def close(self) -> None:
        self.abort.set()


def first_stop(text: str, stops: list[str] | None) -> int | None:
    """Index of the earliest stop string in `text` (None when there is none)."""
    found = [i for i in (text.find(s) for s in stops or []) if i >= 0]
    return min(found) if found else None


class ChatSession:
    """A conversation with history (terminal chat, web chat)."""

    def __init__(self, engine: ChatEngine, system: str | None = None):
        self.engine, self.system = engine, system
        self.messages: list[dict] = []

    def clear(self) -> None:
        self.messages = []

    def send(self, text: str) -> Iterator[str]:
        """Streams the reply; the turn joins the history only when the reply completes."""
        conversation = [*self.messages, {"role": "user", "content": text}]
        stream = self.engine.stream(conversation, self.system)
        pieces: list[str] = []
        try:
            for piece in stream:
                pieces.append(piece)
                yield piece
        finally:
            stream.close()
        self.messages = [*conversation, {"role": "assistant", "content": "".join(pieces)}]
