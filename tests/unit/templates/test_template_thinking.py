"""Reasoning templates: qwen3 vs qwen3_nothink, enable_thinking True/False/None, preserve_thinking.
See src/lmstack/templates/THINKING.md for the rules these tests pin down."""

from __future__ import annotations

import pytest

from lmstack.templates import get_template

EMPTY = "<think>\n\n</think>\n\n"
COT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nThe answer is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]


def decoded(tok, name, messages=COT, **kw):
    pairs = get_template(name).encode_multiturn(tok, messages, "", **kw)
    return [(tok.decode(s), tok.decode(t)) for s, t in pairs]


def test_enable_thinking_true_trains_an_empty_thought_and_strips_history(tok):
    (s0, t0), (s1, t1) = decoded(tok, "qwen3")
    assert t0 == "The answer is 4.<|im_end|>\n"  # history CoT stripped, no empty block (official Qwen3)
    assert s1.endswith("<|im_start|>assistant\n")
    assert t1 == EMPTY + "6.<|im_end|>\n"  # trained


def test_enable_thinking_false_puts_the_empty_thought_in_the_prompt(tok):
    (_, t0), (s1, t1) = decoded(tok, "qwen3", enable_thinking=False)
    assert t0 == "The answer is 4.<|im_end|>\n"
    assert s1.endswith("<|im_start|>assistant\n" + EMPTY)  # masked
    assert t1 == "6.<|im_end|>\n"


def test_enable_thinking_false_removes_cot_of_the_last_turn_too(tok):
    conv = COT[:2]
    [(s, t)] = decoded(tok, "qwen3", conv, enable_thinking=False)
    assert s.endswith(EMPTY) and t == "The answer is 4.<|im_end|>\n"
    [(s, t)] = decoded(tok, "qwen3", conv, enable_thinking=True)
    assert s.endswith("assistant\n") and t == "<think>\nAdd them.\n</think>\n\nThe answer is 4.<|im_end|>\n"


def test_enable_thinking_none_inserts_nothing(tok):
    (_, t0), (s1, t1) = decoded(tok, "qwen3", enable_thinking=None)
    assert t0 == "The answer is 4.<|im_end|>\n"
    assert s1.endswith("assistant\n") and t1 == "6.<|im_end|>\n"


def test_preserve_thinking_keeps_history_cot(tok):
    (_, t0), (_, t1) = decoded(tok, "qwen3", preserve_thinking=True)
    assert t0 == "<think>\nAdd them.\n</think>\n\nThe answer is 4.<|im_end|>\n"
    assert t1 == EMPTY + "6.<|im_end|>\n"


@pytest.mark.parametrize("enable", [True, False, None])
def test_qwen3_nothink_leaves_messages_alone(tok, enable):
    (_, t0), (s1, t1) = decoded(tok, "qwen3_nothink", enable_thinking=enable)
    assert t0 == "<think>\nAdd them.\n</think>\n\nThe answer is 4.<|im_end|>\n"
    assert s1.endswith("assistant\n") and t1 == "6.<|im_end|>\n"


def test_generation_prompt(tok):
    template = get_template("qwen3")
    off = tok.decode(template.encode_prompt(tok, COT[:3], "", enable_thinking=False))
    on = tok.decode(template.encode_prompt(tok, COT[:3], ""))
    assert off.endswith("<|im_start|>assistant\n" + EMPTY) and "Add them" not in off
    assert on.endswith("<|im_start|>assistant\n") and "Add them" not in on


def test_cot_of_turns_after_the_last_user_query_is_kept():
    """A tool-call chain answers one query: its reasoning is not history (as in Qwen3's template)."""
    conv = [
        {"role": "user", "content": "Weather?"},
        {"role": "function", "content": '<think>\nneed a tool\n</think>\n\n{"name": "w", "arguments": {}}'},
        {"role": "observation", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    text = get_template("qwen3").render(conv, "")
    assert "<think>\nneed a tool\n</think>\n\n<tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n" + EMPTY + "Sunny.<|im_end|>\n")
