"""What every stage's encoder shares: the label mask value, the encode options, the drop signal,
the source/target budget split and the template keyword arguments of an example.

encode.py (sft, pt and the ENCODERS table) and encode_pref.py (rm, dpo, kto, ppo, grpo, rloo) both
import these from here; encode.py imports encode_pref.py for its table, and encode_pref.py imports
nothing from encode.py, so the two modules form no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IGNORE_INDEX = -100


@dataclass(frozen=True)
class EncodeOptions:
    stage: str
    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    default_system: str | None = None
    enable_thinking: bool | None = True
    preserve_thinking: bool = False


class DropExample(ValueError):
    """The example cannot be trained on; counted in the data report by `kind` (default: the reason).
    `field` is the record's field path when one field is to blame (e.g. the empty answer)."""

    def __init__(self, reason: str, field: str | None = None, kind: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.field = field
        self.kind = kind or reason


def infer_seqlen(source_len: int, target_len: int, budget: int) -> tuple[int, int]:
    """Split `budget` tokens between a source and a target (REFERENCE §3.4): keep a short target whole,
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
