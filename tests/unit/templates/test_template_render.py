"""Built-in templates render the fixed conversation to the exact text LLaMA-Factory 0.9.5 produces.

The expected strings are written out by hand from LF's `data/template.py` and `tool_utils.py` (each
message formatted by its slot, the system block written when there is a system text or tools, the
tool text appended to the system text, reasoning templates prepending an empty thought to every answer
without one). The tokenizer is a stub carrying the family's real bos/eos strings, so `{{bos_token}}` /
`{{eos_token}}` show up as text. test_template_parity.py checks every template, token by token.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _template_cases import (
    CHAT,
    LLAMA3_TOOL_JSON,
    QWEN3_5_CALL,
    QWEN3_5_TOOLS,
    QWEN_CALL,
    QWEN_TOOLS,
    SYSTEM,
    TOOL_CHAT,
    TOOL_JSON,
    TOOL_JSON_INDENT4,
    TOOLS,
    WRAPPED,
)

from lmstack.templates import get_template
from lmstack.templates.tools import today

GLM4_MOE_TOOLS = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + WRAPPED
    + "\n</tools>"
    "\n\nFor each function call, output the function name and arguments within the following XML format:"
    "\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>"
    "\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>\n"
)
MINIMAX2_TOOLS = (
    "\n\n# Tools\n\nYou may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n\n<tools>\n<tool>"
    + TOOL_JSON
    + "</tool>\n</tools>\n\n"
    "When making tool calls, use XML format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n"
    '<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n'
    '<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n</minimax:tool_call>'
)
DEFAULT_TOOLS = (
    "You have access to the following tools:\n"
    "> Tool Name: get_weather\nTool Description: Get the weather\nTool Args:\n"
    "  - city (string, required): City name\n\n"
    "Use the following format if using a tool:\n```\nAction: tool name (one of [get_weather])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    '(e.g. ```{"input": "hello world", "num_beams": 5}```)\n```\n'
)
EMPTY = "<think>\n\n</think>\n\n"
QWEN_TURNS = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n{T}Hello!<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n{T}{CALL}<|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp": 22}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    "{T}It is 22 degrees.<|im_end|>\n"
)
GPT_EMPTY = "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>"


def qwen_like(think: str, call: str) -> str:
    return QWEN_TURNS.replace("{T}", think).replace("{CALL}", call)


def chatml_chat(think: str = "") -> str:
    return (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + think + "Hello!<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        + think
        + "Sunny.<|im_end|>\n"
    )


# name -> (tokenizer bos, eos, conversation, tools, expected text)
CASES = {
    "qwen": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\nBe brief." + QWEN_TOOLS + "<|im_end|>\n" + qwen_like("", QWEN_CALL)),
    "qwen3": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\nBe brief." + QWEN_TOOLS + "<|im_end|>\n" + qwen_like(EMPTY, QWEN_CALL)),
    "qwen3_nothink": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\nBe brief." + QWEN_TOOLS + "<|im_end|>\n" + qwen_like("", QWEN_CALL)),
    "qwen3_5": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\nBe brief." + QWEN3_5_TOOLS + "<|im_end|>\n" + qwen_like(EMPTY, QWEN3_5_CALL)),
    "qwen3_5_nothink": (None, "<|im_end|>", TOOL_CHAT, TOOLS,
        "<|im_start|>system\nBe brief." + QWEN3_5_TOOLS + "<|im_end|>\n" + qwen_like("", QWEN3_5_CALL)),
    "chatml": (None, "<|im_end|>", CHAT, None, "<|im_start|>system\nBe brief.<|im_end|>\n" + chatml_chat()),
    "yi": (None, "<|im_end|>", CHAT, None, "<|im_start|>system\nBe brief.<|im_end|>\n" + chatml_chat()),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", TOOL_CHAT, TOOLS,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Be brief.Cutting Knowledge Date: December 2023\nToday Date: {TODAY}\n\n"
        "You have access to the following functions. To call a function, please respond with JSON for a "
        'function call. Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}. Do not use variables.\n\n" + LLAMA3_TOOL_JSON + "\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 22}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 22 degrees.<|eot_id|>"),
    "llama4": ("<|begin_of_text|>", "<|eot|>", CHAT, None,
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
        "<|header_start|>user<|header_end|>\n\nHi<|eot|><|header_start|>assistant<|header_end|>\n\nHello!<|eot|>"
        "<|header_start|>user<|header_end|>\n\nWeather in Paris?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\nSunny.<|eot|>"),
    "llama2": ("<s>", "</s>", CHAT, None,
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello!</s><s>[INST] Weather in Paris? [/INST]Sunny.</s>"),
    "mistral": ("<s>", "</s>", TOOL_CHAT, TOOLS,
        "<s>[INST] Be brief.[AVAILABLE_TOOLS] [" + WRAPPED + "][/AVAILABLE_TOOLS]\n\nHi[/INST] Hello!</s>"
        "[INST] Weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>'
        '[TOOL_RESULTS] {"content": {"temp": 22}}[/TOOL_RESULTS] It is 22 degrees.</s>'),
    "mistral_small": ("<s>", "</s>", CHAT, None,
        "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]Hello!</s>[INST]Weather in Paris?[/INST]Sunny.</s>"),
    "gemma": ("<bos>", "<eos>", CHAT, None,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\nSunny.<end_of_turn>\n"),
    "gemma3": ("<bos>", "<eos>", CHAT, None,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\nSunny.<end_of_turn>\n"),
    "glm4": (None, "<|endoftext|>", TOOL_CHAT, TOOLS,
        "[gMASK]<sop><|system|>\nBe brief.你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 "
        "GLM-4 模型开发的，你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具\n\n## get_weather\n\n"
        + TOOL_JSON_INDENT4 + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
        "<|user|>\nHi<|assistant|>\nHello!<|user|>\nWeather in Paris?<|assistant|>"
        'get_weather\n{"city": "Paris"}<|observation|>\n{"temp": 22}<|assistant|>\nIt is 22 degrees.'),
    "glm4_moe": (None, "<|endoftext|>", TOOL_CHAT, TOOLS,
        "[gMASK]<sop><|system|>\nBe brief." + GLM4_MOE_TOOLS + "<|user|>\nHi<|assistant|>" + EMPTY + "\nHello!"
        "<|user|>\nWeather in Paris?<|assistant|>" + EMPTY
        + "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
        '<|observation|>\n{"temp": 22}<|assistant|>' + EMPTY + "\nIt is 22 degrees."),
    "deepseek3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", CHAT, None,
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>Weather in Paris?<｜Assistant｜>Sunny.<｜end▁of▁sentence｜>"),
    "deepseekr1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", CHAT, None,
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>" + EMPTY + "Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>Weather in Paris?<｜Assistant｜>" + EMPTY + "Sunny.<｜end▁of▁sentence｜>"),
    "phi4": (None, "<|im_end|>", CHAT, None,
        "<|im_start|>system<|im_sep|>Be brief.<|im_end|>"
        "<|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant<|im_sep|>Hello!<|im_end|>"
        "<|im_start|>user<|im_sep|>Weather in Paris?<|im_end|><|im_start|>assistant<|im_sep|>Sunny.<|im_end|>"),
    "phi4_mini": (None, "<|end|>", TOOL_CHAT, TOOLS,
        "<|system|>Be brief.<|tool|>" + TOOLS + "<|/tool|><|end|><|user|>Hi<|end|><|assistant|>Hello!<|end|>"
        "<|user|>Weather in Paris?<|end|><|assistant|>"
        'Action: get_weather\nAction Input: {"city": "Paris"}<|end|>'
        '<|user|>{"temp": 22}<|end|><|assistant|>It is 22 degrees.<|end|>'),
    "gpt_oss": (None, "<|return|>", CHAT, None,
        "<|start|>system<|message|>Be brief.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
        + GPT_EMPTY + "Hello!<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant" + GPT_EMPTY + "Sunny."),
    "seed_oss": ("<seed:bos>", "<seed:eos>", CHAT, None,
        "<seed:bos>system\nBe brief.<seed:eos><seed:bos>user\nHi<seed:eos><seed:bos>assistant\n"
        "<seed:think></seed:think>Hello!<seed:eos><seed:bos>user\nWeather in Paris?<seed:eos><seed:bos>assistant\n"
        "<seed:think></seed:think>Sunny.<seed:eos>"),
    "minimax2": (None, "[e~[", TOOL_CHAT, TOOLS,
        "]~!b[]~b]system\nBe brief." + MINIMAX2_TOOLS + "[e~[\n]~b]user\nHi[e~[\n]~b]ai\n" + EMPTY + "Hello![e~[\n"
        "]~b]user\nWeather in Paris?[e~[\n]~b]ai\n" + EMPTY
        + '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>[e~[\n'
        ']~b]tool\n<response>{"temp": 22}</response>[e~[\n]~b]ai\n' + EMPTY + "It is 22 degrees.[e~[\n"),
    "kimi_vl": (None, "<|im_end|>", CHAT, None,
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>◁think▷◁/think▷Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "◁think▷◁/think▷Sunny.<|im_end|>"),
    "granite3": (None, "<|end_of_text|>", CHAT, None,
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
        "Hello!<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Weather in Paris?<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Sunny.<|end_of_text|>\n"),
    "hunyuan": (None, "<|eos|>", CHAT, None,
        "<|startoftext|>Be brief.<|extra_4|>Hi<|extra_0|>Hello!<|eos|>Weather in Paris?<|extra_0|>Sunny.<|eos|>"),
    "ernie": (None, "</s>", CHAT, None,
        "<|im_start|>system\nBe brief.<|im_end|>\n\n<|im_start|>user\nHi<|im_end|>\n\n<|im_start|>assistant\n"
        "Hello!<|im_end|>\n\n<|im_start|>user\nWeather in Paris?<|im_end|>\n\n<|im_start|>assistant\nSunny.<|im_end|>\n\n"),
    "cohere": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", CHAT, None,
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
        "Hello!<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Weather in Paris?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Sunny.<|END_OF_TURN_TOKEN|>"),
    "olmo": (None, "<|endoftext|>", CHAT, None,
        "<|endoftext|>Be brief.<|user|>\nHi<|assistant|>\nHello!<|endoftext|>"
        "<|user|>\nWeather in Paris?<|assistant|>\nSunny.<|endoftext|>"),
    "exaone": (None, "[|endofturn|]", CHAT, None,
        "[|system|]Be brief.[|endofturn|]\n[|user|]Hi\n[|assistant|]Hello![|endofturn|]\n"
        "[|user|]Weather in Paris?\n[|assistant|]Sunny.[|endofturn|]\n"),
    "bailing_v2": (None, "<|endoftext|>", TOOL_CHAT, TOOLS,
        "<role>SYSTEM</role>Be brief." + QWEN_TOOLS.lstrip("\n") + "\ndetailed thinking off<|role_end|>"
        "<role>HUMAN</role>Hi<|role_end|><role>ASSISTANT</role>Hello!<|role_end|>"
        "<role>HUMAN</role>Weather in Paris?<|role_end|><role>ASSISTANT</role>" + QWEN_CALL + "<|role_end|>"
        '<role>OBSERVATION</role>\n<tool_response>\n{"temp": 22}\n</tool_response><|role_end|><role>ASSISTANT</role>'
        "It is 22 degrees.<|role_end|>"),
    "alpaca": (None, "</s>", CHAT, None,
        "Be brief.### Instruction:\nHi\n\n### Response:\nHello!</s>\n\n"
        "### Instruction:\nWeather in Paris?\n\n### Response:\nSunny.</s>\n\n"),
    "vicuna": (None, "</s>", CHAT, None,
        "Be brief.USER: Hi ASSISTANT:Hello!</s>USER: Weather in Paris? ASSISTANT:Sunny.</s>"),
    "default": (None, "</s>", TOOL_CHAT, TOOLS,
        "System: Be brief." + DEFAULT_TOOLS + "</s>\n"
        "Human: Hi</s>\nAssistant:Hello!</s>\nHuman: Weather in Paris?</s>\n"
        'Assistant:Action: get_weather\nAction Input: {"city": "Paris"}</s>\n'
        'Human: {"temp": 22}</s>\nAssistant:It is 22 degrees.</s>\n'),
    "empty": (None, "</s>", CHAT, None, "Be brief.HiHello!Weather in Paris?Sunny."),
    "baichuan2": (None, "</s>", CHAT, None,  # LF <= 0.9.4: user slot only, efficient EOS
        "Be brief.<reserved_106>Hi<reserved_107>Hello!<reserved_106>Weather in Paris?<reserved_107>Sunny."),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_exact(name):
    bos, eos, conv, tools, expected = CASES[name]
    tokenizer = SimpleNamespace(bos_token=bos, eos_token=eos)
    got = get_template(name).render(conv, SYSTEM, tokenizer, tools=tools)
    assert got == expected.replace("{TODAY}", today())


DEFAULT_SYSTEMS = {
    "qwen": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n",
    "smollm2": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face.<|im_end|>\n",
    "gpt_oss": "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.<|end|>",
    "alpaca": "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n",
    "vicuna": "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions.",
}


@pytest.mark.parametrize("name", sorted(DEFAULT_SYSTEMS))
def test_default_system_used_for_none_and_for_an_empty_string(name):
    """LF: `system or default_system`, so an empty system text also gets the default prompt."""
    template = get_template(name)
    tokenizer = SimpleNamespace(bos_token=None, eos_token="</s>")
    with_default = template.render(CHAT[:1], None, tokenizer)
    assert with_default.startswith(DEFAULT_SYSTEMS[name])
    assert template.render(CHAT[:1], "", tokenizer) == with_default
    assert DEFAULT_SYSTEMS[name] not in template.render(CHAT[:1], "Own.", tokenizer)


def test_generation_prompt_ends_with_the_assistant_opener():
    tokenizer = SimpleNamespace(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    text = get_template("llama3").render(CHAT[:3], "", tokenizer)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_parallel_qwen_calls_are_one_block_each():
    calls = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    conv = [{"role": "user", "content": "go"}, {"role": "function", "content": calls}]
    text = get_template("qwen").render(conv, "")
    assert text.endswith(
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
    )


def test_a_call_inside_tool_call_markers_keeps_the_text_before_it():
    """LF's tool_call_words: the JSON between <tool_call> and </tool_call> is the call; the rest stays."""
    content = 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    conv = [{"role": "user", "content": "Weather?"}, {"role": "function", "content": content}]
    text = get_template("qwen3_5_nothink").render(conv, "", tools=TOOLS)
    assert text.endswith("<|im_start|>assistant\nLet me look.\n" + QWEN3_5_CALL + "<|im_end|>\n")


def test_tool_format_override_resets_the_function_slot():
    """LF's `tool_format`: that format's prompt and calls, function slot = content + EOS."""
    template = get_template("qwen3_nothink", tool_format="llama3")
    conv = [{"role": "user", "content": "Weather?"}, TOOL_CHAT[3]]
    text = template.render(conv, "", SimpleNamespace(bos_token=None, eos_token="<|im_end|>"), tools=TOOLS)
    assert "Cutting Knowledge Date: December 2023" in text
    assert text.endswith(
        '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|im_end|>'
    )
