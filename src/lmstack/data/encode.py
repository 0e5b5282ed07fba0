"""Canonical example -> token ids + labels, per stage. Truncation is counted, never silent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IGNORE_INDEX = -100


@dataclass(frozen=True)
class EncodeOptions:
    stage: str
    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    default_system: str | None = None
    enable_thinking: bool | None = True
    preserve_thinking: bool = False


class DropExample(ValueError):
    """The example cannot be trained on; counted in the data report by `kind` (default: the reason).
    `field` is the record's field path when one field is to blame (e.g. the empty answer)."""

    def __init__(self, reason: str, field: str | None = None, kind: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.field = field
        self.kind = kind or reason


def infer_seqlen(source_len: int, target_len: int, budget: int) -> tuple[int, int]:
    """Split `budget` tokens between a source and a target (REFERENCE §3.4): keep a short target whole,
    else keep a short source whole, else share the budget in proportion to the two lengths."""
    if target_len * 2 < budget:
        max_target = budget
    elif source_len * 2 < budget:
        max_target = budget - source_len
    else:
        max_target = int(budget * target_len / (source_len + target_len))
    new_target = min(max_target, target_len)
    new_source = min(max(budget - new_target, 0), source_len)
    return new_source, new_target


def _encode_kwargs(template: Any, example: dict, opts: EncodeOptions) -> dict:
    system = example.get("system")
    if system is None:
        system = opts.default_system
    kwargs: dict = {
        "system": system,
        "enable_thinking": opts.enable_thinking,
        "preserve_thinking": opts.preserve_thinking,
    }
    if example.get("tools"):
        kwargs["tools"] = example["tools"]
    return kwargs


def encode_supervised(example: dict, tokenizer: Any, template: Any, opts: EncodeOptions) -> tuple[dict, bool]:
    """Returns ({input_ids, labels}, truncated). Every assistant turn is trained unless mask_history."""
    where = example.get("response_field")
    if not example["response"]:
        raise DropExample(
            "missing field: the record has no answer (plain text is for stage: pt)", where, "missing field"
        )
    if len(example["response"]) != 1:
        raise DropExample("expected one response", where)
    if not example["response"][0]["content"].strip():
        raise DropExample("empty response", where)
    messages = example["prompt"] + example["response"]
    pairs = template.encode_multiturn(tokenizer, messages, **_encode_kwargs(template, example, opts))
    if opts.mask_history:
        pairs = pairs[::-1]  # latest turn first, so truncation drops the oldest turns
    input_ids: list[int] = []
    labels: list[int] = []
    truncated = False
    trained = 0
    for turn, (src, tgt) in enumerate(pairs):
        budget = opts.cutoff_len - len(input_ids)
        if budget <= 0:
            truncated = True
            break
        src_len, tgt_len = infer_seqlen(len(src), len(tgt), budget)
        truncated |= src_len < len(src) or tgt_len < len(tgt)
        src, tgt = src[:src_len], tgt[:tgt_len]
        src_labels = list(src) if opts.train_on_prompt else [IGNORE_INDEX] * len(src)
        tgt_labels = list(tgt) if (not opts.mask_history or turn == 0) else [IGNORE_INDEX] * len(tgt)
        trained += (len(src) if opts.train_on_prompt else 0) + (
            len(tgt) if not opts.mask_history or turn == 0 else 0
        )
        if opts.mask_history:
            input_ids = src + tgt + input_ids
            labels = src_labels + tgt_labels + labels
        else:
            input_ids += src + tgt
            labels += src_labels + tgt_labels
    if trained == 0:
        raise DropExample("no trainable tokens after truncation to cutoff_len")
    return {"input_ids": input_ids, "labels": labels}, truncated


def encode_pretrain(example: dict, tokenizer: Any, template: Any, opts: EncodeOptions) -> tuple[dict, bool]:
    """Plain text + EOS; all tokens trained. Long texts are cut to cutoff_len (counted)."""
    text = example["prompt"][0]["content"] if example["prompt"] else ""
    if example["response"]:
        text = f"{text}\n{example['response'][0]['content']}" if text else example["response"][0]["content"]
    if not text.strip():
        raise DropExample("empty text")
    ids = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
    truncated = len(ids) > opts.cutoff_len
    ids = ids[: opts.cutoff_len]
    return {"input_ids": ids, "labels": list(ids)}, truncated


def _pref(name: str):
    """Encoders of the preference/RL stages live in data/encode_pref.py (which imports this module)."""

    def encode(example: dict, tokenizer: Any, template: Any, opts: EncodeOptions) -> tuple[dict, bool]:
        from lmstack.data import encode_pref

        return getattr(encode_pref, name)(example, tokenizer, template, opts)

    encode.__name__ = name
    return encode


ENCODERS = {
    "sft": encode_supervised,
    "pt": encode_pretrain,
    "rm": _pref("encode_pairwise"),
    "dpo": _pref("encode_pairwise"),
    "kto": _pref("encode_kto"),
    "ppo": _pref("encode_prompt_only"),
    "grpo": _pref("encode_prompt_only"),
    "rloo": _pref("encode_prompt_only"),
}
