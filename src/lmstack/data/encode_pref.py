"""Canonical example -> token rows for the preference and RL stages (rm, dpo, kto, ppo, grpo, rloo).

Every row is `prompt + answer` as the template renders it, with the prompt masked in `*labels`
(-100) and the answer (its end-of-turn trailer included) kept — the same masks as sft, so a pairwise
row and an sft row of the same conversation are identical. Stages adapt these rows to TRL's inputs
(`prompt_ids` = the masked head of a row, `chosen_ids`/`completion_ids` = the rest).

    pairwise (rm, dpo): chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels
    kto:                input_ids, labels, kto_tag (True = desirable)
    ppo, grpo, rloo:    input_ids (the prompt, ending with the assistant opener; answers are generated)

Truncation follows LLaMA-Factory: pairwise uses the longer answer as the target length and cuts
both answers to it; counted as truncated, never silent. A pair whose answers are the same after the
cut is dropped (counted as "chosen and rejected are identical", like an identical pair in the data).
"""

from __future__ import annotations

from typing import Any

from lmstack.data.encode_common import (
    IDENTICAL,
    IGNORE_INDEX,
    DropExample,
    EncodeOptions,
    encode_kwargs,
    infer_seqlen,
)


def _prompt_and_answer(
    example: dict, answer: dict, tokenizer: Any, template: Any, opts: EncodeOptions
) -> tuple[list[int], list[int]]:
    """Ids of the whole prompt (history turns included, all masked) and of one answer (LF's
    encode_oneturn; an efficient-EOS template's answer ends with EOS, as in LF)."""
    if not answer["content"].strip():
        raise DropExample("empty response")
    messages = example["prompt"] + [answer]
    prompt, ids = template.encode_oneturn(tokenizer, messages, **encode_kwargs(template, example, opts))
    return list(prompt), list(ids) + ([tokenizer.eos_token_id] if template.efficient_eos else [])


def _row(prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer


def encode_pairwise(example: dict, tokenizer: Any, template: Any, opts: EncodeOptions) -> tuple[dict, bool]:
    """rm/dpo: one prompt, a chosen and a rejected answer -> two rows sharing the prompt."""
    if len(example["response"]) != 2:
        raise DropExample("a ranking example needs a chosen and a rejected answer")
    prompt, chosen = _prompt_and_answer(example, example["response"][0], tokenizer, template, opts)
    prompt_r, rejected = _prompt_and_answer(example, example["response"][1], tokenizer, template, opts)
    if prompt_r != prompt:  # cannot happen with a deterministic template; guards the shared-prompt layout
        raise DropExample("chosen and rejected render different prompts")
    src_len, tgt_len = infer_seqlen(len(prompt), max(len(chosen), len(rejected)), opts.cutoff_len)
    truncated = src_len < len(prompt) or tgt_len < max(len(chosen), len(rejected))
    prompt, chosen, rejected = prompt[:src_len], chosen[:tgt_len], rejected[:tgt_len]
    if not prompt:
        raise DropExample("no prompt token left after truncation to cutoff_len")
    if chosen == rejected:  # the answers differ only past cutoff_len: nothing to prefer
        raise DropExample(
            f"{IDENTICAL} after truncation to cutoff_len={opts.cutoff_len} (they differ only after "
            "it); raise cutoff_len or shorten the prompt",
            kind=IDENTICAL,
        )
    chosen_ids, chosen_labels = _row(prompt, chosen)
    rejected_ids, rejected_labels = _row(prompt, rejected)
    sample = {
        "chosen_input_ids": chosen_ids,
        "chosen_labels": chosen_labels,
        "rejected_input_ids": rejected_ids,
        "rejected_labels": rejected_labels,
    }
    return sample, truncated


def encode_kto(example: dict, tokenizer: Any, template: Any, opts: EncodeOptions) -> tuple[dict, bool]:
    """kto: one prompt + one answer and its desirability tag."""
    if example.get("kto_tag") is None:
        raise DropExample("no kto_tag: map the true/false column as columns.kto_tag in dataset_info.json")
    if len(example["response"]) != 1:
        raise DropExample("expected one response")
    prompt, answer = _prompt_and_answer(example, example["response"][0], tokenizer, template, opts)
    src_len, tgt_len = infer_seqlen(len(prompt), len(answer), opts.cutoff_len)
    truncated = src_len < len(prompt) or tgt_len < len(answer)
    prompt, answer = prompt[:src_len], answer[:tgt_len]
    if not prompt:
        raise DropExample("no prompt token left after truncation to cutoff_len")
    input_ids, labels = _row(prompt, answer)
    return {"input_ids": input_ids, "labels": labels, "kto_tag": bool(example["kto_tag"])}, truncated


def encode_prompt_only(
    example: dict, tokenizer: Any, template: Any, opts: EncodeOptions
) -> tuple[dict, bool]:
    """ppo/grpo/rloo: the prompt, ready for generation, and the dataset's answer (its response column) as
    `solution_ids`, empty when the record has none: the reference a reward such as `accuracy` compares
    with (it is never trained on)."""
    messages = example["prompt"]
    if not messages:
        raise DropExample("empty prompt")
    ids = template.encode_prompt(tokenizer, messages, **encode_kwargs(template, example, opts))
    truncated = len(ids) > opts.cutoff_len
    response = example.get("response") or []
    answer = response[0]["content"] if len(response) == 1 else ""
    solution = tokenizer(text=answer, add_special_tokens=False)["input_ids"] if answer else []
    return {"input_ids": list(ids[-opts.cutoff_len :]), "solution_ids": list(solution)}, truncated


def split_row(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """A row -> (prompt ids, answer ids): the prompt is the masked head of the row."""
    n = 0
    while n < len(labels) and labels[n] == IGNORE_INDEX:
        n += 1
    return list(input_ids[:n]), list(input_ids[n:])
