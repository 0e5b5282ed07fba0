"""Constrained decoding for `response_format: {"type": "json_object"}` (and forced tool arguments).

A character-level JSON state machine (`feed`) says whether a text can still become one JSON object;
`distance` is how many characters at least finish it (closing quotes, brackets, a digit). At each step
a token is allowed when its text keeps the reply a valid JSON prefix AND the characters still needed
afterwards fit in the tokens left (`JsonVocab.allowed`), so a reply that stops at `max_tokens` is
still a complete object whenever `max_tokens` >= 2 (the vocabulary has single-character tokens for
`"`, `}`, `]` and digits, as every byte-level tokenizer does). The reply ends when the object closes.
No whitespace is produced outside strings; tokens whose text is not whole UTF-8 are never chosen.

State: `(stack, mode)`, `stack` a string of open containers (`o` object, `a` array), `mode` a tuple.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

State = tuple[str, tuple]
START: State = ("", ("start",))
DONE_MODE = ("done",)
INVALID = 1 << 30
_ESCAPES = set('"\\/bfnrt')
_HEX = set("0123456789abcdefABCDEF")
_NUMBER_END = {"0", "int", "frac", "exp"}  # number states that may end here


def _value(stack: str, c: str) -> State | None:
    """`c` starting a value."""
    if c == "{":
        return stack + "o", ("key_or_end",)
    if c == "[":
        return stack + "a", ("value_or_end",)
    if c == '"':
        return stack, ("s", False)
    if c == "-":
        return stack, ("n", "-")
    if c == "0":
        return stack, ("n", "0")
    if "1" <= c <= "9":
        return stack, ("n", "int")
    for word in ("true", "false", "null"):
        if c == word[0]:
            return stack, ("l", word[1:])
    return None


def _after(stack: str) -> State:
    return (stack, ("after",)) if stack else (stack, DONE_MODE)


def _number(stack: str, sub: str, c: str) -> State | None:
    digit = "0" <= c <= "9"
    if sub == "-":
        return (stack, ("n", "0" if c == "0" else "int")) if digit else None
    if sub in ("0", "int"):
        if digit and sub == "int":
            return stack, ("n", "int")
        if c == ".":
            return stack, ("n", ".")
        if c in "eE":
            return stack, ("n", "e")
        return None
    if sub in (".", "frac"):
        if digit:
            return stack, ("n", "frac")
        return (stack, ("n", "e")) if sub == "frac" and c in "eE" else None
    if sub == "e":
        if c in "+-":
            return stack, ("n", "es")
        return (stack, ("n", "exp")) if digit else None
    return (stack, ("n", "exp")) if digit else None  # es, exp


def feed_char(state: State, c: str) -> State | None:
    stack, mode = state
    kind = mode[0]
    if kind == "s":
        if c == '"':
            return (stack, ("colon",)) if mode[1] else _after(stack)
        if c == "\\":
            return stack, ("esc", mode[1])
        return None if ord(c) < 0x20 else state
    if kind == "esc":
        if c == "u":
            return stack, ("u", mode[1], 4)
        return (stack, ("s", mode[1])) if c in _ESCAPES else None
    if kind == "u":
        if c not in _HEX:
            return None
        return (stack, ("s", mode[1])) if mode[2] == 1 else (stack, ("u", mode[1], mode[2] - 1))
    if kind == "start":
        return ("o", ("key_or_end",)) if c == "{" else None
    if kind in ("key_or_end", "key"):
        if c == '"':
            return stack, ("s", True)
        return _after(stack[:-1]) if c == "}" and kind == "key_or_end" else None
    if kind == "colon":
        return (stack, ("value",)) if c == ":" else None
    if kind == "value":
        return _value(stack, c)
    if kind == "value_or_end":
        return _after(stack[:-1]) if c == "]" else _value(stack, c)
    if kind == "n":
        nxt = _number(stack, mode[1], c)
        if nxt is not None or mode[1] not in _NUMBER_END:
            return nxt
        return feed_char(_after(stack), c)  # the number ended; `c` follows it
    if kind == "l":
        if c != mode[1][0]:
            return None
        return (stack, ("l", mode[1][1:])) if len(mode[1]) > 1 else _after(stack)
    if kind == "after":
        top = stack[-1]
        if c == ",":
            return stack, ("key",) if top == "o" else ("value",)
        if c == ("}" if top == "o" else "]"):
            return _after(stack[:-1])
        return None
    return None  # done: nothing may follow


def feed(state: State, text: str) -> State | None:
    for c in text:
        state = feed_char(state, c)
        if state is None:
            return None
    return state


def distance(state: State) -> int:
    """The fewest characters that complete the object from `state`."""
    stack, mode = state
    kind = mode[0]
    extra = {
        "start": 2,  # {}
        "key": 4,  # "":0
        "colon": 2,  # :0
        "value": 1,  # 0
    }.get(kind, 0)
    if kind == "s":
        extra = 1 + (2 if mode[1] else 0)  # " then :0 for a key
    elif kind == "esc":
        extra = 2 + (2 if mode[1] else 0)
    elif kind == "u":
        extra = mode[2] + 1 + (2 if mode[1] else 0)
    elif kind == "n":
        extra = 0 if mode[1] in _NUMBER_END else 1
    elif kind == "l":
        extra = len(mode[1])
    return len(stack) + extra


def is_done(state: State) -> bool:
    return state[1] == DONE_MODE


class JsonVocab:
    """Per-tokenizer tables: each token's text, and per state the distance after each token
    (INVALID where the token breaks the JSON), cached for the most recent `max_states` states."""

    def __init__(self, tokenizer: Any, max_states: int = 4096):
        self.texts = token_texts(tokenizer)
        self._by_first: dict[str, list[int]] = {}
        for tid, text in enumerate(self.texts):
            if text:
                self._by_first.setdefault(text[0], []).append(tid)
        self.max_states = max_states
        self._cache: OrderedDict[State, Any] = OrderedDict()

    def distances_after(self, state: State) -> Any:
        import torch

        cached = self._cache.get(state)
        if cached is not None:
            self._cache.move_to_end(state)
            return cached
        out = [INVALID] * len(self.texts)
        for first, tokens in self._by_first.items():
            after_first = feed_char(state, first)
            if after_first is None:  # every token starting with this character breaks the JSON
                continue
            for tid in tokens:
                nxt = feed(after_first, self.texts[tid][1:])
                if nxt is not None:
                    out[tid] = distance(nxt)
        table = torch.tensor(out, dtype=torch.int64)
        self._cache[state] = table
        if len(self._cache) > self.max_states:
            self._cache.popitem(last=False)
        return table

    def allowed(self, state: State, tokens_left: int) -> Any:
        """Bool mask over the vocabulary: tokens that keep the JSON valid and completable within the
        `tokens_left` tokens that remain after this one (all valid tokens when none fits)."""
        table = self.distances_after(state)
        mask = table <= max(tokens_left, 0)
        if not bool(mask.any()):
            mask = table < INVALID
        return mask


def token_texts(tokenizer: Any) -> list[str | None]:
    """Each token's text as it reads inside a longer text (decoded after a base token, so word-start
    markers become spaces); None for special tokens and tokens that are not whole UTF-8."""
    base = tokenizer.encode("a", add_special_tokens=False)
    base_text = tokenizer.decode(base)
    special = set(tokenizer.all_special_ids)
    texts: list[str | None] = []
    for tid in range(len(tokenizer)):
        if tid in special:
            texts.append(None)
            continue
        text = tokenizer.decode([*base, tid])
        text = text[len(base_text) :] if text.startswith(base_text) else None
        texts.append(text if text and "\ufffd" not in text else None)
    return texts
