"""Reasoning templates: which thoughts are removed and where an empty thought is inserted.

Each rule takes the conversation (assistant|function at odd positions) and returns the messages to
encode (some thoughts removed) and the insertions of the empty thought: `(index, "append")` puts it
after message `index` (the prompt side: masked), `(index, "prepend")` before message `index` (the
answer side: trained). THINKING.md describes both styles with examples.

`thinking_style: llamafactory` (default), LLaMA-Factory 0.9.5's `ReasoningTemplate`:
- training (`multiturn`): every turn's thought is kept and every answer without one gets an empty
  thought; `enable_thinking: false` first removes them all. With `mask_history` (and not
  `preserve_thinking`) history thoughts are removed and only the last answer gets an empty thought.
- a prompt and one answer (`oneturn`: generation, rm/dpo/kto rows): history thoughts are removed
  unless `preserve_thinking`; only the last answer gets an empty thought.
- the empty thought goes to the answer when `enable_thinking` is true, else (false or null) to the
  prompt.

`thinking_style: inference`, lmstack's own rules, the way a Qwen3-style chat template shows a
conversation at inference, the same for training and prompts: history turns (before the last user
message) lose their thought unless `preserve_thinking` and get no empty thought; `enable_thinking:
false` removes every thought and puts the empty one in the prompt; `enable_thinking: null` inserts none.
"""

from __future__ import annotations

import re
from typing import Literal

Insert = tuple[int, Literal["append", "prepend"]]
STYLES = ("llamafactory", "inference")


class Thoughts:
    """The thought markers of a template."""

    def __init__(self, words: tuple[str, str]):
        self.words = words
        self.pattern = re.compile(f"{re.escape(words[0])}(.*?){re.escape(words[1])}", re.DOTALL)

    def has(self, content: str) -> bool:
        return self.words[0].strip() in content or self.words[1].strip() in content

    def remove(self, content: str) -> str:
        return self.pattern.sub("", content).lstrip("\n")

    def strip(self, messages: list[dict], indices: range | list[int]) -> list[dict]:
        out = list(messages)
        for i in indices:
            out[i] = {**out[i], "content": self.remove(out[i]["content"])}
        return out


def _empty(enable: bool | None, i: int) -> Insert:
    """LF: the empty thought of the answer at `i` goes to the answer when thinking, else the prompt."""
    return (i, "prepend") if enable else (i - 1, "append")


def llamafactory(
    th: Thoughts, messages: list[dict], enable: bool | None, preserve: bool, mask_history: bool, oneturn: bool
) -> tuple[list[dict], list[Insert]]:
    n = len(messages)
    history = range(1, n - 2, 2)  # every answer but the last
    if oneturn:
        if not preserve:
            messages = th.strip(messages, history)
        if enable is False:
            messages = th.strip(messages, [n - 1])
        answers = [n - 1]
    else:
        if enable is False:
            messages = th.strip(messages, range(1, n, 2))
        discard = mask_history and not preserve
        if discard:
            messages = th.strip(messages, history)
        answers = [n - 1] if discard else list(range(1, n, 2))
    return messages, [_empty(enable, i) for i in answers if not th.has(messages[i]["content"])]


def inference(
    th: Thoughts, messages: list[dict], enable: bool | None, preserve: bool
) -> tuple[list[dict], list[Insert]]:
    last_query = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    stripped = [i for i in range(1, len(messages), 2) if enable is False or (not preserve and i < last_query)]
    messages = th.strip(messages, stripped)
    if enable is None:
        return messages, []
    inserts = [
        _empty(enable, i)
        for i in range(1, len(messages), 2)
        if (preserve or i > last_query) and not th.has(messages[i]["content"])
    ]
    return messages, inserts
