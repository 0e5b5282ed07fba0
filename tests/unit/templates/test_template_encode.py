"""Encoding: ids agree with the tokenizer's own chat template, labels are masked where the template
says, efficient-EOS families train the EOS, and bad input fails with a message that says why."""

from __future__ import annotations

import pytest
from _template_cases import CHAT, SYSTEM, TOOL_CHAT

from lmstack.config.errors import ConfigError
from lmstack.data.encode import EncodeOptions, encode_supervised
from lmstack.templates import get_template
from lmstack.tiny import build_tokenizer

IGNORE = -100


def supervised(pairs):
    """The caller's rule (REFERENCE §3.3): sources masked, targets trained."""
    ids, labels = [], []
    for src, tgt in pairs:
        ids += src + tgt
        labels += [IGNORE] * len(src) + tgt
    return ids, labels


def trained_spans(tok, ids, labels):
    spans, cur = [], []
    for i, lab in zip(ids, labels):
        if lab == IGNORE and cur:
            spans.append(tok.decode(cur))
            cur = []
        elif lab != IGNORE:
            cur.append(i)
    return spans + ([tok.decode(cur)] if cur else [])


# The ChatML-shaped templates (LF's slots) against the tiny tokenizer's own ChatML chat template (built
# offline; its default system prompt is "You are a helpful assistant."): same ids, turn by turn.
CHATML = [
    "chatml", "chatml_de", "cpm4", "dbrx", "falcon_h1", "intern2", "intern_s1", "intern_vl", "lfm2", "lfm2_vl",
    "llava_next_qwen", "llava_next_video_yi", "llava_next_yi", "minicpm_o", "minicpm_v", "minicpm_v_4_6",
    "opencoder", "qwen", "qwen2_audio", "qwen2_omni", "qwen2_vl", "qwen3_5_nothink", "qwen3_nothink",
    "qwen3_omni_nothink", "qwen3_vl_nothink", "smollm", "smollm2", "yi",
]  # fmt: skip
HELPFUL = ["llava_next_qwen", "minicpm_v", "minicpm_v_4_6", "qwen2_audio", "qwen2_omni", "qwen2_vl"]


@pytest.mark.parametrize("name", CHATML)
def test_ids_equal_the_tokenizers_own_chat_template(tok, name):
    template = get_template(name)
    for system in [SYSTEM, None] if name in HELPFUL else [SYSTEM]:
        head = [{"role": "system", "content": system}] if system else []
        pairs = template.encode_multiturn(tok, CHAT, system)
        ids = [i for src, tgt in pairs for i in src + tgt]
        assert ids == tok.apply_chat_template([*head, *CHAT], tokenize=True, return_dict=False)
        prompt = tok.apply_chat_template(
            [*head, *CHAT[:3]], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert template.encode_prompt(tok, CHAT[:3], system) == prompt


def test_labels_mask_sources_and_train_answers_with_their_trailer(tok):
    pairs = get_template("qwen").encode_multiturn(tok, CHAT, SYSTEM)
    assert len(pairs) == 2
    assert tok.decode(pairs[0][0]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids, labels = supervised(pairs)
    assert trained_spans(tok, ids, labels) == ["Hello!<|im_end|>\n", "Sunny.<|im_end|>\n"]
    n_src = len(pairs[0][0])
    assert labels[:n_src] == [IGNORE] * n_src


def test_tool_turns_train_the_call_and_mask_the_observation(tok):
    pairs = get_template("qwen").encode_multiturn(tok, TOOL_CHAT, "")
    ids, labels = supervised(pairs)
    assert trained_spans(tok, ids, labels) == [
        "Hello!<|im_end|>\n",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "It is 22 degrees.<|im_end|>\n",
    ]
    assert tok.decode(pairs[2][0]) == (
        '<|im_start|>user\n<tool_response>\n{"temp": 22}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )


@pytest.fixture(scope="module")
def glm_tok():
    tok = build_tokenizer(["Hi Hello! Weather in Paris? Sunny."] * 4, vocab_size=512)
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                "[gMASK]",
                "<sop>",
                "<|system|>",
                "<|user|>",
                "<|assistant|>",
                "<|observation|>",
            ]
        },
        replace_extra_special_tokens=False,
    )
    return tok


