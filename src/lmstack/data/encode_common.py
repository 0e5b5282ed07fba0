"""What every stage's encoder shares: the label mask value, the encode options, the drop signal,
the source/target budget split, the template keyword arguments of an example, and the bound on the
work one record may cost.

Bounded per-record work: before anything is tokenized, each text field (a message's content, the
system prompt) longer than `CHARS_PER_TOKEN` x cutoff_len characters is cut to that many characters,
so a 50 MB record costs what a 4 kB one does. The cut keeps more than cutoff_len tokens of the field
(the kept part is tokenized to check, and grown when a tokenizer packs more characters per token), so
the sample is still a full cutoff_len cut of the record; the pipeline counts the cut fields per dataset.
The kept part is the head of the field, or its tail for the prompt-only stages, which keep the end of
a long prompt. JSON fields (tools, tool calls) cannot be cut: longer than the bound, the record is
dropped. Texts encoded whole (stage pt on packed rows: cutoff_len = a huge value) are never cut; they
are tokenized in pieces of `CHUNK_CHARS` characters, split where a word starts, so memory stays
proportional to the tokens, not to the tokenizer's per-call bookkeeping.

encode.py (sft, pt and the ENCODERS table) and encode_pref.py (rm, dpo, kto, ppo, grpo, rloo) both
import these from here; encode.py imports encode_pref.py for its table, and encode_pref.py imports
nothing from encode.py, so the two modules form no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmstack.config.stages import stage_spec

IGNORE_INDEX = -100
CHARS_PER_TOKEN = 32  # a text field keeps at most this many characters per cutoff_len token
CHUNK_CHARS = 1 << 16  # a long text is tokenized in pieces of at most this many characters
TOO_LONG = "field too long"
IDENTICAL = "chosen and rejected are identical"


@dataclass(frozen=True)
class EncodeOptions:
    stage: str
    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    default_system: str | None = None
    enable_thinking: bool | None = True
    preserve_thinking: bool = False
    bound_tokens: int | None = None  # text fields are cut to CHARS_PER_TOKEN x this (None: cutoff_len)
    media: Any = None  # data.mm.MediaSpec of a vision-language model: <image> becomes its image tokens

    @property
    def field_chars(self) -> int:
        """The characters a text field keeps before tokenizing (at least, see cut_text)."""
        return CHARS_PER_TOKEN * (self.bound_tokens or self.cutoff_len)


class DropExample(ValueError):
    """The example cannot be trained on; counted in the data report by `kind` (default: the reason).
    `field` is the record's field path when one field is to blame (e.g. the empty answer)."""

    def __init__(self, reason: str, field: str | None = None, kind: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.field = field
        self.kind = kind or reason


def infer_seqlen(source_len: int, target_len: int, budget: int) -> tuple[int, int]:
    """Split `budget` tokens between a source and a target (LLaMA-Factory's rule): keep a short target whole,
    else keep a short source whole, else share the budget in proportion to the two lengths."""
    if target_len * 2 < budget:
        max_target = budget
    elif source_len * 2 < budget:
        max_target = budget - source_len
    else:
        max_target = int(budget * target_len / (source_len + target_len))
    new_target = min(max_target, target_len)
    new_source = min(max(budget - new_target, 0), source_len)
    return new_source, new_target


def encode_kwargs(template: Any, example: dict, opts: EncodeOptions) -> dict:
    system = example.get("system")
    if system is None:
        system = opts.default_system
    kwargs: dict = {
        "system": system,
        "enable_thinking": opts.enable_thinking,
        "preserve_thinking": opts.preserve_thinking,
    }
    if example.get("tools"):
        kwargs["tools"] = example["tools"]
    return kwargs


# ---- bounded per-record work --------------------------------------------------------------------
def _word_start(text: str, lo: int, hi: int) -> int:
    """The last point in (lo, hi) where a space follows a non-space (the tokenizers' pre-tokenizers
    split there too, so the parts tokenize as the whole does), else `hi` (inside a long run of
    spaces, or in text without spaces: a character boundary)."""
    i = text.rfind(" ", lo, hi)
    for _ in range(64):
        if i <= lo or not text[i - 1].isspace():
            break
        i = text.rfind(" ", lo, i)
    return i if i > lo and not text[i - 1].isspace() else hi


def text_pieces(text: str, size: int = CHUNK_CHARS) -> list[tuple[int, int]]:
    """(start, end) of consecutive pieces of at most `size` characters covering `text`."""
    out, start = [], 0
    while start < len(text):
        end = len(text) if start + size >= len(text) else _word_start(text, start + size // 2, start + size)
        out.append((start, end))
        start = end
    return out


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """The ids of `text` (no special tokens added), tokenized a piece at a time when it is long."""
    if len(text) <= CHUNK_CHARS:
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids: list[int] = []
    for start, end in text_pieces(text):
        ids += tokenizer.encode(text[start:end], add_special_tokens=False)
    return ids


def _more_tokens_than(tokenizer: Any, text: str, tokens: int) -> bool:
    n = 0
    for start, end in text_pieces(text, min(CHUNK_CHARS, 8 * tokens + 64)):
        n += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        if n > tokens:
            return True
    return False


def cut_text(text: str, chars: int, tokens: int, tokenizer: Any, tail: bool = False) -> str:
    """`text` cut to about `chars` characters (at a word start), grown x4 while the kept part has no
    more than `tokens` tokens; the whole text when it is not longer. `tail`: keep the end instead."""
    while chars < len(text):
        if tail:
            start = len(text) - chars
            kept = text[_word_start(text, start - chars // 2, start) :]
        else:
            kept = text[: _word_start(text, chars // 2, chars)]
        if _more_tokens_than(tokenizer, kept, tokens):
            return kept
        chars *= 4
    return text


def bound_example(example: dict, tokenizer: Any, opts: EncodeOptions) -> tuple[dict, int]:
    """`example` with every text field cut to `opts.field_chars` characters, and how many were cut.
    A JSON field longer than that (tools, a tool call) drops the record: JSON cannot be cut."""
    chars, tokens = opts.field_chars, opts.bound_tokens or opts.cutoff_len
    tail = stage_spec(opts.stage).data == "prompt"
    cut = 0

    def bound(text: str, what: str, json_text: bool = False) -> str:
        nonlocal cut
        if len(text) <= chars:
            return text
        if json_text:
            raise DropExample(
                f"{what}: {len(text)} characters of JSON, more than the {chars} ({CHARS_PER_TOKEN} x "
                "cutoff_len) read before tokenizing, and JSON cannot be cut; shorten it",
                kind=TOO_LONG,
            )
        kept = cut_text(text, chars, tokens, tokenizer, tail)
        cut += len(kept) < len(text)
        return kept

    out = dict(example)
    for key in ("prompt", "response"):
        out[key] = [
            dict(m, content=bound(m["content"], f"{m['role']} message", m["role"] == "function"))
            if len(m["content"]) > chars
            else m
            for m in example[key]
        ]
    if example.get("system"):
        out["system"] = bound(example["system"], "system")
    if example.get("tools"):
        out["tools"] = bound(example["tools"], "tools", json_text=True)
    return out, cut
