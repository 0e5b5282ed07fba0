"""Tool calls in a model's reply, read back in the template's tool format (the inverse of
`templates/tools.py::format_calls`), and the text a forced call (`tool_choice: {function}`) starts
with. Formats whose calls carry the arguments as one JSON object can be forced (`FORCEABLE`); the
XML-style ones can be parsed only; the rest are refused by name (`PARSEABLE`)."""

from __future__ import annotations

import json
import re
from typing import Any

from lmstack.templates.tools import format_calls

Call = tuple[str, Any]
_DECODER = json.JSONDecoder()


def _objects(text: str) -> list[tuple[int, int, Any]]:
    """Every top-level JSON object or array in `text`: (start, end, value)."""
    found, i = [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = _DECODER.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            found.append((i, end, value))
            i = end
        else:
            i += 1
    return found


def _as_calls(value: Any, args_key: str) -> list[Call] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and args_key in item):
            return None
        calls.append((item["name"], item[args_key]))
    return calls or None


def _tagged_json(text: str, open_: str, close: str) -> tuple[str, list[Call]]:
    pattern = re.compile(re.escape(open_) + r"\s*(.*?)\s*" + re.escape(close), re.DOTALL)
    calls: list[Call] = []
    for block in pattern.finditer(text):
        for line in block.group(1).splitlines() if open_ == "<tool_calls>" else [block.group(1)]:
            if not line.strip():
                continue
            try:
                parsed = _as_calls(json.loads(line), "arguments")
            except ValueError:
                parsed = None
            if parsed is None:
                return text, []
            calls += parsed
    return (pattern.sub("", text).strip(), calls) if calls else (text, [])


def _default(text: str) -> tuple[str, list[Call]]:
    pattern = re.compile(r"Action:\s*(.+?)\s*Action Input:\s*", re.DOTALL)
    calls, content = [], text
    first = None
    for match in pattern.finditer(text):
        try:
            args, _ = _DECODER.raw_decode(text, match.end())
        except ValueError:
            return text, []
        first = match.start() if first is None else first
        calls.append((match.group(1).strip(), args))
    if calls:
        content = text[:first].strip()
    return content, calls


def _json_calls(args_key: str, prefix: str = "") -> Any:
    def parse(text: str) -> tuple[str, list[Call]]:
        body = text.replace(prefix, "", 1) if prefix else text
        for start, end, value in _objects(body):
            calls = _as_calls(value, args_key)
            if calls:
                return (body[:start] + body[end:]).strip(), calls
        return text, []

    return parse


def _glm4(text: str) -> tuple[str, list[Call]]:
    match = re.match(r"\s*([\w.\-]+)\n", text)
    if match:
        try:
            args, end = _DECODER.raw_decode(text, match.end())
        except ValueError:
            return text, []
        if isinstance(args, dict):
            return text[end:].strip(), [(match.group(1), args)]
    return text, []


def _qwen3_5(text: str) -> tuple[str, list[Call]]:
    blocks = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    params = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
    calls: list[Call] = []
    for block in blocks.finditer(text):
        args = {}
        for p in params.finditer(block.group(2)):
            try:
                args[p.group(1)] = json.loads(p.group(2))
            except ValueError:
                args[p.group(1)] = p.group(2)
        calls.append((block.group(1).strip(), args))
    return (blocks.sub("", text).strip(), calls) if calls else (text, [])


PARSERS = {
    "default": _default,
    "qwen": lambda t: _tagged_json(t, "<tool_call>", "</tool_call>"),
    "ling": lambda t: _tagged_json(t, "<tool_call>", "</tool_call>"),
    "minimax1": lambda t: _tagged_json(t, "<tool_calls>", "</tool_calls>"),
    "llama3": _json_calls("parameters"),
    "mistral": _json_calls("arguments", "[TOOL_CALLS]"),
    "glm4": _glm4,
    "qwen3_5": _qwen3_5,
}
PARSEABLE = sorted(PARSERS)
FORCEABLE = ["default", "glm4", "ling", "llama3", "minimax1", "mistral", "qwen"]


def parse_tool_calls(tool_format: str, text: str) -> tuple[str, list[Call]]:
    """(the reply's text without the calls, the calls); no calls: (text, [])."""
    return PARSERS[tool_format](text)


def forced_call_text(tool_format: str, name: str) -> tuple[str, str]:
    """(text before the arguments object, text after it) of one call to `name`."""
    text = format_calls(tool_format, [(name, {})])
    at = text.rfind("{}")
    return text[:at], text[at + 2 :]
