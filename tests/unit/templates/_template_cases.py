"""A fixed conversation used by every template test, and LLaMA-Factory's tool texts for its tool
(written out by hand from LF 0.9.5's tool_utils.py); imported by the test modules."""

from __future__ import annotations

import json

SYSTEM = "Be brief."
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Sunny."},
]
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
TOOL_CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "function", "content": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
    {"role": "observation", "content": '{"temp": 22}'},
    {"role": "assistant", "content": "It is 22 degrees."},
]

TOOL_JSON = (
    '{"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}}'
)
WRAPPED = '{"type": "function", "function": ' + TOOL_JSON + "}"
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
LLAMA3_TOOL_JSON = (
    "{\n" + '    "type": "function",\n    "function": ' + TOOL_JSON_INDENT4.replace("\n", "\n    ") + "\n}"
)
QWEN_TOOLS = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + WRAPPED
    + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
QWEN3_5_TOOLS = (
    "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + TOOL_JSON + "\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN3_5_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)
