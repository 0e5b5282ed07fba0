"""A fixed conversation used by every template test (imported by the test modules)."""

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
