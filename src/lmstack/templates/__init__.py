"""Chat templates: render a conversation to token ids and a loss mask.

Public API: `get_template(name, tokenizer=None)`, `template_from_tokenizer(tokenizer)`,
`list_templates()`, `Template`. Thinking knobs: see THINKING.md in this folder.
"""

from lmstack.templates.jinja import TokenizerTemplate, template_from_tokenizer
from lmstack.templates.lookup import get_template
from lmstack.templates.template import Template, list_templates

__all__ = ["Template", "TokenizerTemplate", "get_template", "list_templates", "template_from_tokenizer"]
