"""The trainer of the causal-LM stages (pt, sft): transformers.Trainer made reliable (staged checkpoints
+ manifest, SIGTERM save, on_nonfinite: reliability/trainer.py). Its own module so that importing
lmstack.train.common does not import transformers."""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from lmstack.reliability.trainer import ReliableMixin
from lmstack.train.losses import ReferenceLogitsMixin
from lmstack.train.master_weights import MasterWeightsMixin


class ReliableSFTTrainer(ReliableMixin, MasterWeightsMixin, ReferenceLogitsMixin, Trainer):
    """What stages pt and sft run. `lm_master_weights`: fp32 masters in the optimizer; `lm_asft` with
    `lm_reference`: ASFT's reference logits of every batch (both off unless given)."""

    def __init__(
        self,
        *args: Any,
        lm_master_weights: bool = False,
        lm_asft: bool = False,
        lm_reference: Any = None,
        **kwargs: Any,
    ) -> None:
        self.lm_master_weights, self.lm_asft, self.lm_reference = lm_master_weights, lm_asft, lm_reference
        super().__init__(*args, **kwargs)
