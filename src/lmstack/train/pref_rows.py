"""Stage dpo's ORPO and CPO/SimPO trainers (TRL's experimental ones, imported only when asked for):
they tokenize with `tokenize_row`; ours turns our pre-tokenized columns into theirs."""

from __future__ import annotations

from typing import Any

from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer

from lmstack.data.encode import IGNORE_INDEX
from lmstack.reliability.trainer import ReliableMixin


class PretokenizedRows:
    """Mixed in before ORPOTrainer / CPOTrainer: prompt_ids / chosen_ids / rejected_ids -> their rows."""

    def tokenize_row(self, feature: dict, model: Any = None) -> dict:
        prompt = list(feature["prompt_ids"])
        out = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
        for kind in ("chosen", "rejected"):
            answer = list(feature[f"{kind}_ids"])
            out[f"{kind}_input_ids"] = prompt + answer
            out[f"{kind}_attention_mask"] = [1] * (len(prompt) + len(answer))
            out[f"{kind}_labels"] = [IGNORE_INDEX] * len(prompt) + answer
        return out


class ReliableORPOTrainer(ReliableMixin, PretokenizedRows, ORPOTrainer):
    """pref_loss: orpo."""


class ReliableCPOTrainer(ReliableMixin, PretokenizedRows, CPOTrainer):
    """pref_loss: simpo."""
