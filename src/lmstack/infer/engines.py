"""`infer_backend: vllm | sglang` (LLaMA-Factory's field): `lmstack api` and `lmstack chat` served by
those engines behind the same interface as the transformers backend (`TemplateEngine.submit`): the
prompt is still encoded by lmstack with the training template and handed over as token ids, so every
backend sees the ids training saw; the engine does the batching and sampling.

- vLLM: `AsyncLLMEngine` with LF's `vllm_maxlen`, `vllm_gpu_util`, `vllm_enforce_eager`,
  `vllm_max_lora_rank` and `vllm_config` (merged last); the LoRA adapter of `adapter_name_or_path` (or
  output_dir) is served unmerged through `enable_lora` and a `LoRARequest` on every request.
- SGLang: `sglang.Engine` with `sglang_maxlen`, `sglang_mem_fraction`, `sglang_tp_size`,
  `sglang_lora_backend` and `sglang_config`; the adapter is loaded as a LoRA path, unmerged.

Checked before anything loads (`check_backend`): the package is installed (else `infer_backend: vllm
needs the vllm package: pip install vllm`), at most one adapter, LoRA adapters only (as in LF). The
sampling translation (`vllm_sampling_kwargs`, `sglang_sampling_kwargs`) is plain data so it can be
read and tested without the engines; an option an engine cannot honour is refused by name.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import uuid
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.extras import install_line
from lmstack.config.schema import Config
from lmstack.infer.engine import TemplateEngine, adapter_dirs, check_inference, load_tokenizer_and_template
from lmstack.infer.sampling import Generation, Piece, Sampling, Sink, TokenLogprob

logger = logging.getLogger(__name__)
PACKAGES = {"vllm": "vllm", "sglang": "sglang"}


def check_backend(cfg: Config) -> None:
    """Refusals that need no model load; each names the field and the fix."""
    backend = cfg.model.infer_backend
    if backend == "huggingface":
        return
    adapters = adapter_dirs(cfg)
    if len(adapters) > 1:
        raise ConfigError(
            f"adapter_name_or_path: infer_backend {backend} serves one LoRA adapter unmerged, got "
            f"{len(adapters)}; merge them with lmstack export first, or use infer_backend: huggingface"
        )
    package = PACKAGES[backend]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"infer_backend: {backend} needs the {package} package: {install_line(backend)} (or set "
            "infer_backend: huggingface)"
        )


def _dtype(cfg: Config) -> str:
    return "auto" if cfg.model.infer_dtype == "auto" else cfg.model.infer_dtype


def vllm_engine_args(cfg: Config, gpus: int) -> dict:
    """`AsyncEngineArgs` keywords (LF's vllm_* fields; `vllm_config` last, so it wins)."""
    m = cfg.model
    args: dict[str, Any] = {
        "model": m.model_name_or_path,
        "trust_remote_code": m.trust_remote_code,
        "download_dir": m.cache_dir,
        "revision": m.model_revision,
        "dtype": _dtype(cfg),
        "max_model_len": m.vllm_maxlen,
        "tensor_parallel_size": max(gpus, 1),
        "gpu_memory_utilization": m.vllm_gpu_util,
        "disable_log_stats": True,
        "enforce_eager": m.vllm_enforce_eager,
        "enable_lora": bool(adapter_dirs(cfg)),
        "max_lora_rank": m.vllm_max_lora_rank,
    }
    return {**args, **(m.vllm_config or {})}


def vllm_sampling_kwargs(s: Sampling, stop_ids: list[int], skip_special_tokens: bool) -> dict:
    """`vllm.SamplingParams` keywords for one sequence. `json_object` is returned as such: the caller
    turns it into the structured-output object of the installed vLLM version."""
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": s.max_tokens,
        "temperature": 0.0 if s.greedy else s.temperature,
        "top_p": 1.0 if s.greedy else s.top_p,
        "top_k": -1 if s.greedy or not s.top_k else s.top_k,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "seed": s.seed,
        "stop": list(s.stop) or None,
        "stop_token_ids": list(stop_ids),
        "skip_special_tokens": skip_special_tokens,
        "logprobs": s.top_logprobs if s.logprobs else None,
    }
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    if s.json_object:
        kwargs["json_object"] = True
    return kwargs


