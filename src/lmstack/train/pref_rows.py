"""Stage dpo's ORPO and CPO/SimPO trainers (TRL's experimental ones, imported only when asked for):
they tokenize with `tokenize_row`; ours turns our pre-tokenized columns into theirs."""

from __future__ import annotations

from typing import Any

from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from lmstack.data.encode import IGNORE_INDEX
from lmstack.plan.runplan import RunPlan
from lmstack.reliability.trainer import ReliableMixin
from lmstack.train import rlhf


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


def reference_free_config(plan: RunPlan) -> Any:
    """pref_loss orpo -> ORPOConfig; simpo -> CPOConfig(loss_type="simpo")."""
    cfg = plan.cfg
    ft = cfg.finetuning
    if ft.pref_loss == "orpo":
        return rlhf.trl_config(plan, ORPOConfig, beta=ft.pref_beta, max_length=cfg.data.cutoff_len)
    return rlhf.trl_config(
        plan,
        CPOConfig,
        loss_type="simpo",
        beta=ft.pref_beta,
        simpo_gamma=ft.simpo_gamma,
        cpo_alpha=ft.pref_ftx,
        max_length=cfg.data.cutoff_len,
    )


def reference_free_trainer(plan: RunPlan, common_kwargs: dict, args: Any) -> Any:
    """pref_loss orpo -> ORPOTrainer; simpo -> CPOTrainer(loss_type="simpo"), with `args` from
    reference_free_config."""
    trainer_cls = ReliableORPOTrainer if plan.cfg.finetuning.pref_loss == "orpo" else ReliableCPOTrainer
    return trainer_cls(args=args, **common_kwargs)
