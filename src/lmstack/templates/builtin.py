"""The built-in templates: one YAML file per template in `builtin/` (`<name>.yaml`), LLaMA-Factory's
template names. A file is read and checked when its template is asked for.

YAML keys (all but `name` optional; slots are a string or a list of strings, see `slots.py`):

    format_prefix, format_system, format_user, format_assistant,
    format_observation (default: format_user), format_function (default: format_assistant),
    format_tools       the tools JSON is written into this slot as it is (default: the tool prompt
                       of `tool_format`)
    tool_format        how tools and calls are written (`tools.TOOL_FORMATS`)
    default_system, stop_words, efficient_eos, replace_eos, system_in_user
    reasoning, thought_words, empty_thought, tool_call_words
    description

An unset `format_assistant` is LLaMA-Factory's default: `{{content}}{{eos_token}}` (`{{content}}`
for efficient-EOS templates).
"""

from __future__ import annotations

from dataclasses import fields
from functools import cache
from importlib import resources

import yaml

from lmstack.config.errors import ConfigError, did_you_mean
from lmstack.templates.slots import has_content, parse_slot
from lmstack.templates.template import Template
from lmstack.templates.tools import TOOL_FORMATS

SLOT_KEYS = (
    "format_prefix",
    "format_system",
    "format_user",
    "format_assistant",
    "format_observation",
    "format_function",
    "format_tools",
)
PAIR_KEYS = ("thought_words", "tool_call_words")
NOT_IN_YAML = {"thinking_style"}  # set from the config by get_template
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader when built, else the pure one


def _folder():
    return resources.files("lmstack.templates").joinpath("builtin")


@cache
def list_templates() -> list[str]:
    return sorted(e.name[: -len(".yaml")] for e in _folder().iterdir() if e.name.endswith(".yaml"))


def _check_slots(name: str, data: dict) -> None:
    for key in SLOT_KEYS:
        if data.get(key) is None:
            continue
        data[key] = slot = parse_slot(data[key], f"template {name!r}: {key}")
        if key == "format_prefix" and has_content(slot):
            raise ValueError(f"template {name!r}: format_prefix cannot hold {{{{content}}}}")
        if key != "format_prefix" and not has_content(slot):
            raise ValueError(f"template {name!r}: {key} needs a {{{{content}}}} placeholder")


def from_data(data: dict) -> Template:
    """A Template from one YAML mapping; errors name the template and the key."""
    data = dict(data)
    name = data.get("name")
    unknown = set(data) - ({f.name for f in fields(Template)} - NOT_IN_YAML)
    if unknown:
        raise ValueError(f"template {name!r}: unknown keys {sorted(unknown)}")
    if data.get("tool_format", "default") not in TOOL_FORMATS:
        raise ValueError(
            f"template {name!r}: tool_format {data['tool_format']!r} not in {sorted(TOOL_FORMATS)}"
        )
    if "format_assistant" not in data:  # LLaMA-Factory's default assistant slot
        data["format_assistant"] = "{{content}}" if data.get("efficient_eos") else "{{content}}{{eos_token}}"
    _check_slots(name, data)
    if data.get("system_in_user") and len(data.get("format_system", ("",))) != 1:
        raise ValueError(f"template {name!r}: system_in_user needs a one-string format_system")
    for key in PAIR_KEYS:
        if key in data:
            if len(data[key]) != 2:
                raise ValueError(f"template {name!r}: {key} needs two strings (open, close)")
            data[key] = tuple(data[key])
    data["stop_words"] = tuple(data.get("stop_words", ()))
    if data.get("replace_eos") and not data["stop_words"]:
        raise ValueError(f"template {name!r}: replace_eos needs stop_words (the first becomes EOS)")
    return Template(**data)


@cache
def _load(name: str) -> Template:
    data = yaml.load(_folder().joinpath(f"{name}.yaml").read_text(encoding="utf-8"), Loader=_SafeLoader)
    if data.get("name") != name:
        raise ValueError(f"builtin/{name}.yaml: name must be {name!r}, got {data.get('name')!r}")
    return from_data(data)


def builtin_template(name: str) -> Template:
    """A built-in template by name (the YAML files in `builtin/`)."""
    known = list_templates()
    if name not in known:
        raise ConfigError(
            f"template: got {name!r}; known templates: {', '.join(known)}{did_you_mean(name, known)}"
        )
    return _load(name)
