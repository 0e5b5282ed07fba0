"""Glaive-style tool-call data (sharegpt `tools` + `function_call` + `observation`) goes through the
data layer to the same ids and labels as under LLaMA-Factory 0.9.5, for qwen3, qwen3_5, llama3, glm4
and mistral.

The expected elements are written by hand from LF's `Template._encode` / `Llama2Template._encode`:
a tools-only system prompt keeps the tool prompt's leading newlines (`system + tool_text` with an
empty system), and `tools: "[]"` still writes the system block, empty (`if system or tools`: the
string "[]" is truthy, its tool text is ''). Each element is tokenized on its own, as LF does; labels
follow LF's supervised processor (efficient-EOS glm4: the next source's first label is EOS, one EOS at
the end).
"""

from __future__ import annotations

import json

import pytest
from _template_cases import (
    LLAMA3_TOOL_JSON,
    QWEN3_5_CALL,
    QWEN3_5_TOOLS,
    QWEN_CALL,
    QWEN_TOOLS,
    TOOL_JSON_INDENT4,
)

from lmstack.data.encode import IGNORE_INDEX, EncodeOptions, encode_supervised
from lmstack.data.formats import convert
from lmstack.data.registry import TAG_DEFAULTS, DatasetAttr
from lmstack.templates import get_template
from lmstack.templates.tools import today
from lmstack.tiny import build_tokenizer

TOOLS = json.dumps(
    [
        {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        }
    ]
)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
RECORD = {
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": CALL},
        {"from": "observation", "value": '{"temp": 22}'},
        {"from": "gpt", "value": "It is 22 degrees."},
    ],
    "tools": TOOLS,
}
ATTR = DatasetAttr(
    name="glaive", load_from="file", source="x", formatting="sharegpt",
    columns={"messages": "conversations", "tools": "tools"}, tags=dict(TAG_DEFAULTS),
)  # fmt: skip
BOS, EOS = ("bos",), ("eos",)
EMPTY = "<think>\n\n</think>\n\n"
QWEN_OBS = (
    '<|im_start|>user\n<tool_response>\n{"temp": 22}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
)
QWEN_USER = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
LLAMA3_TOOLS = (
    "Cutting Knowledge Date: December 2023\nToday Date: {TODAY}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a "
    'function call. Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}. Do not use variables.\n\n" + LLAMA3_TOOL_JSON + "\n\n"
)
GLM4_TOOLS = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具\n\n## get_weather\n\n"
    + TOOL_JSON_INDENT4 + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
)  # fmt: skip
MISTRAL_TOOLS = (
    '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}, '
    '"required": ["city"]}}}][/AVAILABLE_TOOLS]'
)


def qwen_family(tool_text: str, call: str, think: str) -> dict:
    """LF elements per message for a ChatML/qwen tool template (think: the empty thought, or '')."""
    pre = [think] if think else []
    return {
        TOOLS: [["<|im_start|>system\n" + tool_text + "<|im_end|>\n", QWEN_USER], pre + [call + "<|im_end|>\n"],
                [QWEN_OBS], pre + ["It is 22 degrees.<|im_end|>\n"]],
        "[]": [["<|im_start|>system\n<|im_end|>\n", QWEN_USER], pre + [call + "<|im_end|>\n"],
               [QWEN_OBS], pre + ["It is 22 degrees.<|im_end|>\n"]],
    }  # fmt: skip


def llama3(system: str) -> list:
    return [
        [BOS, "<|start_header_id|>system<|end_header_id|>\n\n" + system + "<|eot_id|>",
         "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n"],
        ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'],
        ['<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 22}<|eot_id|>'
         "<|start_header_id|>assistant<|end_header_id|>\n\n"],
        ["It is 22 degrees.<|eot_id|>"],
    ]  # fmt: skip


def glm4(system: str) -> list:
    return [
        ["[gMASK]<sop>", "<|system|>\n" + system, "<|user|>\nWeather in Paris?<|assistant|>"],
        ['get_weather\n{"city": "Paris"}'],
        ['<|observation|>\n{"temp": 22}<|assistant|>'],
        ["\nIt is 22 degrees."],
    ]


