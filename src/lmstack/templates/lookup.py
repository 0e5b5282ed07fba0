"""`get_template`: the template a run uses, a built-in one by name or the tokenizer's own.

It sits above `template.py` (built-in templates) and `jinja.py` (the tokenizer's chat template), so
neither of the two imports the other's caller.
"""

from __future__ import annotations

from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.templates.jinja import TokenizerTemplate, template_from_tokenizer
from lmstack.templates.template import Template, builtin_template


def get_template(name: str | None, tokenizer: Any = None) -> Template | TokenizerTemplate:
    """A built-in template by name; with `name=None`, one derived from the tokenizer's own chat
    template (`empty` when it has none)."""
    if name is not None:
        return builtin_template(name)
    if tokenizer is None:
        raise ConfigError(
            "template: unset and no tokenizer to take a chat template from; set template: <name>"
        )
    return template_from_tokenizer(tokenizer)
