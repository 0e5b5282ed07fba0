"""Gemma 4's tool format (tool_format `gemma4`): declarations and calls in Gemma 4's own key:value
syntax, where `<|"|>` quotes a string. Same text as LLaMA-Factory 0.9.5's gemma4 tool format."""

from __future__ import annotations

from typing import Any

Q = '<|"|>'  # Gemma 4's string quote


def _quoted(text: Any) -> str:
    return f"{Q}{text}{Q}"


def _properties(properties: dict) -> str:
    parts = []
    for name, schema in properties.items():
        items = []
        if schema.get("description"):
            items.append(f"description:{_quoted(schema['description'])}")
        if schema.get("type"):
            items.append(f"type:{_quoted(str(schema['type']).upper())}")
        parts.append(f"{name}:{{{','.join(items)}}}")
    return ",".join(parts)


def _declaration(tool: dict) -> str:
    fn = tool.get("function", tool) if tool.get("type") == "function" else tool
    text = f"declaration:{fn['name']}{{description:{_quoted(fn.get('description', ''))}"
    params = fn.get("parameters")
    if params:
        parts = []
        if params.get("properties"):
            parts.append(f"properties:{{{_properties(params['properties'])}}}")
        if params.get("required"):
            parts.append("required:[" + ",".join(_quoted(r) for r in params["required"]) + "]")
        if params.get("type"):
            parts.append(f"type:{_quoted(str(params['type']).upper())}")
        text += f",parameters:{{{','.join(parts)}}}"
    response = fn.get("response")
    if response:
        parts = []
        if response.get("description"):
            parts.append(f"description:{_quoted(response['description'])}")
        kind = str(response.get("type", "")).upper()
        if kind == "OBJECT":
            parts.append(f"type:{_quoted(kind)}")
        text += f",response:{{{','.join(parts)}}}"
    return text + "}"


def gemma4_tools(tools: list[dict]) -> str:
    return "\n".join(_declaration(t) for t in tools)


def _argument(value: Any, quote_keys: bool) -> str:
    if isinstance(value, str):
        return _quoted(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        items = [
            f"{_quoted(k) if quote_keys else k}:{_argument(value[k], quote_keys)}" for k in sorted(value)
        ]
        return "{" + ",".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_argument(v, quote_keys) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


def gemma4_calls(calls: list[tuple[str, Any]]) -> str:
    texts = []
    for name, args in calls:
        if isinstance(args, dict):
            body = ",".join(f"{k}:{_argument(args[k], quote_keys=False)}" for k in sorted(args))
        elif isinstance(args, str):
            body = args
        else:
            body = _argument(args, quote_keys=False)
        texts.append(f"<|tool_call>call:{name}{{{body}}}<tool_call|>")
    return "".join(texts)