def mistral(system: str) -> list:
    return [
        [BOS, "[INST] " + system + "\n\nWeather in Paris?[/INST]"],
        ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', EOS],
        ['[TOOL_RESULTS] {"content": {"temp": 22}}[/TOOL_RESULTS]'],
        [" It is 22 degrees.", EOS],
    ]


EXPECTED = {
    "qwen3": qwen_family(QWEN_TOOLS, QWEN_CALL, EMPTY),
    "qwen3_5": qwen_family(QWEN3_5_TOOLS, QWEN3_5_CALL, EMPTY),
    "llama3": {TOOLS: llama3(LLAMA3_TOOLS), "[]": llama3("")},
    "glm4": {TOOLS: glm4(GLM4_TOOLS), "[]": glm4("")},
    "mistral": {TOOLS: mistral(MISTRAL_TOOLS), "[]": mistral("")},
}


def _tokenizer(template):
    tok = build_tokenizer([QWEN_TOOLS, QWEN3_5_TOOLS, GLM4_TOOLS, LLAMA3_TOOLS] * 2, vocab_size=1200)
    tok.add_special_tokens({"bos_token": "<s>"})
    template.fix_tokenizer(tok)  # as a run does: llama3 makes <|eot_id|> the EOS
    return tok


def _ids(tok, elements: list) -> list[int]:
    out: list[int] = []
    for e in elements:
        if e == BOS:
            out.append(tok.bos_token_id)
        elif e == EOS:
            out.append(tok.eos_token_id)
        else:
            out += tok.encode(e.replace("{TODAY}", today()), add_special_tokens=False)
    return out


def _lf_row(tok, messages: list, efficient_eos: bool) -> tuple[list, list]:
    input_ids, labels = [], []
    for turn in range(0, len(messages), 2):
        src, tgt = _ids(tok, messages[turn]), _ids(tok, messages[turn + 1])
        src_labels = [IGNORE_INDEX] * len(src)
        if efficient_eos and turn:
            src_labels[0] = tok.eos_token_id
        input_ids, labels = input_ids + src + tgt, labels + src_labels + tgt
    if efficient_eos:
        input_ids, labels = input_ids + [tok.eos_token_id], labels + [tok.eos_token_id]
    return input_ids, labels


@pytest.mark.parametrize("tools", [TOOLS, "[]"], ids=["tools-only system", "empty tools list"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_glaive_tool_data_encodes_as_llamafactory(name, tools):
    template = get_template(name)
    tok = _tokenizer(template)
    example = convert({**RECORD, "tools": tools}, ATTR)
    assert example["system"] is None and example["tools"] == tools
    row, truncated = encode_supervised(example, tok, template, EncodeOptions("sft", 4096))
    assert not truncated
    assert (row["input_ids"], row["labels"]) == _lf_row(tok, EXPECTED[name][tools], template.efficient_eos)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_tools_only_system_keeps_the_leading_blank_line(name):
    text = get_template(name).render(convert(RECORD, ATTR)["prompt"][:1], None, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n\n\n# Tools\n\nYou ")


@pytest.mark.parametrize(
    ("name", "block"),
    [
        ("qwen3", "<|im_start|>system\n<|im_end|>\n"),
        ("qwen3_5", "<|im_start|>system\n<|im_end|>\n"),
        ("llama3", "<|start_header_id|>system<|end_header_id|>\n\n<|eot_id|>"),
        ("glm4", "[gMASK]<sop><|system|>\n<|user|>"),
        ("mistral", "[INST] \n\nHi[/INST]"),
    ],
)
def test_an_empty_tools_list_writes_an_empty_system_block(name, block):
    conv = [{"role": "user", "content": "Hi"}]
    assert block in get_template(name).render(conv, None, tools="[]")
    assert block not in get_template(name).render(conv, None)


def test_llama3_tool_prompt_has_the_date_the_data_is_encoded():
    conv = [{"role": "user", "content": "Hi"}]
    text = get_template("llama3").render(conv, None, tools=TOOLS)
    assert f"Today Date: {today()}\n\n" in text
