"""`template` unset: use the tokenizer's own Jinja chat template.

The (source, target) split is derived by rendering prefixes of the conversation: for the assistant
turn at position k, the source is `render(messages[:k], add_generation_prompt=True)` minus the text
rendered for the turns before it, and the target is `render(messages[:k+1])` minus that. Each piece
is then tokenized on its own, like the built-in templates do. A chat template whose earlier text
changes when a later turn is added (e.g. Qwen3's, which drops old reasoning) cannot be split this way;
that is an error telling the user to set `template:` explicitly.

Roles map to the Hugging Face message schema: observation -> `tool`; a function message -> an
assistant message with `tool_calls`; `tools` (JSON string) -> the `tools=` argument. `system=None`
lets the chat template use its own default system prompt; any string (even '') is sent as a system
message. `enable_thinking`/`preserve_thinking` are passed to the chat template (Qwen3-style templates
read them); `enable_thinking=None` passes nothing. `mask_history` changes only the labels here (the
chat template decides which thoughts it shows).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.templates.bounded import bounded_render
from lmstack.templates.builtin import builtin_template
from lmstack.templates.template import Template, check_roles, fix_special_tokens

logger = logging.getLogger(__name__)


def template_from_tokenizer(tokenizer: Any) -> TokenizerTemplate | Template:
    """The tokenizer's chat template as a template object; `empty` (logged) when it has none."""
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        logger.info("template unset: using the tokenizer's own chat template")
        return TokenizerTemplate(
            name=f"{getattr(tokenizer, 'name_or_path', '') or 'tokenizer'} chat template"
        )
    logger.warning("template unset and the tokenizer has no chat template: using the 'empty' template")
    return builtin_template("empty")


def _hf_message(message: dict) -> dict:
    role = message["role"]
    if role == "observation":
        return {"role": "tool", "content": message["content"]}
    if role == "function":
        calls = json.loads(message["content"])
        calls = calls if isinstance(calls, list) else [calls]
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls
            ],
        }
    return {"role": role, "content": message["content"]}


@dataclass(frozen=True)
class TokenizerTemplate:
    """Same calls as `Template`, rendered through `tokenizer.apply_chat_template`."""

    name: str
    stop_words: tuple[str, ...] = ()
    efficient_eos: bool = False
    replace_eos: bool = False
    default_system: str = ""

    def _render(self, tokenizer: Any, messages: list[dict], system: str | None, gen: bool, **kw: Any) -> str:
        if not messages:
            return ""
        conv = ([{"role": "system", "content": system}] if system is not None else []) + [
            _hf_message(m) for m in messages
        ]
        with bounded_render(self.name):
            return tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kw)

    def render_pairs(
        self,
        messages: list[dict],
        system: str | None = None,
        tokenizer: Any = None,
        *,
        tools: str | None = None,
        enable_thinking: bool | None = True,
        preserve_thinking: bool = False,
        mask_history: bool = False,
    ) -> list[tuple[str, str]]:
        check_roles(messages)
        if tokenizer is None:
            raise ValueError(f"{self.name}: rendering needs the tokenizer")
        kw: dict[str, Any] = {"preserve_thinking": preserve_thinking}
        if tools:
            kw["tools"] = json.loads(tools)
        if enable_thinking is not None:
            kw["enable_thinking"] = enable_thinking
        pairs, done = [], ""
        for k in range(0, len(messages), 2):
            prompt = self._render(tokenizer, messages[: k + 1], system, True, **kw)
            full = (
                self._render(tokenizer, messages[: k + 2], system, False, **kw)
                if k + 1 < len(messages)
                else prompt
            )
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise ConfigError(
                    "template: unset, and the tokenizer's chat template changes earlier text when a turn is "
                    f"added (message {k}), so the loss mask cannot be derived from it; set template: <name> "
                    "(see lmstack.templates.list_templates())"
                )
            pairs.append((prompt[len(done) :], full[len(prompt) :]))
            done = full
        return pairs

    def render(
        self, messages: list[dict], system: str | None = None, tokenizer: Any = None, **kw: Any
    ) -> str:
        return "".join(s + t for s, t in self.render_pairs(messages, system, tokenizer, **kw))

    def encode_multiturn(
        self, tokenizer: Any, messages: list[dict], system: str | None = None, **kw: Any
    ) -> list[tuple[list[int], list[int]]]:
        if len(messages) % 2 != 0 or not messages:
            raise ValueError("encode_multiturn needs a conversation that ends with an assistant turn")
        return [
            (_enc(tokenizer, s), _enc(tokenizer, t))
            for s, t in self.render_pairs(messages, system, tokenizer, **kw)
        ]

    def encode_oneturn(
        self, tokenizer: Any, messages: list[dict], system: str | None = None, **kw: Any
    ) -> tuple[list[int], list[int]]:
        pairs = self.encode_multiturn(tokenizer, messages, system, **kw)
        return [i for s, t in pairs[:-1] for i in s + t] + pairs[-1][0], pairs[-1][1]

    def encode_prompt(
        self, tokenizer: Any, messages: list[dict], system: str | None = None, **kw: Any
    ) -> list[int]:
        if len(messages) % 2 != 1:
            raise ValueError("encode_prompt needs a conversation that ends with a user turn")
        return [
            i
            for s, t in self.render_pairs(messages, system, tokenizer, **kw)
            for i in _enc(tokenizer, s) + _enc(tokenizer, t)
        ]

    def fix_tokenizer(self, tokenizer: Any) -> list[str]:
        return fix_special_tokens(tokenizer, self.name, self.stop_words, self.replace_eos)

    def probe(self, tokenizer: Any) -> None:
        """One render before a model loads (`chat`, `api`): a template that runs past the work budget
        or that the sandbox refuses is a ConfigError here, not on every request. What the template
        refuses about this one message (its own raise_exception) is left for real requests."""
        from jinja2.exceptions import TemplateError

        try:
            self.encode_prompt(tokenizer, [{"role": "user", "content": "Hello"}])
        except (TemplateError, ValueError, TypeError):
            pass

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _enc(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
