"""What one generated sequence asks for (`Sampling`), what it reports (`Piece`, `Generation`), and the
per-row logits processing of the transformers backend. Shared by every backend: the vLLM / SGLang
backends translate `Sampling` into their own parameters (`infer/engines.py`).

Order of processing, as in transformers' `generate`: logit_bias, repetition_penalty (prompt and
output tokens), presence/frequency penalties (output tokens, OpenAI's definition), then for sampling
temperature, top_k, top_p. Logprobs are `log_softmax` of the model's raw logits (before any of that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the reply ends before the first of these
    logprobs: bool = False
    top_logprobs: int = 0
    json_object: bool = False  # constrained to one JSON object (infer/json_mode.py)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def plain(self) -> bool:
        """Greedy with nothing that changes the logits: the batch's argmax is the answer."""
        return (
            self.greedy
            and self.repetition_penalty == 1.0
            and not self.presence_penalty
            and not self.frequency_penalty
            and not self.logit_bias
            and not self.json_object
        )


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...] = ()  # (token, id, logprob), best first


@dataclass
class Piece:
    """New text of a sequence (after stop-string hold-back) and the logprobs of its tokens."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (a stop token/string, a complete JSON object, an abort) | "length"
    logprobs: list[TokenLogprob] | None = None


Sink = Callable[[Any], None]  # receives Piece..., then a Generation (or an Exception)


def process_logits(row: Any, sampling: Sampling, context: list[int], output: list[int]) -> Any:
    """The logits one sequence samples from (a new tensor; `row` is not changed)."""
    import torch

    row = row.clone()
    for token, bias in sampling.logit_bias:
        if token < row.shape[0]:
            row[token] += bias
    if sampling.repetition_penalty != 1.0 and context:
        seen = torch.tensor(sorted(set(context)), device=row.device)
        values = row[seen]
        p = sampling.repetition_penalty
        row[seen] = torch.where(values < 0, values * p, values / p)
    if (sampling.presence_penalty or sampling.frequency_penalty) and output:
        ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
        row[ids] -= sampling.frequency_penalty * counts.to(row.dtype) + sampling.presence_penalty
    return row


def choose(row: Any, sampling: Sampling, generator: Any) -> int:
    """Greedy argmax, or a draw after temperature / top_k / top_p with the sequence's generator."""
    import torch

    if sampling.greedy:
        return int(row.argmax())
    row = row / sampling.temperature
    if sampling.top_k and sampling.top_k < row.shape[0]:
        kth = torch.topk(row, sampling.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(row, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative > sampling.top_p
        drop[1:] = drop[:-1].clone()
        drop[0] = False  # the most likely token always stays
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = row.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logprobs: Any, token: int, top: int, text: Callable[[int], str]) -> TokenLogprob:
    entries: tuple = ()
    if top:
        values, ids = logprobs.topk(top)
        entries = tuple((text(int(i)), int(i), float(v)) for v, i in zip(values, ids, strict=True))
    return TokenLogprob(text(token), token, float(logprobs[token]), entries)