def sglang_engine_args(cfg: Config, gpus: int) -> dict:
    """`sglang.Engine` keywords (LF's sglang_* fields; `sglang_config` last, so it wins)."""
    m = cfg.model
    adapters = adapter_dirs(cfg)
    args: dict[str, Any] = {
        "model_path": m.model_name_or_path,
        "trust_remote_code": m.trust_remote_code,
        "download_dir": m.cache_dir,
        "revision": m.model_revision,
        "dtype": _dtype(cfg),
        "context_length": m.sglang_maxlen,
        "mem_fraction_static": m.sglang_mem_fraction,
        "tp_size": max(gpus, 1) if m.sglang_tp_size == -1 else m.sglang_tp_size,
        "log_level": "error",
    }
    if adapters:
        args.update(lora_paths=[adapters[0]], max_loras_per_batch=1, lora_backend=m.sglang_lora_backend)
    return {**args, **(m.sglang_config or {})}


def sglang_sampling_kwargs(s: Sampling, stop_ids: list[int], skip_special_tokens: bool) -> dict:
    """SGLang `sampling_params` for one sequence (logprobs are arguments of `generate`, not here)."""
    params: dict[str, Any] = {
        "max_new_tokens": s.max_tokens,
        "temperature": 0.0 if s.greedy else s.temperature,
        "top_p": 1.0 if s.greedy else s.top_p,
        "top_k": -1 if s.greedy or not s.top_k else s.top_k,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "stop": list(s.stop) or None,
        "stop_token_ids": list(stop_ids),
        "skip_special_tokens": skip_special_tokens,
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    if s.logit_bias:
        params["logit_bias"] = {str(k): v for k, v in s.logit_bias}
    if s.json_object:
        params["json_schema"] = '{"type": "object"}'
    return params


class AsyncBackend(TemplateEngine):
    """An engine that runs on its own asyncio loop in a thread; `submit` schedules `_run` there."""

    def __init__(self, cfg: Config):
        from lmstack.infer.engine import stop_token_ids_of_tokenizer

        self.cfg = cfg
        self.tokenizer, self.template = load_tokenizer_and_template(cfg)
        self.stop_ids = stop_token_ids_of_tokenizer(cfg, self.tokenizer, self.template)
        self.adapter = (adapter_dirs(cfg) or [None])[0]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"lmstack-{self.name}", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self) -> None:
        raise NotImplementedError

    async def _run(self, ids: list[int], s: Sampling, sink: Sink, cancel: Any) -> None:
        raise NotImplementedError

    def submit(self, ids: list[int], sampling: Sampling, sink: Sink, cancel: Any) -> None:
        async def guarded() -> None:
            try:
                await self._run(ids, sampling, sink, cancel)
            except Exception as err:  # reported to the reader, as the transformers backend does
                logger.error("%s generation failed: %s", self.name, err, exc_info=err)
                sink(err)

        asyncio.run_coroutine_threadsafe(guarded(), self.loop)

    @staticmethod
    def piece(sink: Sink, text: str, sent: int, entries: list[TokenLogprob]) -> int:
        if len(text) > sent or entries:
            sink(Piece(text[sent:], entries))
        return max(sent, len(text))


