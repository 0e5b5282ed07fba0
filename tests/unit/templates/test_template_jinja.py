"""`template` unset: the tokenizer's own Jinja chat template drives encoding."""

from __future__ import annotations

import logging

import pytest
from _template_cases import CHAT, SYSTEM

from lmstack.config.errors import ConfigError
from lmstack.templates import Template, TokenizerTemplate, get_template, template_from_tokenizer
from lmstack.tiny import build_tokenizer


def test_tiny_chatml_round_trips_to_the_chatml_template(tok):
    jinja = get_template(None, tok)
    assert isinstance(jinja, TokenizerTemplate)
    chatml = get_template("chatml")
    # no system given: the chat template's own default system prompt
    assert jinja.encode_multiturn(tok, CHAT) == chatml.encode_multiturn(
        tok, CHAT, "You are a helpful assistant."
    )
    assert jinja.encode_multiturn(tok, CHAT, SYSTEM) == chatml.encode_multiturn(tok, CHAT, SYSTEM)
    assert jinja.encode_prompt(tok, CHAT[:3]) == chatml.encode_prompt(
        tok, CHAT[:3], "You are a helpful assistant."
    )
    assert jinja.render(CHAT, SYSTEM, tok) == chatml.render(CHAT, SYSTEM, tok)


def test_observation_maps_to_the_tool_role(tok):
    conv = [
        *CHAT[:2],
        {"role": "observation", "content": "22 degrees"},
        {"role": "assistant", "content": "Warm."},
    ]
    assert get_template(None, tok).encode_multiturn(tok, conv, SYSTEM) == get_template(
        "chatml"
    ).encode_multiturn(tok, conv, SYSTEM)


def test_no_chat_template_falls_back_to_empty_with_a_log(caplog):
    tok = build_tokenizer(["Hi there"] * 4, vocab_size=300)
    tok.chat_template = None
    with caplog.at_level(logging.WARNING, logger="lmstack.templates.jinja"):
        template = template_from_tokenizer(tok)
    assert isinstance(template, Template) and template.name == "empty"
    assert "no chat template" in caplog.text


def test_unset_template_without_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="template: unset"):
        get_template(None)


def test_chat_template_that_rewrites_history_is_refused():
    tok = build_tokenizer(["Hi there"] * 4, vocab_size=300)
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}.{% endif %}{% endfor %}"
    )
    with pytest.raises(ConfigError, match="changes earlier text"):
        get_template(None, tok).encode_multiturn(tok, CHAT)


def test_enable_thinking_reaches_the_chat_template():
    tok = build_tokenizer(["Hi there"] * 4, vocab_size=300)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    jinja = get_template(None, tok)
    assert tok.decode(jinja.encode_prompt(tok, CHAT[:1], enable_thinking=False)).endswith(
        "assistant: <think></think>"
    )
    assert tok.decode(jinja.encode_prompt(tok, CHAT[:1])).endswith("assistant: ")
