"""`get_template`: the template a run uses, a built-in one by name or the tokenizer's own.

It sits above `builtin.py` (built-in templates) and `jinja.py` (the tokenizer's chat template), so
neither of the two imports the other's caller.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from lmstack.config.errors import ConfigError, enum_error
from lmstack.templates.builtin import builtin_template
from lmstack.templates.jinja import TokenizerTemplate, template_from_tokenizer
from lmstack.templates.reasoning import STYLES
from lmstack.templates.template import Template
from lmstack.templates.tools import TOOL_FORMATS

logger = logging.getLogger(__name__)


def get_template(
    name: str | None,
    tokenizer: Any = None,
    *,
    thinking_style: str = "llamafactory",
    tool_format: str | None = None,
    escape_content: bool = False,
) -> Template | TokenizerTemplate:
    """A built-in template by name; with `name=None`, one derived from the tokenizer's own chat
    template (`empty` when it has none). `thinking_style` picks the reasoning rules of reasoning
    templates (THINKING.md); `tool_format` is LLaMA-Factory's override of the template's tool format."""
    if thinking_style not in STYLES:
        raise enum_error("thinking_style", thinking_style, STYLES)
    if tool_format is not None and tool_format not in TOOL_FORMATS:
        raise enum_error("tool_format", tool_format, sorted(TOOL_FORMATS))
    if name is None and escape_content:
        raise ConfigError(
            "escape_special_tokens_in_content: needs template: <name> (a built-in template, whose markup "
            "and message text lmstack tokenizes apart); the tokenizer's own chat template renders them "
            "as one text"
        )
    if name is None:
        if tokenizer is None:
            raise ConfigError(
                "template: unset and no tokenizer to take a chat template from; set template: <name>"
            )
        template = template_from_tokenizer(tokenizer)
        if isinstance(template, TokenizerTemplate):
            if tool_format is not None:
                raise ConfigError(
                    "tool_format: only applies to a built-in template; set template: <name> "
                    "(the tokenizer's own chat template writes its own tool format)"
                )
            if thinking_style != "llamafactory":
                logger.warning("thinking_style has no effect: the tokenizer's own chat template decides")
            return template
    else:
        template = builtin_template(name)
    if thinking_style != "llamafactory" and not template.reasoning:
        logger.warning("thinking_style has no effect: template %s is not a reasoning template", template.name)
    template = replace(template, thinking_style=thinking_style, escape_content=escape_content)
    if escape_content:
        logger.info(
            "escape_special_tokens_in_content: special-token text in user and tool-result messages is "
            "tokenized as plain text (template %s's own markup is not)",
            template.name,
        )
    return template.with_tool_format(tool_format) if tool_format is not None else template
