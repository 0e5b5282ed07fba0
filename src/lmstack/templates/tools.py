"""Tool formats: how a `tools` list is written into the system prompt and how a function call is
written into the assistant turn. Same texts as LLaMA-Factory 0.9.5 `data/tool_utils.py`, one entry per
LF `tool_format` name (`TOOL_FORMATS`); the prompt texts live in `tool_prompts.py`.

`tools` is a JSON string of a list of function schemas (`{"name", "description", "parameters"}`,
optionally wrapped as `{"type": "function", "function": {...}}`). A `function` message's content is
a JSON string of one call `{"name": ..., "arguments": {...}}` or of a list of them.

As in LLaMA-Factory, the llama3 prompt's "Today Date" is the current date, and every format's tool
text is appended to the system text (a tools-only system prompt keeps the format's leading newlines).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from lmstack.templates import tool_prompts as P
from lmstack.templates.tools_gemma4 import gemma4_calls, gemma4_tools

Call = tuple[str, Any]  # (name, arguments as a JSON-compatible object)


def _dumps(obj: Any, indent: int | None = None) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=indent)


def _unwrap(tool: dict) -> dict:
    return tool.get("function", "") if tool.get("type") == "function" else tool


def _wrap(tool: dict) -> dict:
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _value(value: Any) -> str:
    """An argument value inside an XML-style call: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else _dumps(value)


def today() -> str:
    """The llama3 tool prompt's date (LLaMA-Factory writes the day the data is encoded)."""
    return datetime.now().strftime("%d %b %Y")


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
    return P.DEFAULT.format(tool_text=tool_text, tool_names=", ".join(names))


def _glm4_tools(tools: list[dict]) -> str:
    tool_text = ""
    for tool in map(_unwrap, tools):
        tool_text += f"\n\n## {tool['name']}\n\n{_dumps(tool, indent=4)}\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
    return P.GLM4.format(tool_text=tool_text)


def _jsonl(tools: list[dict], wrap: bool) -> str:
    return "".join("\n" + _dumps(_wrap(t) if wrap else _unwrap_keep(t)) for t in tools)


def _unwrap_keep(tool: dict) -> dict:
    return tool.get("function", tool) if tool.get("type") == "function" else tool


def _llama3_tools(tools: list[dict]) -> str:
    tool_text = "".join(_dumps(_wrap(t), indent=4) + "\n\n" for t in tools)
    return P.LLAMA3.format(date=today(), tool_text=tool_text)


def _minimax1_tools(tools: list[dict]) -> str:
    return P.MINIMAX1.format(tool_text="".join(_dumps(_unwrap(t)) + "\n" for t in tools))


def _minimax2_tools(tools: list[dict]) -> str:
    return P.MINIMAX2.format(tool_text="".join("<tool>" + _dumps(_unwrap(t)) + "</tool>\n" for t in tools))


def _mistral_tools(tools: list[dict]) -> str:
    return "[AVAILABLE_TOOLS] " + _dumps([_wrap(t) for t in tools]) + "[/AVAILABLE_TOOLS]"


def _lfm2_tools(tools: list[dict]) -> str:
    return P.LFM2.format(tool_text=_dumps([_unwrap_keep(t) for t in tools]))


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


def _minimax1_calls(calls: list[Call]) -> str:
    lines = [_dumps({"name": name, "arguments": args}) for name, args in calls]
    return "<tool_calls>\n" + "\n".join(lines) + "\n</tool_calls>"


def _minimax2_calls(calls: list[Call]) -> str:
    blocks = []
    for name, args in calls:
        params = "".join(f'\n<parameter name="{k}">{_value(v)}</parameter>' for k, v in args.items())
        blocks.append(f'<invoke name="{name}">{params}\n</invoke>')
    return "\n".join(blocks)


def _mistral_calls(calls: list[Call]) -> str:
    return _dumps([{"name": name, "arguments": args} for name, args in calls])


def _qwen_calls(calls: list[Call]) -> str:
    return "\n".join(
        f"<tool_call>\n{_dumps({'name': name, 'arguments': args})}\n</tool_call>" for name, args in calls
    )


def _qwen3_5_calls(calls: list[Call]) -> str:
    blocks = []
    for name, args in calls:
        params = "".join(f"\n<parameter={k}>\n{_value(v)}\n</parameter>" for k, v in args.items())
        blocks.append(f"<tool_call>\n<function={name}>{params}\n</function>\n</tool_call>")
    return "\n".join(blocks)


def _glm4_moe_calls(calls: list[Call]) -> str:
    blocks = []
    for name, args in calls:
        kv = "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{_value(v)}</arg_value>" for k, v in args.items())
        blocks.append(f"\n<tool_call>{name}{kv}")
    return "\n".join(blocks)


def _seed_calls(calls: list[Call]) -> str:
    blocks = []
    for name, args in calls:
        params = "".join(f"\n<parameter={k}>{_value(v)}</parameter>" for k, v in args.items())
        blocks.append(f"\n<seed:tool_call>\n<function={name}{params}\n</function>\n</seed:tool_call>")
    return "\n".join(blocks)


def _lfm2_calls(calls: list[Call]) -> str:
    texts = []
    for name, args in calls:
        kwargs = [f'{k}="{v}"' if isinstance(v, str) else f"{k}={_dumps(v)}" for k, v in args.items()]
        texts.append(f"{name}({', '.join(kwargs)})")
    return f"<|tool_call_start|>[{', '.join(texts)}]<|tool_call_end|>"


TOOL_FORMATS: dict[str, tuple[Callable[[list[dict]], str], Callable[[list[Call]], str]]] = {
    "default": (_default_tools, _default_calls),
    "gemma4": (gemma4_tools, gemma4_calls),
    "glm4": (_glm4_tools, _glm4_calls),
    "glm4_moe": (lambda t: P.GLM4_MOE.format(tool_text=_jsonl(t, wrap=True)), _glm4_moe_calls),
    "lfm2": (_lfm2_tools, _lfm2_calls),
    "ling": (
        lambda t: P.LING.format(tool_text=_jsonl(t, wrap=True)) + "\ndetailed thinking off",
        _qwen_calls,
    ),
    "llama3": (_llama3_tools, _llama3_calls),
    "minimax1": (_minimax1_tools, _minimax1_calls),
    "minimax2": (_minimax2_tools, _minimax2_calls),
    "mistral": (_mistral_tools, _mistral_calls),
    "qwen": (lambda t: P.QWEN.format(tool_text=_jsonl(t, wrap=True)), _qwen_calls),
    "qwen3_5": (lambda t: P.QWEN3_5.format(tool_text=_jsonl(t, wrap=False)), _qwen3_5_calls),
    "seed_oss": (lambda t: P.SEED.format(tool_text="\n" + _dumps(t)), _seed_calls),
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


def parse_calls(content: str) -> list[Call]:
    """The calls of a `function` message (a JSON call or a JSON list of calls)."""
    try:
        parsed = json.loads(content)
    except json.JSONDecodeError as err:
        raise ValueError(f"function message: not valid JSON ({err}): {content[:80]!r}") from None
    parsed = parsed if isinstance(parsed, list) else [parsed]
    try:
        return [(c["name"], c["arguments"]) for c in parsed]
    except (KeyError, TypeError):
        raise ValueError(
            f'function message: each call needs "name" and "arguments", got {content[:80]!r}'
        ) from None


def format_calls(tool_format: str, calls: list[Call]) -> str:
    """The assistant text for a list of calls."""
    return TOOL_FORMATS[tool_format][1](calls)
