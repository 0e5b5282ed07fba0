"""Stage rm: a reward model on pairwise data — the causal LM (LoRA/freeze/full) + a scalar value head,
trained with TRL's RewardTrainer (Bradley-Terry loss, logs `accuracy` and `margin`).
Outputs: the adapter or weights + `value_head.safetensors` in output_dir and in every checkpoint;
`lmstack.models.value_head.load_reward_model(output_dir).score([...])` loads it back.
tokenizer -> template -> data -> model -> adapter -> value head -> trainer -> train -> save.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trl import RewardConfig, RewardTrainer

from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import apply_speedups, load_model
from lmstack.models.value_head import ValueHeadModel
from lmstack.plan.runplan import RunPlan
from lmstack.reliability.trainer import ReliableMixin
from lmstack.train import common, rlhf

logger = logging.getLogger(__name__)


def run(plan: RunPlan) -> dict:
    cfg = plan.cfg
    resume = common.start_run(plan)

    tokenizer, template = common.tokenizer_and_template(cfg)
    data = build_datasets(cfg, tokenizer, template)  # fails here, before the model loads, on bad data
    train_ds = rlhf.to_dataset(data.train, rows)
    eval_ds = rlhf.to_dataset(data.eval, rows) if data.eval is not None else None
    # the config is built (and its keys checked) before the weights load
    args = rlhf.trl_config(plan, RewardConfig, max_length=cfg.data.cutoff_len, disable_dropout=True)

    backbone = load_model(plan.model_spec(), tokenizer)
    common.enable_gradient_checkpointing(plan, backbone)
    backbone = setup_finetuning(cfg, backbone, lora_kernel=plan.lora_kernel)
    backbone = apply_speedups(
        plan.speedup_spec(), backbone
    )  # FP8 GEMMs, regional compile (plan.fp8 / compile)
    backbone.config.num_labels = 1  # one scalar per sequence (TRL checks it)
    model = ValueHeadModel(backbone)

    trainer = ReliableRewardTrainer(  # staged checkpoints + manifest, SIGTERM save, on_nonfinite
        lmstack_cfg=cfg,
        lmstack_plan=plan.to_dict(),
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        callbacks=common.make_callbacks(cfg),
    )
    return common.train_and_save(plan, trainer, resume, ("accuracy", "margin"))


def rows(row: dict) -> dict:
    """Pairwise rows -> RewardTrainer's pre-tokenized columns (whole prompt+answer sequences)."""
    return {"chosen_ids": row["chosen_input_ids"], "rejected_ids": row["rejected_input_ids"]}


class ValueHeadRewardTrainer(RewardTrainer):
    """RewardTrainer whose saves write the backbone (adapter or weights) + value_head.safetensors."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir or self.args.output_dir
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.accelerator.unwrap_model(self.model).save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        import torch

        torch.save(self.args, Path(output_dir) / "training_args.bin")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Resume: the backbone's adapter or weights + the value head from checkpoint-N."""
        from safetensors.torch import load_file

        ckpt = Path(resume_from_checkpoint)
        model = self.accelerator.unwrap_model(model or self.model)
        if (ckpt / "adapter_model.safetensors").is_file():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model.backbone, load_file(str(ckpt / "adapter_model.safetensors")))
        elif (ckpt / "model.safetensors").is_file():
            model.backbone.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
        else:
            from transformers.modeling_utils import load_sharded_checkpoint

            load_sharded_checkpoint(model.backbone, str(ckpt), strict=False)
        model.load_value_head(ckpt)
        logger.info("resumed the reward model (backbone + value head) from %s", ckpt)


class ReliableRewardTrainer(ReliableMixin, ValueHeadRewardTrainer):
    """What stage rm runs (reliability/trainer.py)."""
