"""Canonical example -> token ids + labels, per stage. Truncation is counted, never silent.

sft and pt are encoded here; the preference/RL stages in encode_pref.py. `ENCODERS` maps each stage
to its encoder; `encode_example` is what the pipeline calls: the record's text fields bounded first
(encode_common.py: bounded per-record work), then the stage's encoder. The shared pieces live in
encode_common.py and are re-exported here, so
`from lmstack.data.encode import IGNORE_INDEX, DropExample, EncodeOptions, ...` keeps working.
"""

from __future__ import annotations

from typing import Any

from lmstack.data.encode_common import (
    IGNORE_INDEX,
    DropExample,
    EncodeOptions,
    bound_example,
    encode_kwargs,
    encode_text,
    infer_seqlen,
)
from lmstack.data.encode_pref import encode_kto, encode_pairwise, encode_prompt_only
from lmstack.data.mm import expand_example, finish_sample
from lmstack.data.mm_av import expand_av, finish_av

__all__ = [
    "ENCODERS",
    "IGNORE_INDEX",
    "DropExample",
    "EncodeOptions",
    "encode_example",
    "encode_pretrain",
    "encode_supervised",
    "infer_seqlen",
]


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
    kwargs = encode_kwargs(template, example, opts)
    pairs = template.encode_multiturn(tokenizer, messages, mask_history=opts.mask_history, **kwargs)
    if opts.mask_history:
        pairs = pairs[::-1]  # latest turn first, so truncation drops the oldest turns
    # efficient-EOS templates print no EOS after an answer: LLaMA-Factory labels the first token of every
    # later source with EOS and ends the row with one EOS (kept inside cutoff_len)
    eos = tokenizer.eos_token_id if template.efficient_eos else None
    input_ids: list[int] = []
    labels: list[int] = []
    truncated = False
    trained = 0
    for turn, (src, tgt) in enumerate(pairs):
        budget = opts.cutoff_len - (eos is not None) - len(input_ids)
        if budget <= 0:
            truncated = True
            break
        src_len, tgt_len = infer_seqlen(len(src), len(tgt), budget)
        truncated |= src_len < len(src) or tgt_len < len(tgt)
        src, tgt = src[:src_len], tgt[:tgt_len]
        src_labels = list(src) if opts.train_on_prompt else [IGNORE_INDEX] * len(src)
        if eos is not None and turn != 0 and src_labels and not opts.train_on_prompt:
            src_labels[0] = eos
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
    if eos is not None:
        input_ids, labels = input_ids + [eos], labels + [eos]
    return {"input_ids": input_ids, "labels": labels}, truncated


def encode_pretrain(example: dict, tokenizer: Any, template: Any, opts: EncodeOptions) -> tuple[dict, bool]:
    """Plain text + EOS; all tokens trained. Long texts are cut to cutoff_len (counted); a text encoded
    whole (packed pt) is tokenized a piece at a time."""
    text = example["prompt"][0]["content"] if example["prompt"] else ""
    if example["response"]:
        text = f"{text}\n{example['response'][0]['content']}" if text else example["response"][0]["content"]
    if not text.strip():
        raise DropExample("empty text")
    ids = encode_text(tokenizer, text) + [tokenizer.eos_token_id]
    truncated = len(ids) > opts.cutoff_len
    ids = ids[: opts.cutoff_len]
    return {"input_ids": ids, "labels": list(ids)}, truncated


ENCODERS = {
    "sft": encode_supervised,
    "pt": encode_pretrain,
    "rm": encode_pairwise,
    "dpo": encode_pairwise,
    "kto": encode_kto,
    "ppo": encode_prompt_only,
    "grpo": encode_prompt_only,
    "rloo": encode_prompt_only,
}


def encode_example(
    example: dict, tokenizer: Any, template: Any, opts: EncodeOptions
) -> tuple[dict, bool, int]:
    """(sample, truncated, text fields cut before tokenizing) of one canonical example."""
    example, fields_cut = bound_example(example, tokenizer, opts)
    if opts.media is None:
        sample, truncated = ENCODERS[opts.stage](example, tokenizer, template, opts)
        return sample, truncated, fields_cut
    example, images, image_tokens = expand_example(example, opts.media)
    example, av_paths, av_tokens = expand_av(example, opts.media)  # videos and audio (data/mm_av.py)
    sample, truncated = ENCODERS[opts.stage](example, tokenizer, template, opts)
    sample = finish_sample(sample, images, image_tokens, opts.media, tokenizer)
    return finish_av(sample, av_paths, av_tokens, tokenizer), truncated, fields_cut
