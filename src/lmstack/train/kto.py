"""Stage kto: Kahneman-Tversky optimisation on unpaired data (one answer + a desirable/undesirable tag)
with TRL's KTOTrainer. `kto_chosen_weight` / `kto_rejected_weight` weigh the two kinds of example.
The KL estimate pairs each prompt with the previous example's answer inside a batch (TRL's scheme),
so the data are shuffled once here with `seed` and then read in order (unless disable_shuffling).
tokenizer -> template -> data -> model -> adapter -> reference -> trainer -> train -> save.
"""

from __future__ import annotations

import logging
import random

from trl import KTOConfig, KTOTrainer

from lmstack.data.encode_pref import split_row
from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import apply_speedups, load_model
from lmstack.plan.runplan import RunPlan
from lmstack.reliability.trainer import ReliableMixin
from lmstack.train import common, rlhf

logger = logging.getLogger(__name__)


def run(plan: RunPlan) -> dict:
    cfg = plan.cfg
    resume = common.start_run(plan)

    tokenizer, template = common.tokenizer_and_template(cfg)
    data = build_datasets(cfg, tokenizer, template)  # fails here, before the model loads, on bad data
    train_rows = list(data.train.to_samples())
    if not cfg.finetuning.disable_shuffling:
        random.Random(cfg.training.seed).shuffle(train_rows)
    train_ds = rlhf.to_dataset(train_rows, columns)
    eval_ds = rlhf.to_dataset(data.eval, columns) if data.eval is not None else None
    desirable = sum(train_ds["label"])
    logger.info("kto data: %d desirable, %d undesirable", desirable, len(train_ds) - desirable)
    ft = cfg.finetuning  # the config is built (and its keys checked) before the weights load
    args = rlhf.trl_config(
        plan,
        KTOConfig,
        beta=ft.pref_beta,
        desirable_weight=ft.kto_chosen_weight,
        undesirable_weight=ft.kto_rejected_weight,
        max_length=None,  # rows are already cut to cutoff_len by our encoder
        train_sampling_strategy="sequential",
    )

    model = load_model(plan.model_spec(), tokenizer)
    common.enable_gradient_checkpointing(plan, model)
    model = setup_finetuning(cfg, model, lora_kernel=plan.lora_kernel)
    model = apply_speedups(plan.speedup_spec(), model)  # FP8 GEMMs, regional compile (plan.fp8 / compile)
    ref_model = rlhf.reference_model(plan, tokenizer)

    trainer = ReliableKTOTrainer(  # staged checkpoints + manifest, SIGTERM save, on_nonfinite
        kl_chunk=cfg.data.preprocessing_batch_size,
        lmstack_cfg=cfg,
        lmstack_plan=plan.to_dict(),
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        callbacks=common.make_callbacks(cfg),
    )
    rlhf.drop_trl_ref_adapter(cfg, trainer.model)
    return common.train_and_save(
        plan, trainer, resume, ("rewards/chosen", "rewards/rejected", "rewards/margins")
    )


def columns(row: dict) -> dict:
    prompt, answer = split_row(row["input_ids"], row["labels"])
    return {"prompt_ids": prompt, "completion_ids": answer, "label": bool(row["kto_tag"])}


class PretokenizedKTOTrainer(KTOTrainer):
    """KTOTrainer fed our rows. The KL completions are paired as LLaMA-Factory pairs them while
    preprocessing — each chunk of `preprocessing_batch_size` rows takes its answers in reverse order —
    not inside each training batch as TRL does, so any per_device_train_batch_size works, 1 included
    (TRL refuses 1 because its in-batch pairing would give every row its own answer)."""

    def __init__(self, *args, kl_chunk: int = 1000, **kwargs):
        self.kl_chunk = kl_chunk  # preprocessing_batch_size; read while TRL's __init__ prepares the data
        targs = kwargs["args"]
        micro = targs.per_device_train_batch_size
        if micro > 1:
            super().__init__(*args, **kwargs)
            return
        targs.per_device_train_batch_size = 2  # passes TRL's in-batch-pairing guard; restored below
        try:
            super().__init__(*args, **kwargs)
        finally:
            targs.per_device_train_batch_size = micro
        self._train_batch_size = targs.train_batch_size

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not self.calculate_KL:
            return dataset

        def add_kl(batch: dict) -> dict:
            batch["KL_completion_ids"] = batch["completion_ids"][::-1]
            return batch

        return dataset.map(add_kl, batched=True, batch_size=self.kl_chunk)


class ReliableKTOTrainer(ReliableMixin, PretokenizedKTOTrainer):
    """What stage kto runs (reliability/trainer.py)."""
