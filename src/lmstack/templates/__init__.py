"""Chat templates: render a conversation to token ids and a loss mask.

Public API: `get_template(name, tokenizer=None, *, thinking_style=..., tool_format=None)`,
`template_from_tokenizer(tokenizer)`, `list_templates()`, `Template`. Thinking knobs: THINKING.md.
"""

from lmstack.templates.builtin import list_templates
from lmstack.templates.jinja import TokenizerTemplate, template_from_tokenizer
from lmstack.templates.lookup import get_template
from lmstack.templates.template import Template

__all__ = ["Template", "TokenizerTemplate", "get_template", "list_templates", "template_from_tokenizer"]
