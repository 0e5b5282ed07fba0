"""Generation shared by `lmstack chat`, `lmstack api`, the web UI and `lmstack export`.

`load_infer_config` reads the YAML; with `adapter_name_or_path` unset it takes what training wrote to
`output_dir` (`infer/trained.py`). The base model is loaded in `infer_dtype`, every adapter of
`adapter_name_or_path` is merged into it in order, and prompts are encoded with the training template
(`template`, `default_system`, `enable_thinking`, `preserve_thinking`), so inference sees exactly the
ids training saw. Generation stops at the template's stop tokens (plus the model's own EOS ids); the
stop token is never part of the returned text. Generations run through a continuous-batching
scheduler (`infer/batching.py`): concurrent requests decode together. A `cancel` event set from
another thread (the API server does so when its client disconnects) stops a generation at its next
token.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config, load_yaml, parse_overrides
from lmstack.config.schema import Config
from lmstack.infer.sampling import Generation, Sampling, Sink
from lmstack.infer.trained import NO_OUTPUT_DIR, resolve_trained_model

logger = logging.getLogger(__name__)


def _infer_config(path: str | Path | None, overrides: list[str] | dict | None) -> Config:
    flat = load_yaml(path) if path is not None else {}
    flat.update(overrides if isinstance(overrides, dict) else parse_overrides(list(overrides or [])))
    if flat.get("output_dir") in (None, ""):
        flat["output_dir"] = NO_OUTPUT_DIR
    return build_config(flat)


def load_infer_config(path: str | Path | None, overrides: list[str] | dict | None = None) -> Config:
    """The same YAML as `lmstack train`, for chat/api/export: with adapter_name_or_path unset, what
    training wrote to `output_dir` is used (`resolve_trained_model`); `output_dir` may be left out."""
    return resolve_trained_model(_infer_config(path, overrides))


def keep_unused_out(path: str | Path | None, overrides: list[str] | dict | None = None) -> list[str]:
    """`lmstack chat/api/export` (a process of the command's own): the installed packages the config's
    inference never reaches are kept out of the process (launch/keep_out.py). Returns them."""
    from lmstack.launch.context import LaunchContext
    from lmstack.launch.keep_out import keep_out
    from lmstack.plan.decide_host import inference_kept_out

    return keep_out(
        inference_kept_out(_infer_config(path, overrides), LaunchContext.from_env(probe_cuda=False))
    )


def adapter_dirs(cfg: Config) -> list[str]:
    return [a.strip() for a in (cfg.model.adapter_name_or_path or "").split(",") if a.strip()]


def check_inference(cfg: Config) -> None:
    """Checks that need no model load; each error names the field and the fix."""
    from lmstack.models.load import check_model_path
    from lmstack.templates import get_template

    check_model_path(cfg)
    if cfg.data.template or cfg.data.escape_special_tokens_in_content:
        get_template(cfg.data.template, escape_content=cfg.data.escape_special_tokens_in_content)
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
    _refuse_unfinished(cfg, adapters)
    if cfg.model.quantization_bit is not None:
        raise ConfigError(
            f"quantization_bit: got {cfg.model.quantization_bit}; chat/api/export load the base unquantized "
            "and merge the adapters into it — remove quantization_bit"
        )


def _refuse_unfinished(cfg: Config, adapters: list[str]) -> None:
    """A run's output_dir whose final save did not finish, or an export that does not verify."""
    from lmstack.reliability import atomic_dir, final_outputs

    for field, where in [
        ("model_name_or_path", cfg.model.model_name_or_path),
        *(("adapter_name_or_path", a) for a in adapters),
    ]:
        folder = Path(where).expanduser()
        if not folder.is_dir():
            continue
        reason = final_outputs.incomplete(folder) or atomic_dir.incomplete(folder, "export")
        if reason:
            raise ConfigError(
                f"{field}: {where}: {reason}; its files may be a mix of complete and truncated ones. Finish "
                "the run (resume_from_checkpoint: auto writes the final outputs again from its last "
                "checkpoint) or load one of its checkpoint-N folders"
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


def load_tokenizer_and_template(cfg: Config) -> tuple[Any, Any]:
    """The tokenizer fixed by the training template, and the template."""
    from lmstack.models.load import load_tokenizer
    from lmstack.templates import TokenizerTemplate, get_template

    tokenizer = load_tokenizer(cfg)
    template = get_template(
        cfg.data.template,
        tokenizer,
        thinking_style=cfg.data.thinking_style,
        escape_content=cfg.data.escape_special_tokens_in_content,
    )
    for note in template.fix_tokenizer(tokenizer):
        logger.info(note)
    if isinstance(template, TokenizerTemplate):  # a looping or refused chat template stops here
        template.probe(tokenizer)
    return tokenizer, template


def load_for_inference(cfg: Config, device: str) -> tuple[Any, Any, Any]:
    """(model with all adapters merged, tokenizer fixed by the template, template)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from lmstack.launch.context import LaunchContext
    from lmstack.models.load import hub_kwargs
    from lmstack.models.vision import MODEL_CLASSES, vision_model_type
    from lmstack.plan.decide import attention

    tokenizer, template = load_tokenizer_and_template(cfg)
    dtype = inference_dtype(cfg)
    vision = vision_model_type(cfg.model.model_name_or_path)  # Qwen2-VL / LLaVA: image-text-to-text
    model_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    if vision in MODEL_CLASSES:  # Qwen2-Audio: its own class
        import transformers

        model_class = getattr(transformers, MODEL_CLASSES[vision])
    model = model_class.from_pretrained(
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
                f"words) but the model's embedding has {rows} rows: the template is not the one this model "
                "was trained with (set that one; `lmstack check` on the training YAML names the tokenizer's "
                "own), or training added the tokens with resize_vocab: true (set it here too)"
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


def stop_token_ids_of_tokenizer(cfg: Config, tokenizer: Any, template: Any) -> list[int]:
    """`stop_token_ids` without a loaded model: the EOS ids of the model folder's
    generation_config.json (when it has one)."""
    from transformers import GenerationConfig

    from lmstack.models.load import hub_kwargs

    kwargs = {k: v for k, v in hub_kwargs(cfg).items() if k != "trust_remote_code"}
    try:
        config = GenerationConfig.from_pretrained(cfg.model.model_name_or_path, **kwargs)
    except OSError:
        config = None

    class _Model:
        generation_config = config

    return stop_token_ids(_Model(), tokenizer, template)


class TemplateEngine:
    """What every backend shares: the training template's prompts, the YAML's generation settings,
    and blocking / streaming generation on top of the backend's `submit` (the interface `lmstack
    api` uses). A backend sets `cfg`, `tokenizer`, `template` and implements `submit`."""

    name = "base"
    cfg: Config
    tokenizer: Any
    template: Any

    @property
    def tool_format(self) -> str:
        return self.template.tool_format

    def prompt_ids(
        self, messages: list[dict], system: str | None = None, tools: str | None = None
    ) -> list[int]:
        """`messages` alternate user|observation and assistant|function and end with a user turn;
        `system=None` uses `default_system` from the YAML, else the template's own; `tools` is a
        JSON list of function schemas, written in the template's tool format."""
        d = self.cfg.data
        return self.template.encode_prompt(
            self.tokenizer,
            messages,
            system if system is not None else d.default_system,
            tools=tools,
            enable_thinking=d.enable_thinking,
            preserve_thinking=d.preserve_thinking,
        )

    def text_ids(self, text: str, special: bool = True) -> list[int]:
        """A raw prompt (`/v1/completions`), with the tokenizer's own special tokens when `special`."""
        return self.tokenizer.encode(text, add_special_tokens=special)

    def sampling(self, **overrides: Any) -> Sampling:
        """Generation settings from the YAML; overrides (None = keep) for max_new_tokens, temperature,
        top_p, top_k, do_sample, repetition_penalty, and any other `Sampling` field (`stop`: a list of
        strings that end the reply before the first of them). temperature 0 means greedy; an explicit
        temperature above 0 (an OpenAI request's) samples even when the YAML says do_sample: false."""
        g = self.cfg.generating
        opts = {
            "max_tokens": g.max_new_tokens,
            "do_sample": g.do_sample,
            "temperature": g.temperature,
            "top_p": g.top_p,
            "top_k": g.top_k,
            "repetition_penalty": g.repetition_penalty,
        }
        if "max_new_tokens" in overrides:
            overrides["max_tokens"] = overrides.pop("max_new_tokens")
        opts.update({k: v for k, v in overrides.items() if v is not None})
        opts["stop"] = tuple(opts.get("stop") or ())
        if opts["temperature"] == 0:
            opts["do_sample"] = False
        elif overrides.get("temperature") is not None and "do_sample" not in overrides:
            opts["do_sample"] = True  # asking for a temperature above 0 asks for sampling
        return Sampling(**opts)

    def submit(self, ids: list[int], sampling: Sampling, sink: Sink, cancel: Any) -> None:
        """Queues one sequence: `sink` gets `Piece`s, then the `Generation` (or an Exception);
        `cancel.is_set()` (set from any thread) stops it at its next token, or before it starts."""
        raise NotImplementedError

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
        stream = self.stream_ids(ids, cancel, **overrides)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        messages: list[dict],
        system: str | None = None,
        cancel: threading.Event | None = None,
        **overrides: Any,
    ) -> Stream:
        """Queues the generation; iterate the result for text."""
        return self.stream_ids(self.prompt_ids(messages, system), cancel, **overrides)

    def stream_ids(self, ids: list[int], cancel: threading.Event | None = None, **overrides: Any) -> Stream:
        """`stream` from prompt ids; setting `cancel` (or `Stream.close`) stops at the next token."""
        return Stream(self, ids, self.sampling(**overrides), cancel)

    def close(self) -> None:
        pass


class ChatEngine(TemplateEngine):
    """The transformers backend: the model, its template and a continuous-batching scheduler
    (`infer/batching.py`). `submit` is the interface `lmstack api` uses for every backend."""

    name = "huggingface"

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, template: Any, max_batch: int = 16):
        from lmstack.infer.batching import Scheduler

        self.cfg, self.model, self.tokenizer, self.template = cfg, model, tokenizer, template
        self.stop_ids = stop_token_ids(model, tokenizer, template)
        self.scheduler = Scheduler(
            model, tokenizer, self.stop_ids, cfg.generating.skip_special_tokens, max_batch=max_batch
        )

    @classmethod
    def from_config(cls, cfg: Config, max_batch: int = 16) -> ChatEngine:
        import torch

        if cfg.model.infer_backend != "huggingface":
            raise ConfigError(
                f"infer_backend: {cfg.model.infer_backend} is served by lmstack api and lmstack chat "
                "(lmstack.infer.engines.load_engine); this tool runs transformers: set infer_backend: "
                "huggingface"
            )
        check_inference(cfg)
        if cfg.generating.num_beams > 1:
            raise ConfigError(
                f"num_beams: got {cfg.generating.num_beams}; chat/api stream tokens, which needs num_beams: 1"
            )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(cfg, *load_for_inference(cfg, device), max_batch=max_batch)

    @property
    def max_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def submit(self, ids: list[int], sampling: Sampling, sink: Sink, cancel: threading.Event) -> None:
        """Queues one sequence: `sink` gets `Piece`s, then the `Generation` (or an Exception);
        setting `cancel` (from any thread) stops it at its next token, or before it starts."""
        self.scheduler.submit(ids, sampling, sink, cancel)

    def close(self) -> None:
        self.scheduler.close()


class Stream:
    """Text pieces as they are generated (any backend's `submit`). After iteration: `.result`
    (a `Generation`); `.close()` stops the generation at its next token."""

    def __init__(
        self, engine: Any, ids: list[int], sampling: Sampling, cancel: threading.Event | None = None
    ):
        self.events: queue.Queue = queue.Queue()
        self.abort = threading.Event()
        self.result: Generation | None = None
        engine.submit(ids, sampling, self.events.put, Either(self.abort, cancel))

    def __iter__(self) -> Iterator[str]:
        while True:
            event = self.events.get()
            if isinstance(event, Exception):
                raise RuntimeError(f"generation failed: {event}") from event
            if isinstance(event, Generation):
                self.result = event
                return
            if event.text:
                yield event.text

    def close(self) -> None:
        self.abort.set()


class Either:
    """Set when any of its events is set (what a sequence's `cancel` needs: `is_set`)."""

    def __init__(self, *events: threading.Event | None):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


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
