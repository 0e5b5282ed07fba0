"""A built-in `Template` written out as a Jinja chat template (for `tokenizer.apply_chat_template`,
vLLM, TGI, ...) and as an Ollama Modelfile, so an exported model is prompted exactly as it was trained.

`tokenizer.apply_chat_template(messages)` renders the same text as `Template.render` (system message
first, or the template's default system prompt when it is absent or empty; `tool`/`observation`
results; the reasoning rules of the template's `thinking_style` with `enable_thinking` /
`preserve_thinking` passed as keyword arguments: a conversation that ends with an assistant turn is
rendered as it is trained, one that ends with a user turn as a generation prompt).
The user slot of every template already ends with the assistant opener, so `add_generation_prompt`
changes nothing: a conversation that ends with a user turn is always ready for generation.
Tool schemas and tool calls are not rendered: the generated template raises an error for them
instead of dropping them silently.
"""

from __future__ import annotations

import json
from typing import Any

from lmstack.templates.slots import CONTENT, Slot, split
from lmstack.templates.template import Template


def _literal(text: str) -> str:
    # JSON string syntax is valid Jinja string syntax (\n, \", \\ escapes; raw non-ASCII is kept).
    return json.dumps(text, ensure_ascii=False)


def _expr(slot: Slot, var: str = "content") -> str:
    """One Jinja expression for a slot: text literals, the `var` variable, bos/eos/named tokens."""
    parts: list[str] = []
    for kind, value in split(slot):
        if kind == "special":
            parts.append(f"({value} or '')")
            continue
        if kind == "token":
            parts.append(_literal(value))
            continue
        texts = value.split(CONTENT, 1)
        for k, text in enumerate(texts):
            if k:
                parts.append(var)
            if text:
                parts.append(_literal(text))
    return " ~ ".join(parts) if parts else "''"


def _empty_thought(template: Template) -> str:
    return template.empty_thought if template.empty_thought is not None else "".join(template.thought_words)


def _strip(template: Template) -> str:
    """Jinja that removes the thought of `content` (as `reasoning.Thoughts.remove` for one block)."""
    open_, close = template.thought_words
    return (
        f"{{%- if {_literal(open_)} in content and {_literal(close)} in content -%}}"
        f"{{%- set content = content.split({_literal(open_)})[0] ~ content.split({_literal(close)})[-1] -%}}"
        "{%- endif -%}"
        "{%- set content = content.lstrip('\\n') -%}"
    )


def _no_thought(template: Template) -> str:
    open_, close = template.thought_words
    return f"{_literal(open_.strip())} not in content and {_literal(close.strip())} not in content"


def _llamafactory_block(template: Template) -> str:
    """Jinja for `reasoning.llamafactory` on one assistant message: a conversation ending with an
    assistant turn is training text (multiturn), otherwise a generation prompt (oneturn). An empty
    thought is written before the assistant slot, where the encoder puts its pieces."""
    return (
        "{%- if ns.train -%}"
        "{%- if thinking is false -%}" + _strip(template) + "{%- endif -%}"
        f"{{%- if {_no_thought(template)} -%}}{{{{ {_literal(_empty_thought(template))} }}}}{{%- endif -%}}"
        "{%- elif not preserve -%}" + _strip(template) + "{%- endif -%}"
    )


def _inference_block(template: Template) -> str:
    """Jinja for `reasoning.inference` on one assistant message."""
    return (
        "{%- set history = loop.index0 < ns.last_query and not preserve -%}"
        "{%- if thinking is false or history -%}" + _strip(template) + "{%- endif -%}"
        f"{{%- if thinking is not none and not history and {_no_thought(template)} -%}}"
        f"{{{{ {_literal(_empty_thought(template))} }}}}{{%- endif -%}}"
    )


def _header(template: Template) -> list[str]:
    out = [
        "{%- if tools -%}{{ raise_exception('this chat template (lmstack "
        + template.name
        + ") does not render tools') }}{%- endif -%}",
        f"{{%- set system_message = {_literal(template.default_system)} -%}}",
        "{%- set loop_messages = messages -%}",
        "{%- if messages and messages[0]['role'] == 'system' -%}",
        "{%- set system_message = messages[0]['content'] or system_message -%}",
        "{%- set loop_messages = messages[1:] -%}",
        "{%- endif -%}",
    ]
    if template.reasoning:
        out += [
            "{%- set thinking = true if enable_thinking is not defined else enable_thinking -%}",
            "{%- set preserve = preserve_thinking is defined and preserve_thinking -%}",
            "{%- set ns = namespace(last_query=-1, train=loop_messages and "
            "loop_messages[-1]['role'] == 'assistant') -%}",
            "{%- for m in loop_messages -%}{%- if m['role'] == 'user' -%}"
            "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}",
        ]
    return out


