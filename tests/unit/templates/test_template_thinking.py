"""Reasoning templates: qwen3 vs qwen3_nothink, enable_thinking True/False/None, preserve_thinking,
mask_history, and the two thinking styles. See src/lmstack/templates/THINKING.md for the rules."""

from __future__ import annotations

import pytest

from lmstack.config.errors import ConfigError
from lmstack.templates import get_template

EMPTY = "<think>\n\n</think>\n\n"
COT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nThe answer is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
A1 = "<think>\nAdd them.\n</think>\n\nThe answer is 4.<|im_end|>\n"
Q1 = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
Q2 = "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"


def decoded(tok, name, messages=COT, style="llamafactory", **kw):
    pairs = get_template(name, thinking_style=style).encode_multiturn(tok, messages, "", **kw)
    return [(tok.decode(s), tok.decode(t)) for s, t in pairs]


# ---- thinking_style: llamafactory (the default) ----------------------------------------------
def test_llamafactory_keeps_history_thoughts_and_trains_an_empty_thought(tok):
    assert decoded(tok, "qwen3") == [(Q1, A1), (Q2, EMPTY + "6.<|im_end|>\n")]
    # preserve_thinking only matters for prompts and mask_history: same rows
    assert decoded(tok, "qwen3", preserve_thinking=True) == decoded(tok, "qwen3")


def test_llamafactory_enable_thinking_false_strips_all_and_masks_the_empty_thoughts(tok):
    assert decoded(tok, "qwen3", enable_thinking=False) == [
        (Q1 + EMPTY, "The answer is 4.<|im_end|>\n"),
        (Q2 + EMPTY, "6.<|im_end|>\n"),
    ]


def test_llamafactory_enable_thinking_none_masks_the_empty_thought(tok):
    assert decoded(tok, "qwen3", enable_thinking=None) == [(Q1, A1), (Q2 + EMPTY, "6.<|im_end|>\n")]


def test_llamafactory_mask_history_drops_history_thoughts(tok):
    assert decoded(tok, "qwen3", mask_history=True) == [
        (Q1, "The answer is 4.<|im_end|>\n"),
        (Q2, EMPTY + "6.<|im_end|>\n"),
    ]
    assert decoded(tok, "qwen3", mask_history=True, preserve_thinking=True) == decoded(tok, "qwen3")


def test_llamafactory_generation_prompt_and_oneturn_rows(tok):
    template = get_template("qwen3")
    on = tok.decode(template.encode_prompt(tok, COT[:3], ""))
    off = tok.decode(template.encode_prompt(tok, COT[:3], "", enable_thinking=False))
    none = tok.decode(template.encode_prompt(tok, COT[:3], "", enable_thinking=None))
    kept = tok.decode(template.encode_prompt(tok, COT[:3], "", preserve_thinking=True))
    assert on == Q1 + "The answer is 4.<|im_end|>\n" + Q2
    assert off == none == on + EMPTY
    assert kept == Q1 + A1 + Q2
    prompt, answer = template.encode_oneturn(tok, COT, "")  # an rm/dpo/kto row
    assert (tok.decode(prompt), tok.decode(answer)) == (on, EMPTY + "6.<|im_end|>\n")


def test_an_empty_thought_goes_before_the_answer_slot(tok):
    """LF prepends the empty thought's ids to the answer's, so it comes before glm's leading newline."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert (
        get_template("glm4_moe").render(conv, "") == "[gMASK]<sop><|user|>\nHi<|assistant|>" + EMPTY + "\nYo"
    )
    assert get_template("glm4_7").render(conv, "") == "[gMASK]<sop><|user|>\nHi<|assistant|></think>\nYo"


@pytest.mark.parametrize("enable", [True, False, None])
def test_qwen3_nothink_leaves_messages_alone(tok, enable):
    (_, t0), (s1, t1) = decoded(tok, "qwen3_nothink", enable_thinking=enable)
    assert t0 == A1
    assert s1 == Q2 and t1 == "6.<|im_end|>\n"


# ---- thinking_style: inference (lmstack's rules) ---------------------------------------------
def test_inference_style_trains_an_empty_thought_and_strips_history(tok):
    (s0, t0), (s1, t1) = decoded(tok, "qwen3", style="inference")
    assert t0 == "The answer is 4.<|im_end|>\n"  # history CoT stripped, no empty block (official Qwen3)
    assert s1 == Q2
    assert t1 == EMPTY + "6.<|im_end|>\n"  # trained


def test_inference_style_enable_thinking_false_puts_the_empty_thought_in_the_prompt(tok):
    (_, t0), (s1, t1) = decoded(tok, "qwen3", style="inference", enable_thinking=False)
    assert t0 == "The answer is 4.<|im_end|>\n"
    assert s1 == Q2 + EMPTY  # masked
    assert t1 == "6.<|im_end|>\n"


def test_inference_style_enable_thinking_false_removes_cot_of_the_last_turn_too(tok):
    [(s, t)] = decoded(tok, "qwen3", COT[:2], style="inference", enable_thinking=False)
    assert s.endswith(EMPTY) and t == "The answer is 4.<|im_end|>\n"
    [(s, t)] = decoded(tok, "qwen3", COT[:2], style="inference", enable_thinking=True)
    assert s.endswith("assistant\n") and t == A1


def test_inference_style_enable_thinking_none_inserts_nothing(tok):
    (_, t0), (s1, t1) = decoded(tok, "qwen3", style="inference", enable_thinking=None)
    assert t0 == "The answer is 4.<|im_end|>\n"
    assert s1 == Q2 and t1 == "6.<|im_end|>\n"


def test_inference_style_preserve_thinking_keeps_history_cot(tok):
    (_, t0), (_, t1) = decoded(tok, "qwen3", style="inference", preserve_thinking=True)
    assert t0 == A1
    assert t1 == EMPTY + "6.<|im_end|>\n"


def test_inference_style_generation_prompt(tok):
    template = get_template("qwen3", thinking_style="inference")
    off = tok.decode(template.encode_prompt(tok, COT[:3], "", enable_thinking=False))
    on = tok.decode(template.encode_prompt(tok, COT[:3], ""))
    none = tok.decode(template.encode_prompt(tok, COT[:3], "", enable_thinking=None))
    assert off.endswith(Q2 + EMPTY) and "Add them" not in off
    assert on.endswith(Q2) and "Add them" not in on
    assert none == on


def test_inference_style_keeps_the_cot_of_turns_after_the_last_user_query():
    """A tool-call chain answers one query: its reasoning is not history (as in Qwen3's template)."""
    conv = [
        {"role": "user", "content": "Weather?"},
        {"role": "function", "content": '<think>\nneed a tool\n</think>\n\n{"name": "w", "arguments": {}}'},
        {"role": "observation", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    text = get_template("qwen3", thinking_style="inference").render(conv, "")
    assert "<think>\nneed a tool\n</think>\n\n<tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n" + EMPTY + "Sunny.<|im_end|>\n")


def test_thinking_style_is_checked_and_warns_where_it_does_nothing(caplog):
    with pytest.raises(
        ConfigError, match=r"thinking_style: got 'lmstack'; allowed: llamafactory \| inference"
    ):
        get_template("qwen3", thinking_style="lmstack")
    with caplog.at_level("WARNING"):
        get_template("qwen3_nothink", thinking_style="inference")
    assert "thinking_style has no effect: template qwen3_nothink is not a reasoning template" in caplog.text
