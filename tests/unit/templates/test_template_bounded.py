"""A tokenizer's chat template is code from the model folder: a render that runs past the work
budget, or that Jinja's sandbox refuses, is a plain ConfigError naming the template and the fix,
not a hang or a traceback; an ordinary render is unchanged and leaves no tracer behind."""

from __future__ import annotations

import sys

import pytest
from _template_cases import CHAT

from lmstack.config.errors import ConfigError
from lmstack.templates import get_template
from lmstack.templates.bounded import MAX_TEMPLATE_LINES
from lmstack.tiny import build_tokenizer

MESSAGES = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _tok(chat_template: str):
    tok = build_tokenizer(["Hi there"] * 4, vocab_size=300)
    tok.chat_template = chat_template
    return tok


@pytest.mark.parametrize(
    "loops",
    [
        # finite, so without a bound the test fails instead of hanging: 3000 x 1000 > the budget
        "{% for i in range(3000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
        "{% for i in range(3000) %}{% for m in range(1000) %}{{ '' }}{% endfor %}{% endfor %}",
    ],
)
def test_a_render_past_the_work_budget_is_refused(loops):
    assert 3000 * 1000 > MAX_TEMPLATE_LINES
    tok = _tok(loops + MESSAGES)
    with pytest.raises(
        ConfigError, match=f"template: .* ran past {MAX_TEMPLATE_LINES} lines of template code.*set template:"
    ):
        get_template(None, tok).encode_multiturn(tok, CHAT)
    assert sys.gettrace() is None


def test_a_render_the_sandbox_refuses_is_a_plain_error():
    tok = _tok("{{ messages.__class__.__mro__ }}" + MESSAGES)
    with pytest.raises(
        ConfigError, match="template: .* was refused by Jinja's sandbox .*__class__.*set template:"
    ):
        get_template(None, tok).encode_multiturn(tok, CHAT)


def test_an_ordinary_render_is_unchanged_and_a_previous_tracer_is_restored():
    tok = _tok(MESSAGES)
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)

    sys.settrace(tracer)
    try:
        text = get_template(None, tok).render(CHAT, None, tok)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert text == tok.apply_chat_template(CHAT, tokenize=False)


@pytest.mark.parametrize(
    "bomb",
    [
        "{{ 'x' * 10**9 }}",
        "{{ [1] * 10**9 }}",
        "{{ 'x'.ljust(10**10) }}",
        "{{ 'x'|center(10**10) }}",
        "{{ '%*s' % (10**10, 'x') }}",
        "{{ '{:>10000000000}'.format('x') }}",
        "{{ range(100000)|list|tojson(indent=100000) }}",
        "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
        # a namespace carries a value across iterations, so each line doubles it
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s.replace('a', 'aa') %}{% endfor %}",
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
    ],
)
def test_a_render_that_would_build_a_huge_value_is_refused_before_it_allocates(bomb):
    """Each bomb takes a few lines of template code (far under the line budget) but one of them
    allocates gigabytes or more: it is refused before that operation runs."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(
        resource.RLIMIT_AS, (8 << 30, hard)
    )  # a missed bomb fails with MemoryError, not an OOM kill
    try:
        tok = _tok(bomb + MESSAGES)
        with pytest.raises(ConfigError, match="template: .* would build a value too large.*set template:"):
            get_template(None, tok).encode_multiturn(tok, CHAT)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