class VllmEngine(AsyncBackend):
    name = "vllm"

    @property
    def max_length(self) -> int | None:
        return self.cfg.model.vllm_maxlen

    async def _start(self) -> None:
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        from lmstack.launch.context import LaunchContext

        args = vllm_engine_args(self.cfg, LaunchContext.from_env().gpu_count)
        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**args))
        self.lora = None
        if self.adapter:
            from vllm.lora.request import LoRARequest

            self.lora = LoRARequest("default", 1, self.adapter)
        logger.info(
            "vLLM engine ready (%s%s)", args["model"], f" + LoRA {self.adapter}" if self.adapter else ""
        )

    def params(self, s: Sampling) -> Any:
        import vllm

        kwargs = vllm_sampling_kwargs(s, self.stop_ids, self.cfg.generating.skip_special_tokens)
        if kwargs.pop("json_object", False):
            try:
                from vllm.sampling_params import StructuredOutputsParams

                kwargs["structured_outputs"] = StructuredOutputsParams(json_object=True)
            except ImportError:
                from vllm.sampling_params import GuidedDecodingParams

                kwargs["guided_decoding"] = GuidedDecodingParams(json_object=True)
        return vllm.SamplingParams(**kwargs)

    async def _run(self, ids: list[int], s: Sampling, sink: Sink, cancel: Any) -> None:
        request_id = uuid.uuid4().hex
        sent, seen, entries, final = 0, 0, [], None
        stream = self.engine.generate(
            {"prompt_token_ids": ids}, self.params(s), request_id, lora_request=self.lora
        )
        async for output in stream:
            if cancel.is_set():
                await self.engine.abort(request_id)
                break
            final = output.outputs[0]
            new = []
            for position in (final.logprobs or [])[seen:]:
                new.append(self._entry(final.token_ids[seen + len(new)], position, s.top_logprobs))
            seen += len(new)
            entries += new
            sent = self.piece(sink, final.text, sent, new)
        text = final.text[:sent] if final is not None else ""
        tokens = len(final.token_ids) if final is not None else 0
        reason = "length" if final is not None and final.finish_reason == "length" else "stop"
        sink(Generation(text, len(ids), tokens, reason, entries if s.logprobs else None))

    @staticmethod
    def _entry(token: int, position: dict, top: int) -> TokenLogprob:
        ranked = sorted(position.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top]
        chosen = position[token]
        return TokenLogprob(
            chosen.decoded_token or "",
            token,
            float(chosen.logprob),
            tuple((lp.decoded_token or "", tid, float(lp.logprob)) for tid, lp in ranked),
        )


class SglangEngine(AsyncBackend):
    name = "sglang"

    @property
    def max_length(self) -> int | None:
        return self.cfg.model.sglang_maxlen

    async def _start(self) -> None:
        import sglang

        from lmstack.launch.context import LaunchContext

        args = sglang_engine_args(self.cfg, LaunchContext.from_env().gpu_count)
        self.engine = sglang.Engine(**args)
        logger.info("SGLang engine ready (%s)", args["model_path"])

    async def _run(self, ids: list[int], s: Sampling, sink: Sink, cancel: Any) -> None:
        params = sglang_sampling_kwargs(s, self.stop_ids, self.cfg.generating.skip_special_tokens)
        extra: dict[str, Any] = {"lora_path": self.adapter} if self.adapter else {}
        if s.logprobs:
            extra.update(return_logprob=True, top_logprobs_num=s.top_logprobs, return_text_in_logprobs=True)
        stream = await self.engine.async_generate(input_ids=ids, sampling_params=params, stream=True, **extra)
        text, sent, entries, meta = "", 0, [], {}
        async for chunk in stream:
            text, meta = chunk.get("text", text), chunk.get("meta_info", meta)
            if cancel.is_set():
                break  # the engine stops the request when its stream is closed
            new = self._entries(meta, len(entries), s.top_logprobs) if s.logprobs else []
            entries += new
            sent = self.piece(sink, text, sent, new)
        await stream.aclose()
        finish = (meta.get("finish_reason") or {}).get("type")
        tokens = int(meta.get("completion_tokens", 0))
        sink(
            Generation(
                text[:sent], len(ids), tokens, "length" if finish == "length" else "stop", entries or None
            )
        )

    @staticmethod
    def _entries(meta: dict, seen: int, top: int) -> list[TokenLogprob]:
        chosen = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        out = []
        for i in range(seen, len(chosen)):
            logprob, token, text = chosen[i][:3]
            ranked = tuple(
                (t or "", tid, float(lp)) for lp, tid, t in (tops[i] if i < len(tops) else [])[:top]
            )
            out.append(TokenLogprob(text or "", int(token), float(logprob), ranked))
        return out


def load_engine(cfg: Config, max_batch: int = 16) -> TemplateEngine:
    """The engine of `infer_backend`, checked before anything loads."""
    from lmstack.infer.engine import ChatEngine

    check_backend(cfg)
    if cfg.model.infer_backend == "huggingface":
        return ChatEngine.from_config(cfg, max_batch=max_batch)
    check_inference(cfg)
    return {"vllm": VllmEngine, "sglang": SglangEngine}[cfg.model.infer_backend](cfg)
