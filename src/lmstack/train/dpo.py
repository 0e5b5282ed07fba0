"""Stage dpo: preference optimisation on pairwise data with TRL's losses.

pref_loss sigmoid (DPO) | hinge | ipo -> trl.DPOTrainer (dpo_label_smoothing > 0 -> TRL's robust DPO;
pref_ftx > 0 adds TRL's "sft" loss with that weight); orpo -> trl.experimental.orpo.ORPOTrainer;
simpo -> trl.experimental.cpo.CPOTrainer(loss_type="simpo"). Our template encodes the rows; the
trainers get them pre-tokenized (their own tokenization step is bypassed, nothing else changes).
tokenizer -> template -> data -> model -> adapter -> reference -> trainer -> train -> save.
"""

from __future__ import annotations

import logging
from typing import Any

from trl import DPOConfig, DPOTrainer

from lmstack.data.mm import media_spec
from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import apply_speedups, load_model
from lmstack.models.vision import load_image_processor, save_processor_files
from lmstack.plan.runplan import RunPlan
from lmstack.reliability.trainer import ReliableMixin
from lmstack.train import common, rlhf

logger = logging.getLogger(__name__)
REFERENCE_FREE = ("orpo", "simpo")


def run(plan: RunPlan) -> dict:
    cfg = plan.cfg
    resume = common.start_run(plan)

    tokenizer, template = common.tokenizer_and_template(cfg)
    data = build_datasets(cfg, tokenizer, template)  # fails here, before the model loads, on bad data
    media = media_spec(cfg)  # a vision model: each pair keeps its image paths, the collator adds the pixels
    columns = (
        rlhf.pairwise_columns
        if media is None
        else lambda r: {**rlhf.pairwise_columns(r), "image_paths": r["images"]}
    )
    train_ds = rlhf.to_dataset(data.train, columns)
    eval_ds = rlhf.to_dataset(data.eval, columns) if data.eval is not None else None
    args = preference_config(plan)  # a key the installed TRL lacks fails here, before the weights load

    model = load_model(plan.model_spec(), tokenizer)
    common.enable_gradient_checkpointing(plan, model)
    model = setup_finetuning(cfg, model, lora_kernel=plan.lora_kernel)
    model = apply_speedups(plan.speedup_spec(), model)  # FP8 GEMMs, regional compile (plan.fp8 / compile)
    loss = cfg.finetuning.pref_loss
    ref_model = rlhf.reference_model(plan, tokenizer, needs_reference=loss not in REFERENCE_FREE)

    trainer = build_trainer(plan, model, ref_model, tokenizer, train_ds, eval_ds, media, args)
    metrics = common.train_and_save(plan, trainer, resume, ("rewards/accuracies", "rewards/margins"))
    if media is not None and trainer.is_world_process_zero():
        save_processor_files(cfg.model.model_name_or_path, cfg.training.output_dir)
    return metrics


def preference_config(plan: RunPlan) -> Any:
    """The TRL config of this pref_loss: DPOConfig, or ORPO/CPO's for the reference-free losses."""
    ft = plan.cfg.finetuning
    if ft.pref_loss in REFERENCE_FREE:  # TRL's experimental trainers, imported only for these
        from lmstack.train.pref_rows import reference_free_config

        return reference_free_config(plan)
    loss_types, weights = [ft.pref_loss], [1.0]
    if ft.dpo_label_smoothing > 0:
        logger.info(
            "dpo_label_smoothing=%s: TRL 1.16 has no label-smoothed sigmoid loss (cDPO); using its robust "
            "DPO loss, the unbiased estimator for the same label-noise rate",
            ft.dpo_label_smoothing,
        )
        loss_types = ["robust"]
    if ft.pref_ftx > 0:
        loss_types, weights = loss_types + ["sft"], weights + [ft.pref_ftx]
    return rlhf.trl_config(
        plan,
        DPOConfig,
        beta=ft.pref_beta,
        loss_type=loss_types,
        loss_weights=weights,
        label_smoothing=ft.dpo_label_smoothing,
        max_length=None,  # rows are already cut to cutoff_len by our encoder
    )


def build_trainer(
    plan: RunPlan,
    model: Any,
    ref_model: Any,
    tokenizer: Any,
    train_ds: Any,
    eval_ds: Any,
    media: Any = None,
    args: Any = None,
) -> Any:
    """The trainer of this pref_loss; `args` from preference_config (built here when not given)."""
    cfg = plan.cfg
    args = preference_config(plan) if args is None else args
    common_kwargs = dict(
        lmstack_cfg=cfg,  # every trainer below has ReliableMixin: staged checkpoints, SIGTERM save, on_nonfinite
        lmstack_plan=plan.to_dict(),
        model=model,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        callbacks=common.make_callbacks(cfg),
    )
    if cfg.finetuning.pref_loss in REFERENCE_FREE:
        from lmstack.train.pref_rows import reference_free_trainer

        return reference_free_trainer(plan, common_kwargs, args)
    if media is not None:  # the pixels of each pair, for the policy and the reference forward
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        from lmstack.data.mm_collate import PreferenceMediaCollator

        inner = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
        image_id = tokenizer.convert_tokens_to_ids(media.tokens[1])
        common_kwargs["data_collator"] = PreferenceMediaCollator(
            inner, media, load_image_processor(cfg), image_id
        )
    trainer = ReliableDPOTrainer(ref_model=ref_model, args=args, **common_kwargs)
    rlhf.drop_trl_ref_adapter(cfg, trainer.model)
    return trainer


class PretokenizedDPOTrainer(DPOTrainer):
    """DPOTrainer fed our rows: prompt_ids / chosen_ids / rejected_ids are already there."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset


class ReliableDPOTrainer(ReliableMixin, PretokenizedDPOTrainer):
    """What stage dpo runs with pref_loss sigmoid / hinge / ipo (reliability/trainer.py)."""
