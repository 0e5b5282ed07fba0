"""The trainer of the causal-LM stages (pt, sft): transformers.Trainer made reliable (staged checkpoints
+ manifest, SIGTERM save, on_nonfinite: reliability/trainer.py). Its own module so that importing
lmstack.train.common does not import transformers."""

from __future__ import annotations

from transformers import Trainer

from lmstack.reliability.trainer import ReliableMixin


class ReliableSFTTrainer(ReliableMixin, Trainer):
    """What stages pt and sft run (with the method optimizer, master weights or ASFT layered on)."""
