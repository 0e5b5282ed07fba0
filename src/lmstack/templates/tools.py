"""Tool formats: how a `tools` list is written into the system prompt and how a function call is
written into the assistant turn. Same texts as LLaMA-Factory 0.9.5 `data/tool_utils.py`.

`tools` is a JSON string of a list of function schemas (`{"name", "description", "parameters"}`,
optionally wrapped as `{"type": "function", "function": {...}}`). A `function` message's content is
a JSON string of one call `{"name": ..., "arguments": {...}}` or of a list of them.

Deviation from LLaMA-Factory: the llama3 prompt's "Today Date" is a fixed string (Llama 3.1's own
chat-template default, `LLAMA3_DATE`) instead of the current date, so the same data always encodes
to the same ids (and the dataset cache key stays valid from one day to the next). And the llama3
tool text goes *before* the system text (`TOOLS_BEFORE_SYSTEM`), the order of Llama 3.1's own
template ("Cutting Knowledge Date: ..." opens the system header); LLaMA-Factory appends it after,
which glues "...system text.Cutting Knowledge Date". Every other format appends, as LLaMA-Factory does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

LLAMA3_DATE = "26 Jul 2024"
TOOLS_BEFORE_SYSTEM = frozenset({"llama3"})

DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    """(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n"""
    "```\n"
)

GLM4_TOOL_PROMPT = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具{tool_text}"
)

LLAMA3_TOOL_PROMPT = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    """Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. """
    "Do not use variables.\n\n{tool_text}"
)

QWEN_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    """<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, """
    """"arguments": <args-json-object>}}\n</tool_call>"""
)

Call = tuple[str, Any]  # (name, arguments as a JSON-compatible object)


def _dumps(obj: Any, indent: int | None = None) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=indent)


def _unwrap(tool: dict) -> dict:
    return tool.get("function", {}) if tool.get("type") == "function" else tool


def _wrap(tool: dict) -> dict:
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


# ---- tools -> system prompt text ------------------------------------------------------------
def _default_tools(tools: list[dict]) -> str:
    tool_text, names = "", []
    for tool in map(_unwrap, tools):
        params = tool.get("parameters", {})
        param_text = ""
        for name, param in params.get("properties", {}).items():
            required = ", required" if name in params.get("required", []) else ""
            enum = ", should be one of [{}]".format(", ".join(param["enum"])) if param.get("enum") else ""
            items = (
                ", where each item should be {}".format(param["items"].get("type", ""))
                if param.get("items")
                else ""
            )
            param_text += f"  - {name} ({param.get('type', '')}{required}): {param.get('description', '')}{enum}{items}\n"
        tool_text += f"> Tool Name: {tool['name']}\nTool Description: {tool.get('description', '')}\nTool Args:\n{param_text}\n"
        names.append(tool["name"])
    return DEFAULT_TOOL_PROMPT.format(tool_text=tool_text, tool_names=", ".join(names))


def _glm4_tools(tools: list[dict]) -> str:
    tool_text = ""
    for tool in map(_unwrap, tools):
        tool_text += f"\n\n## {tool['name']}\n\n{_dumps(tool, indent=4)}\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
    return GLM4_TOOL_PROMPT.format(tool_text=tool_text)


def _llama3_tools(tools: list[dict]) -> str:
    tool_text = "".join(_dumps(_wrap(t), indent=4) + "\n\n" for t in tools)
    return LLAMA3_TOOL_PROMPT.format(date=LLAMA3_DATE, tool_text=tool_text)


def _mistral_tools(tools: list[dict]) -> str:
    return "[AVAILABLE_TOOLS] " + _dumps([_wrap(t) for t in tools]) + "[/AVAILABLE_TOOLS]"


def _qwen_tools(tools: list[dict]) -> str:
    return QWEN_TOOL_PROMPT.format(tool_text="".join("\n" + _dumps(_wrap(t)) for t in tools))


# ---- function calls -> assistant text -------------------------------------------------------
def _default_calls(calls: list[Call]) -> str:
    return "\n".join(f"Action: {name}\nAction Input: {_dumps(args)}" for name, args in calls)


def _glm4_calls(calls: list[Call]) -> str:
    if len(calls) > 1:
        raise ValueError("tool_format glm4: GLM-4 does not support parallel function calls")
    return f"{calls[0][0]}\n{_dumps(calls[0][1])}"


def _llama3_calls(calls: list[Call]) -> str:
    objs = [{"name": name, "parameters": args} for name, args in calls]
    return _dumps(objs[0] if len(objs) == 1 else objs)


def _mistral_calls(calls: list[Call]) -> str:
    return _dumps([{"name": name, "arguments": args} for name, args in calls])


def _qwen_calls(calls: list[Call]) -> str:
    return "\n".join(
        f"<tool_call>\n{_dumps({'name': name, 'arguments': args})}\n</tool_call>" for name, args in calls
    )


TOOL_FORMATS: dict[str, tuple[Callable[[list[dict]], str], Callable[[list[Call]], str]]] = {
    "default": (_default_tools, _default_calls),
    "glm4": (_glm4_tools, _glm4_calls),
    "llama3": (_llama3_tools, _llama3_calls),
    "mistral": (_mistral_tools, _mistral_calls),
    "qwen": (_qwen_tools, _qwen_calls),
}


def format_tools(tool_format: str, tools: str) -> str:
    """The system-prompt text for a JSON list of tool schemas ('' for an empty list)."""
    try:
        parsed = json.loads(tools)
    except json.JSONDecodeError as err:
        raise ValueError(f"tools: not valid JSON ({err}): {tools[:80]!r}") from None
    if not isinstance(parsed, list):
        raise ValueError(f"tools: expected a JSON list of function schemas, got {type(parsed).__name__}")
    return TOOL_FORMATS[tool_format][0](parsed) if parsed else ""


def format_calls(tool_format: str, content: str) -> str:
    """The assistant text for a `function` message (a JSON call or a JSON list of calls)."""
    try:
        parsed = json.loads(content)
    except json.JSONDecodeError as err:
        raise ValueError(f"function message: not valid JSON ({err}): {content[:80]!r}") from None
    parsed = parsed if isinstance(parsed, list) else [parsed]
    try:
        calls = [(c["name"], c["arguments"]) for c in parsed]
    except (KeyError, TypeError):
        raise ValueError(
            f'function message: each call needs "name" and "arguments", got {content[:80]!r}'
        ) from None
    return TOOL_FORMATS[tool_format][1](calls)
