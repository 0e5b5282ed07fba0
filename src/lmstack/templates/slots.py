"""Slots: the string pieces a template is made of, and how they become text and token ids.

A slot is one string or a list of strings (YAML). Each string is an *element*: elements are tokenized
one by one and the ids concatenated, exactly as LLaMA-Factory tokenizes the elements of a formatter's
`slots` list. Inside an element:

    {{content}}      the message text (the first occurrence is replaced, as in LLaMA-Factory)
    {{bos_token}}    the tokenizer's bos id (nothing when the tokenizer has none)
    {{eos_token}}    the tokenizer's eos id (nothing when the tokenizer has none)
    {{token:NAME}}   the id of the token NAME (`convert_tokens_to_ids`; LF's `{"token": NAME}` slot)

The three special forms are elements of their own, so `"{{bos_token}}user\\n{{content}}"` is LF's
`[{"bos_token"}, "user\\n{{content}}"]`.
"""

from __future__ import annotations

import re
from typing import Any

Piece = tuple[
    str, str
]  # ("text" | "content", str) | ("special", "bos_token" | "eos_token") | ("token", name)
Slot = tuple[str, ...]

SPECIAL = re.compile(r"(\{\{bos_token\}\}|\{\{eos_token\}\}|\{\{token:[^{}]+\}\})")
CONTENT = "{{content}}"


def parse_slot(value: Any, where: str) -> Slot:
    """A YAML slot (string or list of strings) as a tuple of elements."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"{where}: a slot is a string or a list of strings, got {value!r}")


def has_content(slot: Slot) -> bool:
    return any(CONTENT in element for element in slot)


def split(slot: Slot) -> list[Piece]:
    """The slot's pieces with `{{content}}` still in the text pieces."""
    out: list[Piece] = []
    for element in slot:
        for part in SPECIAL.split(element):
            if part in ("{{bos_token}}", "{{eos_token}}"):
                out.append(("special", part[2:-2]))
            elif part.startswith("{{token:") and SPECIAL.fullmatch(part):
                out.append(("token", part[len("{{token:") : -2]))
            elif part:
                out.append(("text", part))
    return out


def apply(slot: Slot, content: str = "", escape: bool = False, lead: str = "") -> list[Piece]:
    """The slot filled with `lead + content` (each text piece replaces its first `{{content}}`).
    `escape`: the content is a piece of its own, ("content", text), tokenized with special tokens not
    parsed; `lead` (template markup, e.g. a system block glued to the user turn) stays text."""
    if not escape:
        return [(k, v.replace(CONTENT, lead + content, 1) if k == "text" else v) for k, v in split(slot)]
    out: list[Piece] = []
    for kind, value in split(slot):
        if kind == "text" and CONTENT in value:
            before, after = value.split(CONTENT, 1)
            out += [p for p in (("text", before + lead), ("content", content), ("text", after)) if p[1]]
        else:
            out.append((kind, value))
    return out


def first_text(slot: Slot, content: str) -> str:
    """LF's `formatter.apply(...)[0]` for a slot whose first piece is text (system_in_user templates)."""
    pieces = apply(slot, content)
    return pieces[0][1] if pieces and pieces[0][0] == "text" else ""


def special_text(tokenizer: Any, kind: str) -> str:
    return (getattr(tokenizer, kind, None) or "") if tokenizer is not None else ""


def to_text(tokenizer: Any, pieces: list[Piece]) -> str:
    return "".join(v if k in ("text", "token", "content") else special_text(tokenizer, v) for k, v in pieces)


def to_ids(tokenizer: Any, pieces: list[Piece]) -> list[int]:
    out: list[int] = []
    for kind, value in pieces:
        if kind == "text":
            out += tokenizer.encode(value, add_special_tokens=False) if value else []
        elif kind == "content":  # escaped message text: `<|im_end|>` in it is text, not the token
            out += tokenizer.encode(value, add_special_tokens=False, split_special_tokens=True)
        elif kind == "token":
            out.append(tokenizer.convert_tokens_to_ids(value))
        elif getattr(tokenizer, f"{value}_id", None) is not None:
            out.append(getattr(tokenizer, f"{value}_id"))
    return out