def to_jinja(template: Template) -> str:
    """The template as a Jinja chat template string."""
    system = template.format_system
    observation = template.format_observation or template.format_user
    lf = template.thinking_style == "llamafactory"
    out = _header(template) + [
        "{%- for message in loop_messages -%}",
        "{%- set content = message['content'] -%}",
        "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}{{ raise_exception("
        "'this chat template (lmstack " + template.name + ") does not render tool calls') }}{%- endif -%}",
        "{%- if loop.first -%}",
        f"{{{{ {_expr(template.format_prefix)} }}}}",
        "{%- if system_message -%}",
        "{%- if message['role'] == 'user' -%}"
        f"{{%- set content = {_expr(system, 'system_message')} ~ content -%}}{{%- endif -%}}"
        if template.system_in_user
        else f"{{{{ {_expr(system, 'system_message')} }}}}",
        "{%- endif -%}",
        "{%- endif -%}",
        "{%- if message['role'] == 'user' -%}",
        f"{{{{ {_expr(template.format_user)} }}}}",
        "{%- elif message['role'] in ('tool', 'observation') -%}",
        f"{{{{ {_expr(observation)} }}}}",
        "{%- elif message['role'] == 'assistant' -%}",
    ]
    if template.reasoning:
        out.append(_llamafactory_block(template) if lf else _inference_block(template))
    out += [f"{{{{ {_expr(template.format_assistant)} }}}}", "{%- endif -%}", "{%- endfor -%}"]
    if template.reasoning:  # the generation prompt's empty thought (LF: unless thinking; lmstack: if false)
        when = "not thinking" if lf else "thinking is false"
        out.append(
            f"{{%- if loop_messages and loop_messages[-1]['role'] != 'assistant' and {when} -%}}"
            f"{{{{ {_literal(_empty_thought(template))} }}}}{{%- endif -%}}"
        )
    return "".join(out)


# ---- Ollama ------------------------------------------------------------------------------------
def _go(slot: Slot, tokenizer: Any, content: str) -> str:
    """A slot as Go-template text: special tokens spelled out, `{{content}}` -> `content`."""
    return "".join(
        (getattr(tokenizer, value, None) or "") if kind == "special" else value.replace(CONTENT, content, 1)
        for kind, value in split(slot)
    )


def ollama_template(template: Template, tokenizer: Any) -> str:
    """Ollama's TEMPLATE (Go text/template over .System and .Messages)."""
    system = _go(template.format_system, tokenizer, "{{ $.System }}")
    system_part = "{{ if and (eq $i 0) $.System }}" + system + "{{ end }}"
    user = _go(template.format_user, tokenizer, "{{ $m.Content }}")
    observation = _go(template.format_observation or template.format_user, tokenizer, "{{ $m.Content }}")
    if template.system_in_user:  # the system text opens the first user turn
        head, _, tail = user.partition("{{ $m.Content }}")
        user = head + system_part + "{{ $m.Content }}" + tail
        system_part = ""
    return (
        _go(template.format_prefix, tokenizer, "")
        + "{{ range $i, $m := .Messages }}"
        + system_part
        + '{{ if eq $m.Role "user" }}'
        + user
        + '{{ else if eq $m.Role "tool" }}'
        + observation
        + '{{ else if eq $m.Role "assistant" }}'
        + _go(template.format_assistant, tokenizer, "{{ $m.Content }}")
        + "{{ end }}{{ end }}"
    )


def ollama_modelfile(template: Template, tokenizer: Any, stop_ids: list[int]) -> str:
    lines = [
        f"# Ollama Modelfile written by lmstack export (template: {template.name})",
        "FROM .",
        "",
        f'TEMPLATE """{ollama_template(template, tokenizer)}"""',
        "",
    ]
    if template.default_system:
        lines += [f'SYSTEM """{template.default_system}"""', ""]
    for token in dict.fromkeys(tokenizer.convert_ids_to_tokens(stop_ids)):
        lines.append(f"PARAMETER stop {json.dumps(token, ensure_ascii=False)}")
    lines.append("PARAMETER num_ctx 4096")
    return "\n".join(lines) + "\n"
