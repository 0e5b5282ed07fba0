"""Template = data (a YAML file in `builtin/`) + a small renderer.

A template is a set of string slots with the placeholders `{{content}}`, `{{bos_token}}` and
`{{eos_token}}`. A conversation is a list of messages with roles alternating
user|observation (even positions) and assistant|function (odd positions). Encoding returns one
(source_ids, target_ids) pair per assistant turn; the prefix, the system prompt and the tool list are
folded into the first source. Source tokens are masked in the loss, target tokens are trained — the
assistant slot includes its end-of-turn trailer (e.g. `<|im_end|>\\n` for ChatML), so the model
learns to stop.

Encoding follows LLaMA-Factory: every slot is tokenized on its own (the text pieces of prefix,
system and user are encoded separately and concatenated) and `{{bos_token}}`/`{{eos_token}}` become
the tokenizer's bos/eos ids directly (nothing when the tokenizer has none).

Efficient-EOS families (glm4): the chat format prints no EOS after an answer. LLaMA-Factory keeps
the EOS out of the input ids and instead sets the *label* of the next source's first token to EOS.
lmstack keeps the caller's masking rule (sources masked, targets trained) by appending the EOS id to
every target in `encode_multiturn` and to every history answer in `encode_prompt`, so training and
generation see the same ids; `render` (text) leaves it out, as the family's own format does. The
model learns the same thing — stop with EOS after each answer — with the EOS one position earlier in
the input than LLaMA-Factory puts it. As in LLaMA-Factory, `train_on_prompt` makes no sense here.

Reasoning templates (`reasoning: true`, e.g. qwen3) and the knobs `enable_thinking` /
`preserve_thinking` are described with examples in `THINKING.md` next to this file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from typing import Any

import yaml

from lmstack.config.errors import ConfigError, did_you_mean
from lmstack.templates.tools import TOOL_FORMATS, TOOLS_BEFORE_SYSTEM, format_calls, format_tools

USER_ROLES = ("user", "observation")
ASSISTANT_ROLES = ("assistant", "function")
DEFAULT_THOUGHT_WORDS = ("<think>\n", "\n</think>\n\n")
_SPECIAL = re.compile(r"(\{\{bos_token\}\}|\{\{eos_token\}\})")

Piece = tuple[str, str]  # ("text", str) or ("special", "bos_token" | "eos_token")
Turn = tuple[list[Piece], list[Piece]]  # (source pieces, target pieces)


@dataclass(frozen=True)
class Template:
    name: str
    format_user: str = "{{content}}"
    format_assistant: str = "{{content}}{{eos_token}}"
    format_system: str = "{{content}}"
    format_observation: str | None = None  # None: format_user
    format_function: str | None = None  # None: format_assistant
    format_prefix: str = ""
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    efficient_eos: bool = False
    replace_eos: bool = False
    system_in_user: bool = (
        False  # llama2/mistral/gemma: format_system(system) is prepended to the first user text
    )
    tool_format: str = "default"
    reasoning: bool = False  # qwen3-style: empty thought insertion and history-CoT stripping
    thought_words: tuple[str, str] = DEFAULT_THOUGHT_WORDS
    description: str = ""

    # ---- building turns as pieces ------------------------------------------------------------
    @staticmethod
    def _slot(slot: str, content: str = "") -> list[Piece]:
        out: list[Piece] = []
        for part in _SPECIAL.split(slot):
            if part in ("{{bos_token}}", "{{eos_token}}"):
                out.append(("special", part[2:-2]))
            elif part:
                out.append(("text", part.replace("{{content}}", content)))
        return out

    def _system_text(self, system: str | None, tools: str | None) -> str:
        sys_text = self.default_system if system is None else system
        tool_text = format_tools(self.tool_format, tools) if tools else ""
        if tool_text and not sys_text:
            tool_text = tool_text.lstrip("\n")  # as the official Qwen templates render a tools-only system
        return tool_text + sys_text if self.tool_format in TOOLS_BEFORE_SYSTEM else sys_text + tool_text

    def _source(self, index: int, message: dict, system_text: str) -> list[Piece]:
        pieces: list[Piece] = []
        content = message["content"]
        if index == 0:
            pieces += self._slot(self.format_prefix)
            if system_text and self.system_in_user:
                content = self.format_system.replace("{{content}}", system_text) + content
            elif system_text:
                pieces += self._slot(self.format_system, system_text)
        slot = self.format_user
        if message["role"] == "observation" and self.format_observation is not None:
            slot = self.format_observation
        return pieces + self._slot(slot, content)

    def _target(self, message: dict) -> list[Piece]:
        if message["role"] == "assistant":
            return self._slot(self.format_assistant, message["content"])
        thought, calls = self._split_thought(message["content"])
        slot = self.format_function if self.format_function is not None else self.format_assistant
        return self._slot(slot, thought + format_calls(self.tool_format, calls))

    def _turns(
        self,
        messages: list[dict],
        system: str | None,
        tools: str | None,
        enable_thinking: bool | None,
        preserve_thinking: bool,
        with_eos: bool,
    ) -> list[Turn]:
        check_roles(messages)
        if self.reasoning:
            messages = self._strip_thoughts(messages, enable_thinking, preserve_thinking)
        system_text = self._system_text(system, tools)
        turns: list[Turn] = []
        for i in range(0, len(messages), 2):
            source = self._source(i, messages[i], system_text)
            target = self._target(messages[i + 1]) if i + 1 < len(messages) else []
            if self.efficient_eos and with_eos and i + 1 < len(messages):
                target.append(("special", "eos_token"))
            turns.append((source, target))
        if self.reasoning and enable_thinking is not None:
            self._add_empty_thoughts(messages, turns, enable_thinking, preserve_thinking)
        return turns

    # ---- reasoning ---------------------------------------------------------------------------
    def _thought_re(self) -> re.Pattern:
        open_, close = self.thought_words
        return re.compile(f"{re.escape(open_)}(.*?){re.escape(close)}", re.DOTALL)

    def _split_thought(self, content: str) -> tuple[str, str]:
        match = self._thought_re().search(content)
        if match is None:
            return "", content
        return match.group(0), content.replace(match.group(0), "")

    def has_thought(self, content: str) -> bool:
        return any(w.strip() in content for w in self.thought_words)

    def remove_thought(self, content: str) -> str:
        return self._thought_re().sub("", content).lstrip("\n")

    def _strip_thoughts(
        self, messages: list[dict], enable_thinking: bool | None, preserve: bool
    ) -> list[dict]:
        """History turns (assistant turns before the last user query) lose their CoT unless
        `preserve`; with enable_thinking False every turn does."""
        last_query = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        out = []
        for i, m in enumerate(messages):
            strip = enable_thinking is False or (not preserve and i < last_query)
            if i % 2 == 1 and strip:
                m = {**m, "content": self.remove_thought(m["content"])}
            out.append(m)
        return out

    def _add_empty_thoughts(
        self, messages: list[dict], turns: list[Turn], enable_thinking: bool, preserve: bool
    ) -> None:
        """An empty thought for each current turn without one: into the target (trained) when
        enable_thinking, else into the source (masked). Stripped history turns get none, as the
        official Qwen3 template renders them; the generation prompt gets one only when not thinking."""
        empty: Piece = ("text", "".join(self.thought_words))
        last_query = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        for t, (source, target) in enumerate(turns):
            i = 2 * t + 1
            if i < last_query and not preserve:
                continue
            if i < len(messages) and self.has_thought(messages[i]["content"]):
                continue
            if i >= len(messages):  # generation prompt: the model writes its own thought
                if not enable_thinking:
                    source.append(empty)
            elif enable_thinking:
                target.insert(0, empty)
            else:
                source.append(empty)

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
    ) -> list[tuple[str, str]]:
        """(source_text, target_text) per turn; an odd-length list ends with a source and ''."""
        turns = self._turns(messages, system, tools, enable_thinking, preserve_thinking, with_eos=False)
        return [(_text(tokenizer, s), _text(tokenizer, t)) for s, t in turns]

    def render(
        self,
        messages: list[dict],
        system: str | None = None,
        tokenizer: Any = None,
        *,
        tools: str | None = None,
        enable_thinking: bool | None = True,
        preserve_thinking: bool = False,
    ) -> str:
        """The whole conversation as text (for an odd-length list: ready for generation)."""
        pairs = self.render_pairs(
            messages,
            system,
            tokenizer,
            tools=tools,
            enable_thinking=enable_thinking,
            preserve_thinking=preserve_thinking,
        )
        return "".join(s + t for s, t in pairs)

    def encode_multiturn(
        self,
        tokenizer: Any,
        messages: list[dict],
        system: str | None = None,
        *,
        tools: str | None = None,
        enable_thinking: bool | None = True,
        preserve_thinking: bool = False,
    ) -> list[tuple[list[int], list[int]]]:
        """One (source_ids, target_ids) pair per assistant turn; the list must end with one."""
        if len(messages) % 2 != 0 or not messages:
            raise ValueError("encode_multiturn needs a conversation that ends with an assistant turn")
        turns = self._turns(messages, system, tools, enable_thinking, preserve_thinking, with_eos=True)
        return [(_ids(tokenizer, s), _ids(tokenizer, t)) for s, t in turns]

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
        turns = self._turns(messages, system, tools, enable_thinking, preserve_thinking, with_eos=True)
        return [i for s, t in turns for i in _ids(tokenizer, s) + _ids(tokenizer, t)]

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


def _special(tokenizer: Any, kind: str) -> str | None:
    return getattr(tokenizer, kind, None) if tokenizer is not None else None


def _text(tokenizer: Any, pieces: list[Piece]) -> str:
    return "".join(v if k == "text" else (_special(tokenizer, v) or "") for k, v in pieces)


def _ids(tokenizer: Any, pieces: list[Piece]) -> list[int]:
    out: list[int] = []
    for kind, value in pieces:
        if kind == "text":
            out += tokenizer.encode(value, add_special_tokens=False) if value else []
        elif getattr(tokenizer, f"{value}_id", None) is not None:
            out.append(getattr(tokenizer, f"{value}_id"))
    return out


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
    missing = [w for w in words if w not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": missing}, replace_extra_special_tokens=False
        )
        notes.append(f"template {name}: added stop words as special tokens: {missing}")
    return notes


# ---- the registry: YAML files in builtin/ ---------------------------------------------------
@cache
def _builtin() -> dict[str, dict]:
    out = {}
    for entry in resources.files("lmstack.templates").joinpath("builtin").iterdir():
        if entry.name.endswith(".yaml"):
            data = yaml.safe_load(entry.read_text(encoding="utf-8"))
            out[data["name"]] = data
    return out


def list_templates() -> list[str]:
    return sorted(_builtin())


def _from_data(data: dict) -> Template:
    data = dict(data)
    unknown = set(data) - {f.name for f in fields(Template)}
    if unknown:
        raise ValueError(f"template {data.get('name')!r}: unknown fields {sorted(unknown)}")
    if data.get("tool_format", "default") not in TOOL_FORMATS:
        raise ValueError(
            f"template {data['name']!r}: tool_format {data['tool_format']!r} not in {list(TOOL_FORMATS)}"
        )
    if "format_assistant" not in data:  # LLaMA-Factory's default assistant slot
        data["format_assistant"] = "{{content}}" if data.get("efficient_eos") else "{{content}}{{eos_token}}"
    data["stop_words"] = tuple(data.get("stop_words", ()))
    data["thought_words"] = tuple(data.get("thought_words", DEFAULT_THOUGHT_WORDS))
    return Template(**data)


def builtin_template(name: str) -> Template:
    """A built-in template by name (the YAML files in `builtin/`)."""
    table = _builtin()
    if name not in table:
        raise ConfigError(
            f"template: got {name!r}; known templates: {', '.join(sorted(table))}{did_you_mean(name, table)}"
        )
    return _from_data(table[name])