def test_efficient_eos_labels_the_next_source_with_eos_and_ends_with_one(glm_tok):
    """LLaMA-Factory's layout: no EOS inside the row (the format prints none); the label of each later
    source's first token is EOS (the model learns to stop after an answer); one EOS closes the row."""
    template = get_template("glm4")
    eos = glm_tok.eos_token_id
    pairs = template.encode_multiturn(glm_tok, CHAT, "")
    assert all(eos not in src + tgt for src, tgt in pairs)
    assert glm_tok.decode(pairs[0][1]) == "\nHello!"
    assert pairs[1][0][0] == glm_tok.convert_tokens_to_ids("<|user|>")
    example = {"prompt": CHAT[:3], "response": CHAT[3:], "system": None, "tools": None}
    row, _ = encode_supervised(example, glm_tok, template, EncodeOptions("sft", 4096))
    (s0, t0), (s1, t1) = pairs
    assert row["input_ids"] == s0 + t0 + s1 + t1 + [eos]
    assert row["labels"] == [IGNORE] * len(s0) + t0 + [eos] + [IGNORE] * (len(s1) - 1) + t1 + [eos]
    assert glm_tok.eos_token not in template.render(CHAT, "", glm_tok)
    assert template.encode_prompt(glm_tok, CHAT[:3], "") == s0 + t0 + s1


def test_efficient_eos_keeps_room_for_the_closing_eos(glm_tok):
    template = get_template("glm4")
    example = {"prompt": CHAT[:1], "response": CHAT[1:2], "system": None, "tools": None}
    full, _ = encode_supervised(example, glm_tok, template, EncodeOptions("sft", 4096))
    cut, truncated = encode_supervised(
        example, glm_tok, template, EncodeOptions("sft", len(full["input_ids"]) - 1)
    )
    assert truncated and len(cut["input_ids"]) == len(full["input_ids"]) - 1
    assert cut["input_ids"][-1] == cut["labels"][-1] == glm_tok.eos_token_id


def test_bos_slot_becomes_the_bos_id(tok):
    tok2 = build_tokenizer(["Hi Hello!"] * 4, vocab_size=300)
    tok2.add_special_tokens({"bos_token": "<s>"})
    src, tgt = get_template("llama2").encode_multiturn(tok2, CHAT[:2], "")[0]
    assert src[0] == tok2.bos_token_id and tok2.decode(src) == "<s>[INST] Hi [/INST]"
    # a tokenizer without bos: the slot is empty (as in LLaMA-Factory)
    src, _ = get_template("llama2").encode_multiturn(tok, CHAT[:2], "")[0]
    assert tok.decode(src) == "[INST] Hi [/INST]"


def test_unknown_template_names_the_closest():
    with pytest.raises(ConfigError, match=r"template: got 'qwen3-nothink'.*did you mean 'qwen3_nothink'"):
        get_template("qwen3-nothink")


def test_role_order_error_names_the_message():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match=r"message 1: role 'user' where assistant or function is expected"):
        get_template("qwen").render(bad)
    with pytest.raises(ValueError, match=r"message 0: role 'assistant'"):
        get_template("qwen").render([{"role": "assistant", "content": "a"}])


def test_conversation_shape_errors(tok):
    with pytest.raises(ValueError, match="ends with an assistant turn"):
        get_template("qwen").encode_multiturn(tok, CHAT[:3])
    with pytest.raises(ValueError, match="ends with a user turn"):
        get_template("qwen").encode_prompt(tok, CHAT)
    bad_call = [{"role": "user", "content": "a"}, {"role": "function", "content": "get_weather(city=1)"}]
    with pytest.raises(ValueError, match="function message: not valid JSON"):
        get_template("qwen").render(bad_call)
    with pytest.raises(ValueError, match="tools: not valid JSON"):
        get_template("qwen").render(CHAT[:1], tools="[{")


def test_fix_tokenizer_makes_the_first_stop_word_eos():
    tok = build_tokenizer(["Hi"] * 4, vocab_size=300)
    tok.eos_token = "<|endoftext|>"
    notes = get_template("qwen").fix_tokenizer(tok)
    assert tok.eos_token == "<|im_end|>" and any("eos token set to <|im_end|>" in n for n in notes)
    assert get_template("qwen").stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    notes = get_template("llama3").fix_tokenizer(tok)
    assert "<|eom_id|>" in tok.get_vocab() and tok.eos_token == "<|eot_id|>"
