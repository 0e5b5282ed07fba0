"""Every built-in template renders the fixed conversation to the exact text of its family's format.

The expected strings are written out by hand from the official chat formats (and LLaMA-Factory
0.9.5's templates where the two differ, e.g. no space before a llama2 answer). The tokenizer is a
stub carrying the family's real bos/eos strings, so `{{bos_token}}`/`{{eos_token}}` show up as text.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _template_cases import CHAT, SYSTEM, TOOL_CHAT, TOOLS

from lmstack.templates import get_template, list_templates

TOOL_JSON = (
    '{"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}}'
)
TOOL_JSON_INDENT4 = (
    "{\n"
    '    "name": "get_weather",\n'
    '    "description": "Get the weather",\n'
    '    "parameters": {\n'
    '        "type": "object",\n'
    '        "properties": {\n'
    '            "city": {\n'
    '                "type": "string",\n'
    '                "description": "City name"\n'
    "            }\n"
    "        },\n"
    '        "required": [\n'
    '            "city"\n'
    "        ]\n"
    "    }\n"
    "}"
)
QWEN_TOOL_SYSTEM = (
    "Be brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": ' + TOOL_JSON + "}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
QWEN_TOOL_TURNS = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    '{THINK}<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"temp": 22}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    "{THINK}It is 22 degrees.<|im_end|>\n"
)
LLAMA3_TOOL_JSON = (
    "{\n"
    '    "type": "function",\n'
    '    "function": {\n'
    '        "name": "get_weather",\n'
    '        "description": "Get the weather",\n'
    '        "parameters": {\n'
    '            "type": "object",\n'
    '            "properties": {\n'
    '                "city": {\n'
    '                    "type": "string",\n'
    '                    "description": "City name"\n'
    "                }\n"
    "            },\n"
    '            "required": [\n'
    '                "city"\n'
    "            ]\n"
    "        }\n"
    "    }\n"
    "}"
)

# name -> (tokenizer bos, eos, conversation, tools, expected text)
CASES = {
    "qwen": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\n" + QWEN_TOOL_SYSTEM + "<|im_end|>\n" + QWEN_TOOL_TURNS.replace("{THINK}", "")),
    "qwen3": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\n" + QWEN_TOOL_SYSTEM + "<|im_end|>\n"
        + QWEN_TOOL_TURNS.replace("{THINK}", "<think>\n\n</think>\n\n")),
    "qwen3_nothink": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\n" + QWEN_TOOL_SYSTEM + "<|im_end|>\n" + QWEN_TOOL_TURNS.replace("{THINK}", "")),
    "chatml": (None, "<|im_end|>", CHAT, None,
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nSunny.<|im_end|>\n"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", TOOL_CHAT, TOOLS,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You have access to the following functions. To call a function, please respond with JSON for a "
        'function call. Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}. Do not use variables.\n\n" + LLAMA3_TOOL_JSON + "\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 22}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 22 degrees.<|eot_id|>"),
    "llama2": ("<s>", "</s>", CHAT, None,
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello!</s><s>[INST] Weather in Paris? [/INST]Sunny.</s>"),
    "mistral": ("<s>", "</s>", TOOL_CHAT, TOOLS,
        '<s>[INST] Be brief.[AVAILABLE_TOOLS] [{"type": "function", "function": ' + TOOL_JSON + "}]"
        "[/AVAILABLE_TOOLS]\n\nHi[/INST] Hello!</s>[INST] Weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>'
        '[TOOL_RESULTS] {"content": {"temp": 22}}[/TOOL_RESULTS] It is 22 degrees.</s>'),
    "gemma": ("<bos>", "<eos>", CHAT, None,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\nSunny.<end_of_turn>\n"),
    "glm4": (None, "<|endoftext|>", TOOL_CHAT, TOOLS,
        "[gMASK]<sop><|system|>\nBe brief.你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 "
        "GLM-4 模型开发的，你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具\n\n## get_weather\n\n"
        + TOOL_JSON_INDENT4 + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
        "<|user|>\nHi<|assistant|>\nHello!<|user|>\nWeather in Paris?<|assistant|>"
        'get_weather\n{"city": "Paris"}<|observation|>\n{"temp": 22}<|assistant|>\nIt is 22 degrees.'),
    "deepseek3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", CHAT, None,
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>Weather in Paris?<｜Assistant｜>Sunny.<｜end▁of▁sentence｜>"),
    "phi4": (None, "<|im_end|>", CHAT, None,
        "<|im_start|>system<|im_sep|>Be brief.<|im_end|>"
        "<|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant<|im_sep|>Hello!<|im_end|>"
        "<|im_start|>user<|im_sep|>Weather in Paris?<|im_end|><|im_start|>assistant<|im_sep|>Sunny.<|im_end|>"),
    "alpaca": (None, "</s>", CHAT, None,
        "Be brief.### Instruction:\nHi\n\n### Response:\nHello!</s>\n\n"
        "### Instruction:\nWeather in Paris?\n\n### Response:\nSunny.</s>\n\n"),
    "vicuna": (None, "</s>", CHAT, None,
        "Be brief.USER: Hi ASSISTANT:Hello!</s>USER: Weather in Paris? ASSISTANT:Sunny.</s>"),
    "default": (None, "</s>", TOOL_CHAT, TOOLS,
        "System: Be brief.You have access to the following tools:\n"
        "> Tool Name: get_weather\nTool Description: Get the weather\nTool Args:\n"
        "  - city (string, required): City name\n\n"
        "Use the following format if using a tool:\n```\nAction: tool name (one of [get_weather])\n"
        "Action Input: the input to the tool, in a JSON format representing the kwargs "
        '(e.g. ```{"input": "hello world", "num_beams": 5}```)\n```\n</s>\n'
        "Human: Hi</s>\nAssistant:Hello!</s>\nHuman: Weather in Paris?</s>\n"
        'Assistant:Action: get_weather\nAction Input: {"city": "Paris"}</s>\n'
        'Human: {"temp": 22}</s>\nAssistant:It is 22 degrees.</s>\n'),
    "empty": (None, "</s>", CHAT, None, "Be brief.HiHello!Weather in Paris?Sunny."),
}  # fmt: skip


def test_every_builtin_template_has_an_exact_render_case():
    assert sorted(CASES) == list_templates()


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_exact(name):
    bos, eos, conv, tools, expected = CASES[name]
    tokenizer = SimpleNamespace(bos_token=bos, eos_token=eos)
    assert get_template(name).render(conv, SYSTEM, tokenizer, tools=tools) == expected


DEFAULT_SYSTEMS = {
    "qwen": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n",
    "alpaca": "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n",
    "vicuna": "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions.",
}


@pytest.mark.parametrize("name", sorted(DEFAULT_SYSTEMS))
def test_default_system_used_for_none_and_dropped_for_empty_string(name):
    template = get_template(name)
    tokenizer = SimpleNamespace(bos_token=None, eos_token="</s>")
    with_default = template.render(CHAT[:1], None, tokenizer)
    without = template.render(CHAT[:1], "", tokenizer)
    assert with_default == DEFAULT_SYSTEMS[name] + without
    assert DEFAULT_SYSTEMS[name] not in without


def test_generation_prompt_ends_with_the_assistant_opener():
    tokenizer = SimpleNamespace(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    text = get_template("llama3").render(CHAT[:3], "", tokenizer)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_qwen_tools_without_system_start_the_system_turn():
    text = get_template("qwen3_nothink").render(CHAT[:1], None, None, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")


def test_parallel_qwen_calls_are_one_block_each():
    calls = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    conv = [{"role": "user", "content": "go"}, {"role": "function", "content": calls}]
    text = get_template("qwen").render(conv, "")
    assert text.endswith(
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
    )
