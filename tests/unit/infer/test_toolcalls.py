"""Tool calls read back from a reply in each template tool format that `lmstack api` parses: the
inverse of `templates/tools.py::format_calls` (which writes them for training and prompts)."""

from __future__ import annotations

import json

import pytest

from lmstack.infer.toolcalls import FORCEABLE, PARSEABLE, forced_call_text, parse_tool_calls
from lmstack.templates.tools import format_calls

CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("fmt", PARSEABLE)
def test_formatted_calls_parse_back(fmt):
    calls = CALLS[:1] if fmt == "glm4" else CALLS  # GLM-4 has no parallel calls
    text = format_calls(fmt, calls)
    content, parsed = parse_tool_calls(fmt, text)
    assert parsed == calls and content == ""


@pytest.mark.parametrize("fmt", ["qwen", "default", "mistral", "llama3"])
def test_text_before_a_call_is_the_content_and_plain_text_has_no_calls(fmt):
    content, parsed = parse_tool_calls(fmt, "Let me check.\n" + format_calls(fmt, CALLS[:1]))
    assert (content, parsed) == ("Let me check.", CALLS[:1])
    assert parse_tool_calls(fmt, "It is sunny in Paris.") == ("It is sunny in Paris.", [])


def test_a_broken_call_is_left_as_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    assert parse_tool_calls("qwen", text) == (text, [])


@pytest.mark.parametrize("fmt", FORCEABLE)
def test_a_forced_call_is_its_prefix_the_arguments_and_its_suffix(fmt):
    prefix, suffix = forced_call_text(fmt, "get_weather")
    args = {"city": "Paris"}
    assert prefix + json.dumps(args) + suffix == format_calls(fmt, [("get_weather", args)])
    assert parse_tool_calls(fmt, prefix + json.dumps(args) + suffix)[1] == [("get_weather", args)]
