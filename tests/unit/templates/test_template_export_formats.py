"""The Jinja chat template written by `lmstack export` renders exactly `Template.render`, for every
built-in template (and both thinking styles of the reasoning ones); the Ollama Modelfile carries the
template's format and stop words."""

from __future__ import annotations

import jinja2
import pytest

from lmstack.templates import get_template, list_templates
from lmstack.templates.export_formats import ollama_modelfile, to_jinja
from lmstack.tiny import build_tokenizer

CORPUS = ["Hello, how can I help you today?", "Weather in Paris? 你好 <think>\n4\n</think>\n\n"] * 4
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": 'Weather in "Paris"? 你好 😀 {{ x }} {% raw %}\n'},
    {"role": "assistant", "content": "<think>\nIt is sunny.\n</think>\n\nSunny."},
]
TOOL_TURN = [
    *CHAT[:2],
    {"role": "observation", "content": '{"temp": 22}'},
    {"role": "assistant", "content": "Warm."},
]
CONVERSATIONS = [CHAT, CHAT[:3], CHAT[:1], TOOL_TURN]


def tokenizer_for(name: str, bos: bool, style: str = "llamafactory"):
    tok = build_tokenizer(CORPUS, vocab_size=400)
    if bos:
        tok.add_special_tokens({"bos_token": "<s>"})
    template = get_template(name, thinking_style=style)
    template.fix_tokenizer(tok)
    tok.chat_template = to_jinja(template)
    return tok, template


def hf(messages: list[dict], system: str | None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + [{**m, "role": "tool" if m["role"] == "observation" else m["role"]} for m in messages]


REASONING = [n for n in list_templates() if get_template(n).reasoning]


@pytest.mark.parametrize(
    ("name", "bos", "style"),
    [(n, b, "llamafactory") for n in list_templates() for b in (False, True)]
    + [(n, False, "inference") for n in REASONING],
)
def test_jinja_renders_what_the_template_renders(name, bos, style):
    tok, template = tokenizer_for(name, bos, style)
    thinking = [True, False, None] if template.reasoning else [True]
    for conv in CONVERSATIONS:
        for system in (None, "Be brief.", ""):
            for enable in thinking:
                for preserve in (False, True) if template.reasoning else (False,):
                    kw = {"enable_thinking": enable, "preserve_thinking": preserve}
                    got = tok.apply_chat_template(
                        hf(conv, system), tokenize=False, add_generation_prompt=len(conv) % 2 == 1, **kw
                    )
                    want = template.render(
                        conv, system, tok, enable_thinking=enable, preserve_thinking=preserve
                    )
                    assert got == want, (conv, system, enable, preserve)


def test_reasoning_defaults_match_when_no_kwargs_are_passed():
    tok, template = tokenizer_for("qwen3", bos=False)
    for conv in CONVERSATIONS:
        assert tok.apply_chat_template(hf(conv, None), tokenize=False) == template.render(conv, None, tok)
    text = tok.apply_chat_template(hf(CHAT[:1], None), tokenize=False, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tools_are_refused_not_dropped():
    tok, _ = tokenizer_for("qwen", bos=False)
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    with pytest.raises(jinja2.TemplateError, match="does not render tools"):
        tok.apply_chat_template(hf(CHAT[:1], None), tools=tools, tokenize=False)


def test_ollama_modelfile_has_the_format_system_and_stop_words():
    tok, template = tokenizer_for("llama3", bos=True)
    modelfile = ollama_modelfile(template, tok, template.stop_token_ids(tok))
    assert modelfile.splitlines()[1] == "FROM ."
    assert 'PARAMETER stop "<|eot_id|>"' in modelfile and 'PARAMETER stop "<|eom_id|>"' in modelfile
    assert "<s>{{ range $i, $m := .Messages }}" in modelfile  # the bos prefix, spelled out
    assert "<|start_header_id|>user<|end_header_id|>\n\n{{ $m.Content }}<|eot_id|>" in modelfile

    tok, template = tokenizer_for("llama2", bos=False)  # system text inside the first user turn
    modelfile = ollama_modelfile(template, tok, template.stop_token_ids(tok))
    assert (
        "[INST] {{ if and (eq $i 0) $.System }}<<SYS>>\n{{ $.System }}\n<</SYS>>\n\n{{ end }}{{ $m.Content }}"
        in modelfile
    )

    tok, template = tokenizer_for("qwen", bos=False)
    assert 'SYSTEM """You are Qwen' in ollama_modelfile(template, tok, template.stop_token_ids(tok))
