"""Template = data (a YAML file in `builtin/`, see `builtin.py`) + this renderer, LLaMA-Factory's rules.

A conversation is a list of messages with roles alternating user|observation (even positions) and
assistant|function (odd positions). Each message is rendered on its own from the template's slots
(see `slots.py`); the first one also carries the prefix and the system block (system text + tool
text, written whenever there is a system text or a `tools` string, even `"[]"`). A pair of messages
is one turn (source, target): sources are masked in the loss, targets trained; the assistant slot
includes its end-of-turn trailer (e.g. `<|im_end|>\\n` for ChatML), so the model learns to stop.

Encoding follows LLaMA-Factory 0.9.5's `Template`: every slot element is tokenized on its own and
the ids concatenated; `system` falls back to the default system prompt when empty or None;
`system_in_user` templates (LF's `Llama2Template`: llama2, mistral, gemma ...) glue the system text
to the first user message instead of writing a system block.

Efficient-EOS templates (`efficient_eos: true`: glm4, gemma2, gpt_oss ...) print no EOS after an
answer; the caller appends one EOS to the whole sequence and labels the first token of every later
source with EOS (LLaMA-Factory's supervised layout, `lmstack.data.encode.encode_supervised`).

Reasoning templates (`reasoning: true`) and the knobs `enable_thinking`, `preserve_thinking` and
`thinking_style` are described in `THINKING.md` next to this file; the rules are in `reasoning.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from lmstack.templates import reasoning
from lmstack.templates.slots import Piece, Slot, apply, first_text, to_ids, to_text
from lmstack.templates.tools import format_calls, format_tools, parse_calls

USER_ROLES = ("user", "observation")
ASSISTANT_ROLES = ("assistant", "function")
DEFAULT_THOUGHT_WORDS = ("<think>\n", "\n</think>\n\n")
DEFAULT_TOOL_CALL_WORDS = ("<tool_call>", "</tool_call>")

Turn = tuple[list[Piece], list[Piece]]  # (source pieces, target pieces)


@dataclass(frozen=True)
class Template:
    name: str
    format_user: Slot = ("{{content}}",)
    format_assistant: Slot = ("{{content}}{{eos_token}}",)
    format_system: Slot = ("{{content}}",)
    format_observation: Slot | None = None  # None: format_user
    format_function: Slot | None = None  # None: format_assistant
    format_tools: Slot | None = None  # None: the tool_format's tool prompt; else the tools JSON in this slot
    format_prefix: Slot = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    efficient_eos: bool = False
    replace_eos: bool = False
    system_in_user: bool = False  # LF's Llama2Template: the system text opens the first user message
    tool_format: str = "default"
    reasoning: bool = False  # LF's ReasoningTemplate: thoughts removed / empty thoughts inserted
    thought_words: tuple[str, str] = DEFAULT_THOUGHT_WORDS
    empty_thought: str | None = None  # None: the two thought words joined (glm4_7: only the closing one)
    tool_call_words: tuple[str, str] = DEFAULT_TOOL_CALL_WORDS
    thinking_style: str = "llamafactory"  # set by get_template from the config; see reasoning.py
    escape_content: bool = False  # escape_special_tokens_in_content, set by get_template
    description: str = ""
    mm_plugin: str = ""  # vision templates: how <image> becomes the model's image tokens (data/mm.py)

    # ---- one message as pieces (LLaMA-Factory's Template._encode) ---------------------------
    def _tool_text(self, tools: str) -> str:
        if self.format_tools is not None:
            return first_text(self.format_tools, tools)
        return format_tools(self.tool_format, tools)

    def _function_text(self, content: str) -> str:
        if self.system_in_user:  # LF's Llama2Template formats function messages without the markers
            return format_calls(self.tool_format, parse_calls(content))
        open_, close = self.tool_call_words
        block = re.search(f"{re.escape(open_)}(.*?){re.escape(close)}", content, re.DOTALL)
        if block is not None:
            rest = content.replace(block.group(0), "")
            return rest + format_calls(self.tool_format, parse_calls(block.group(1)))
        thought = reasoning.Thoughts(self.thought_words).pattern.search(content)
        if thought is None:
            return format_calls(self.tool_format, parse_calls(content))
        calls = parse_calls(content.replace(thought.group(0), ""))
        return thought.group(0) + format_calls(self.tool_format, calls)

    def _message(self, i: int, message: dict, system: str, tools: str | None) -> list[Piece]:
        pieces: list[Piece] = []
        system_text = ""
        if i == 0:
            pieces += apply(self.format_prefix)
            if system or tools:
                text = system + (self._tool_text(tools) if tools else "")
                if self.system_in_user:
                    system_text = first_text(self.format_system, text)
                else:
                    pieces += apply(self.format_system, text)
        role, content = message["role"], message["content"]
        if role == "user":
            return pieces + apply(self.format_user, content, self.escape_content, lead=system_text)
        if role == "observation":
            return pieces + apply(self.format_observation or self.format_user, content, self.escape_content)
        if role == "function":
            return pieces + apply(self.format_function or self.format_assistant, self._function_text(content))
        return pieces + apply(self.format_assistant, content)

    def _pairs(
        self,
        messages: list[dict],
        system: str | None,
        tools: str | None,
        think: tuple[bool | None, bool, bool],
        oneturn: bool,
    ) -> list[Turn]:
        check_roles(messages)
        inserts: list[reasoning.Insert] = []
        if self.reasoning:
            th = reasoning.Thoughts(self.thought_words)
            enable, preserve, mask_history = think
            if self.thinking_style == "inference":
                messages, inserts = reasoning.inference(th, messages, enable, preserve)
            else:
                messages, inserts = reasoning.llamafactory(
                    th, messages, enable, preserve, mask_history, oneturn
                )
        system = system or self.default_system
        encoded = [self._message(i, m, system, tools) for i, m in enumerate(messages)]
        empty: Piece = (
            "text",
            self.empty_thought if self.empty_thought is not None else "".join(self.thought_words),
        )
        for index, where in inserts:
            encoded[index] = encoded[index] + [empty] if where == "append" else [empty] + encoded[index]
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def _prompt_pairs(
        self,
        messages: list[dict],
        system: str | None,
        tools: str | None,
        think: tuple[bool | None, bool, bool],
    ) -> list[Turn]:
        """A conversation ending with a user turn: LF's oneturn with an empty answer; that answer's
        pieces are dropped (an empty thought meant for it goes with it)."""
        pairs = self._pairs([*messages, {"role": "assistant", "content": ""}], system, tools, think, True)
        return [*pairs[:-1], (pairs[-1][0], [])]

    # ---- public API ---------------------------------------------------------------------------
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
        """(source_text, target_text) per turn as `encode_multiturn` builds them; a conversation that
        ends with a user turn renders as `encode_prompt` does, with '' as the last target."""
        think = (enable_thinking, preserve_thinking, mask_history)
        if len(messages) % 2:
            pairs = self._prompt_pairs(messages, system, tools, think)
        else:
            pairs = self._pairs(messages, system, tools, think, oneturn=False)
        return [(to_text(tokenizer, s), to_text(tokenizer, t)) for s, t in pairs]

    def render(
        self, messages: list[dict], system: str | None = None, tokenizer: Any = None, **kw: Any
    ) -> str:
        """The whole conversation as text (for an odd-length list: ready for generation)."""
        return "".join(s + t for s, t in self.render_pairs(messages, system, tokenizer, **kw))

    def encode_multiturn(
        self,
        tokenizer: Any,
        messages: list[dict],
        system: str | None = None,
        *,
        tools: str | None = None,
        enable_thinking: bool | None = True,
        preserve_thinking: bool = False,
        mask_history: bool = False,
    ) -> list[tuple[list[int], list[int]]]:
        """One (source_ids, target_ids) pair per assistant turn (LF's encode_multiturn; `mask_history`
        is LF's discarding of history thoughts for reasoning templates)."""
        if len(messages) % 2 != 0 or not messages:
            raise ValueError("encode_multiturn needs a conversation that ends with an assistant turn")
        think = (enable_thinking, preserve_thinking, mask_history)
        pairs = self._pairs(messages, system, tools, think, oneturn=False)
        return [(to_ids(tokenizer, s), to_ids(tokenizer, t)) for s, t in pairs]

    def encode_oneturn(
        self,
        tokenizer: Any,
        messages: list[dict],
        system: str | None = None,
        *,
        tools: str | None = None,
        enable_thinking: bool | None = True,
        preserve_thinking: bool = False,
    ) -> tuple[list[int], list[int]]:
        """(prompt_ids, answer_ids): the whole history as the prompt and the last answer (LF's
        encode_oneturn, used for rm/dpo/kto rows)."""
        if len(messages) % 2 != 0 or not messages:
            raise ValueError("encode_oneturn needs a conversation that ends with an assistant turn")
        pairs = self._pairs(messages, system, tools, (enable_thinking, preserve_thinking, False), True)
        prompt = [p for s, t in pairs[:-1] for p in s + t] + pairs[-1][0]
        return to_ids(tokenizer, prompt), to_ids(tokenizer, pairs[-1][1])

    def encode_prompt(
        self,
        tokenizer: Any,
        messages: list[dict],
        system: str | None = None,
        *,
        tools: str | None = None,
        enable_thinking: bool | None = True,
        preserve_thinking: bool = False,
    ) -> list[int]:
        """Ids of a conversation ending in a user turn, followed by the assistant opener."""
        if len(messages) % 2 != 1:
            raise ValueError("encode_prompt needs a conversation that ends with a user turn")
        pairs = self._prompt_pairs(messages, system, tools, (enable_thinking, preserve_thinking, False))
        return to_ids(tokenizer, [p for s, t in pairs for p in s + t])

    def with_tool_format(self, tool_format: str) -> Template:
        """LF's `tool_format` override: that format's tool prompt and calls, and the function slot
        reset to the default answer slot (`{{content}}` + EOS, no EOS for efficient-EOS templates)."""
        slot = ("{{content}}",) if self.efficient_eos else ("{{content}}{{eos_token}}",)
        return replace(self, tool_format=tool_format, format_function=slot, format_tools=None)

    def fix_tokenizer(self, tokenizer: Any) -> list[str]:
        """Make the tokenizer agree with the template; returns log lines saying what changed."""
        return fix_special_tokens(tokenizer, self.name, self.stop_words, self.replace_eos)

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for w in self.stop_words:
            tid = tokenizer.convert_tokens_to_ids(w)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                ids.add(tid)
        return sorted(ids)


def check_roles(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        allowed = USER_ROLES if i % 2 == 0 else ASSISTANT_ROLES
        if m.get("role") not in allowed:
            raise ValueError(
                f"message {i}: role {m.get('role')!r} where {' or '.join(allowed)} is expected "
                "(turns alternate user|observation, assistant|function, starting with user)"
            )


def fix_special_tokens(
    tokenizer: Any, name: str, stop_words: tuple[str, ...], replace_eos: bool
) -> list[str]:
    """LLaMA-Factory's fix-up: stop_words[0] becomes EOS when replace_eos; pad = eos when missing;
    the other stop words become special tokens. Returns log lines saying what changed."""
    notes = []
    words = list(stop_words)
    if replace_eos and words:
        eos = words.pop(0)
        if tokenizer.eos_token != eos:
            added = tokenizer.add_special_tokens({"eos_token": eos})
            notes.append(
                f"template {name}: eos token set to {eos}" + (" (new token: resize_vocab)" if added else "")
            )
    if tokenizer.eos_token_id is None:
        tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
        notes.append(f"template {name}: eos token added: <|endoftext|>")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        notes.append(f"template {name}: pad token set to eos {tokenizer.eos_token}")
    if words:  # registered as special tokens even when already in the vocabulary, as LF does
        missing = [w for w in words if w not in tokenizer.get_vocab()]
        tokenizer.add_special_tokens({"additional_special_tokens": words}, replace_extra_special_tokens=False)
        if missing:
            notes.append(f"template {name}: added stop words as special tokens: {missing}")
    return notes
