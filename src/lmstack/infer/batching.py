"""Continuous batching for the transformers backend.

One scheduler thread owns the model. Requests (`submit`) wait in an inbox; between decode steps the
thread admits them (up to `max_batch` sequences decode together): each new sequence is prefilled
alone (batch 1, so its first token is exactly what it gets served alone), then its KV cache joins the
batch's cache, left-padded to the batch's length. Every step is one forward of the last token of all
active sequences, with the padding masked out and each row's own position ids. A sequence that ends
(a stop token, a stop string, `max_tokens`, a complete JSON object, its cancel event) leaves the
batch at once (its cache rows are dropped, and columns that became padding for every row are cut).

Each sequence has its own sampling settings and its own `torch.Generator` (seeded by `seed`), so a
sequence's tokens do not depend on what else is in the batch (up to float rounding of batched
kernels). Text is detokenized incrementally (a few tokens of context, through the Rust tokenizer
directly where that gives exactly `tokenizer.decode`'s text) and held back while it could still
become a stop string, so streamed pieces and the full text agree.

A step's events (every row's `Piece`, the `Generation`s of rows that end) are handed out together
after the step's tokens are chosen: sinks that share a `many` attribute (a function taking
[(sink, event), ...]) get them in one call, so a server crosses into its event loop once per step,
not once per row; other sinks are called one event at a time.

Caches that are not plain `DynamicLayer`s (sliding-window, hybrid models) cannot be left-padded and
merged: such models are served one sequence at a time by the same loop (logged once).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from lmstack.infer.json_mode import feed, is_done
from lmstack.infer.sampling import (
    Generation,
    Piece,
    Sampling,
    Sink,
    TokenLogprob,
    choose,
    process_logits,
    token_logprob,
)

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    prompt: list[int]
    sampling: Sampling
    sink: Sink
    cancel: Any  # threading.Event, or anything with is_set()
    out: list[int] = field(default_factory=list)
    generator: Any = None
    text: str = ""  # decoded so far (cut at a stop string)
    sent: int = 0  # characters of `text` already emitted
    read: tuple[int, int] = (0, 0)  # incremental detokenization offsets into `out`
    logprobs: list[TokenLogprob] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    json_state: Any = None
    finished: str | None = None


class Scheduler:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_ids: list[int],
        skip_special_tokens: bool = True,
        max_batch: int = 16,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = set(stop_ids)
        self.skip_special_tokens = skip_special_tokens
        self.max_batch = max(1, max_batch)
        self.inbox: queue.Queue[Sequence | None] = queue.Queue()
        self.active: list[Sequence] = []
        self.cache: Any = None
        self.mask: Any = None  # [batch, cached length], 0 for left padding
        self.logits: Any = None  # [batch, vocab] for each active sequence's next token
        self.mergeable: bool | None = None
        self._json_vocab: Any = None
        self._token_text: dict[int, str] = {}
        self._decode = _exact_decoder(tokenizer)
        self._outbox: list[tuple[Sink, Any]] = []  # events of the running step (see `_flush`)
        self._cache_kwarg: str | None = None
        self.steps = 0  # decode forwards run (for tests and measurements)
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)
        _register_exit_hook()

    # ---- interface ------------------------------------------------------------------------
    def submit(self, ids: list[int], sampling: Sampling, sink: Sink, cancel: threading.Event) -> None:
        """Queues one sequence; `sink` gets `Piece`s, then the `Generation` (or an Exception)."""
        import torch

        seq = Sequence(list(ids), sampling, sink, cancel)
        if not sampling.greedy:
            seq.generator = torch.Generator(device=self.model.device)
            if sampling.seed is not None:
                seq.generator.manual_seed(sampling.seed)
            else:
                seq.generator.seed()
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self.inbox.put(seq)
            if self.thread is None:  # the loop runs only while there is work (then nothing pins the model)
                self.thread = threading.Thread(target=self._loop, name="lmstack-batching", daemon=True)
                self.thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Ends the loop after the running step (waiting sequences are failed)."""
        with self._lock:
            self._closed, thread = True, self.thread
            self.inbox.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        while True:
            try:
                if not self._admit():
                    return
                if self.active:
                    with torch.inference_mode():
                        self._step()
            except Exception as err:  # a failed forward fails the sequences it was running
                logger.error("batched generation failed: %s", err, exc_info=err)
                self._flush()
                for seq in self.active:
                    seq.sink(err)
                self._reset()

    def _fail_waiting(self, err: Exception) -> None:
        for seq in self.active:
            seq.sink(err)
        self._reset()
        while True:
            try:
                seq = self.inbox.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                seq.sink(err)

    def _reset(self) -> None:
        self.active, self.cache, self.mask, self.logits = [], None, None, None

    def _admit(self) -> bool:
        """Moves waiting sequences into the batch (waiting up to `IDLE_SECONDS` while nothing runs);
        False: the loop ends (closed, or idle)."""
        import torch

        while len(self.active) < self._limit():
            try:
                seq = self.inbox.get(block=not self.active, timeout=IDLE_SECONDS)
            except queue.Empty:
                if self.active:
                    return True
                with self._lock:
                    if self.inbox.empty():
                        self.thread = None
                        return False
                continue
            if seq is None:
                self._fail_waiting(RuntimeError("the engine was closed"))
                return False
            if seq.cancel.is_set():  # left while waiting: never generates
                seq.sink(Generation("", len(seq.prompt), 0, "stop", [] if seq.sampling.logprobs else None))
                continue
            try:
                with torch.inference_mode():
                    self._prefill(seq)
            except Exception as err:
                logger.error("prefill failed: %s", err, exc_info=err)
                seq.sink(err)
        return True

    def _limit(self) -> int:
        return self.max_batch if self.mergeable is not False else 1

    def _prefill(self, seq: Sequence) -> None:
        import torch
        from transformers import DynamicCache

        device = self.model.device
        ids = torch.tensor([seq.prompt], device=device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, **{self._cache_arg(): cache}, use_cache=True, logits_to_keep=1)
        if self.mergeable is None:
            from transformers.cache_utils import DynamicLayer

            self.mergeable = all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))
            if not self.mergeable:
                logger.info("this model's KV cache cannot be batched: sequences are generated one at a time")
        logits = out.logits[:, -1, :]  # the model's dtype: argmax is exact on it; sampling rows are cast
        mask = torch.ones((1, len(seq.prompt)), dtype=torch.long, device=device)
        if self.cache is None:
            self.cache, self.mask, self.logits = cache, mask, logits
        else:
            self._merge(cache, mask, logits)
        self.active.append(seq)

    def _cache_arg(self) -> str:
        """The forward's name for the KV cache (transformers renamed `past_key_values` to `cache`);
        the cache object is updated in place, so the output's copy is never read."""
        if self._cache_kwarg is None:
            import inspect

            params = inspect.signature(self.model.forward).parameters
            self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        return self._cache_kwarg

    def _merge(self, cache: Any, mask: Any, logits: Any) -> None:
        import torch
        import torch.nn.functional as F

        have, new = self.mask.shape[1], mask.shape[1]
        width = max(have, new)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                a = F.pad(a, (0, 0, width - have, 0))
                b = F.pad(b, (0, 0, width - new, 0))
                setattr(mine, name, torch.cat([a, b], dim=0))
        self.mask = torch.cat([F.pad(self.mask, (width - have, 0)), F.pad(mask, (width - new, 0))], dim=0)
        self.logits = torch.cat([self.logits, logits], dim=0)

    def _step(self) -> None:
        """Chooses every active sequence's next token, drops the finished, runs one forward."""
        import torch

        greedy = self.logits.argmax(-1).tolist()
        want_logprobs = any(s.sampling.logprobs for s in self.active)
        logprobs = self.logits.float().log_softmax(-1) if want_logprobs else None
        keep = []
        for i, seq in enumerate(self.active):
            token = greedy[i] if seq.sampling.plain else self._choose(seq, self.logits[i].float())
            self._accept(seq, token, None if logprobs is None else logprobs[i])
            if seq.finished is None:
                keep.append(i)
            else:
                self._finish(seq)
        self._flush()  # before the forward: the pieces go out while it runs
        if len(keep) < len(self.active):
            self._select(keep)
        if not self.active:
            return
        # each row's last token and its position, in one host-to-device copy
        rows = torch.tensor([[s.out[-1], len(s.prompt) + len(s.out) - 1] for s in self.active])
        rows = rows.to(self.mask.device)
        tokens, positions = rows[:, :1], rows[:, 1:]
        self.mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=positions,
            **{self._cache_arg(): self.cache},
            use_cache=True,
        )
        self.logits = out.logits[:, -1, :]
        self.steps += 1

    def _select(self, keep: list[int]) -> None:
        import torch

        self.active = [self.active[i] for i in keep]
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, device=self.mask.device)
        self.mask, self.logits = self.mask[index], self.logits[index]
        used = self.mask.any(dim=0).nonzero()
        cut = int(used[0]) if len(used) else 0  # leading columns that are padding for every row
        self.mask = self.mask[:, cut:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, cut:]
            layer.values = layer.values[index, :, cut:]

    # ---- one sequence ---------------------------------------------------------------------
    def _choose(self, seq: Sequence, row: Any) -> int:
        s = seq.sampling
        row = process_logits(row, s, seq.prompt + seq.out, seq.out)
        if s.json_object:
            allowed = self.json_vocab().allowed(
                seq.json_state or _json_start(), s.max_tokens - len(seq.out) - 1
            )
            full = row.new_zeros(row.shape[0], dtype=bool)
            full[: allowed.shape[0]] = allowed.to(row.device)
            row = row.masked_fill(~full, float("-inf"))
        return choose(row, s, seq.generator)

    def json_vocab(self) -> Any:
        if self._json_vocab is None:
            from lmstack.infer.json_mode import JsonVocab

            self._json_vocab = JsonVocab(self.tokenizer)
        return self._json_vocab

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def _accept(self, seq: Sequence, token: int, logprobs: Any) -> None:
        s = seq.sampling
        if token in self.stop_ids and not s.json_object:
            seq.out.append(token)
            seq.finished = "stop"
            return
        seq.out.append(token)
        if logprobs is not None and s.logprobs:
            entry = token_logprob(logprobs, token, s.top_logprobs, self.token_text)
            seq.logprobs.append(entry)
            seq.unsent_logprobs.append(entry)
        before = len(seq.text)
        seq.text += self._detokenize(seq)
        if s.stop:
            start = max(0, before - max(len(x) for x in s.stop) + 1)
            found = [i for i in (seq.text.find(x, start) for x in s.stop) if i >= 0]
            if found:
                seq.text, seq.finished = seq.text[: min(found)], "stop"
        if s.json_object and seq.finished is None:
            seq.json_state = feed(seq.json_state or _json_start(), seq.text[before:])
            if seq.json_state is None or is_done(seq.json_state):
                seq.finished = "stop"
        if seq.finished is None and len(seq.out) >= s.max_tokens:
            seq.finished = "length"
        if seq.finished is None and seq.cancel.is_set():
            seq.finished = "stop"
            logger.info("client gone: generation stopped after %d of %d tokens", len(seq.out), s.max_tokens)
        hold = 0 if seq.finished else max((len(x) for x in s.stop), default=1) - 1
        self._emit(seq, len(seq.text) - hold)

    def _detokenize(self, seq: Sequence) -> str:
        """New text of the last token, decoded with a few tokens of context; '' while the bytes so far
        are not whole UTF-8 (the text appears with the token that completes it)."""
        start, read = seq.read
        decode = self._decode
        skip = self.skip_special_tokens
        before = decode(seq.out[start:read], skip_special_tokens=skip)
        now = decode(seq.out[start:], skip_special_tokens=skip)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        seq.read = (read, len(seq.out))
        return now[len(before) :]

    def _emit(self, seq: Sequence, upto: int) -> None:
        if upto > seq.sent:
            self._outbox.append((seq.sink, Piece(seq.text[seq.sent : upto], seq.unsent_logprobs)))
            seq.sent, seq.unsent_logprobs = upto, []

    def _flush(self) -> None:
        """Hands out the step's events in order; those of sinks sharing a `many` in one call."""
        out, self._outbox = self._outbox, []
        groups: dict[Any, list[tuple[Sink, Any]]] = {}
        for sink, event in out:
            many = getattr(sink, "many", None)
            if many is None:
                sink(event)
            else:
                groups.setdefault(many, []).append((sink, event))
        for many, items in groups.items():
            many(items)

    def _finish(self, seq: Sequence) -> None:
        self._emit(seq, len(seq.text))
        if seq.unsent_logprobs:  # tokens whose text was cut by a stop string
            self._outbox.append((seq.sink, Piece("", seq.unsent_logprobs)))
        logprobs = seq.logprobs if seq.sampling.logprobs else None
        result = Generation(seq.text, len(seq.prompt), len(seq.out), seq.finished or "stop", logprobs)
        self._outbox.append((seq.sink, result))


IDLE_SECONDS = 2.0  # the loop's thread ends after this long without work
_LIVE: weakref.WeakSet = weakref.WeakSet()
_HOOKED: list[bool] = []


def _register_exit_hook() -> None:
    """At exit, stop running loops first (a thread killed inside torch aborts the process)."""
    if not _HOOKED:
        _HOOKED.append(True)
        atexit.register(lambda: [s.close(timeout=2.0) for s in list(_LIVE)])


def _exact_decoder(tokenizer: Any) -> Any:
    """`tokenizer.decode`, or the Rust tokenizer's own decode where that is exactly what
    `tokenizer.decode` would return (a tokenizers-backed tokenizer that overrides no decoding and
    applies no space clean-up): the same text at a fraction of the per-call cost."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return tokenizer.decode
    kind = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
    )
    if not plain or tokenizer.clean_up_tokenization_spaces:
        return tokenizer.decode
    return tokenizer._tokenizer.decode


def _json_start() -> Any:
    from lmstack.infer.json_mode import START

    return START
