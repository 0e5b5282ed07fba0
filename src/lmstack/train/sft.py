"""Stage sft: supervised fine-tuning. tokenizer -> template -> data -> model -> adapter -> train -> save."""

from __future__ import annotations

import logging

from lmstack.config.schema import Config
from lmstack.data.packing import pack_dataset, packing_enabled, row_capacity
from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.kernels import apply_training_kernels
from lmstack.models.load import load_model, load_tokenizer
from lmstack.templates import get_template
from lmstack.train import common
from lmstack.train.collators import PackedCollator
from lmstack.train.optimizers import create_optimizer, method_callbacks

logger = logging.getLogger(__name__)


def run(cfg: Config) -> dict:
    device = common.device_type(cfg)
    common.check_precision(cfg, device)
    resume = common.prepare_output_dir(cfg)

    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.data.template, tokenizer)
    for note in template.fix_tokenizer(tokenizer):
        logger.info(note)
    data = build_datasets(cfg, tokenizer, template)  # fails here, before the model loads, on bad data
    common.save_template_in_tokenizer(tokenizer, template)
    train_set, eval_set = data.train, data.eval
    collator = common.PadCollator(tokenizer.pad_token_id)
    if packing_enabled(cfg):  # whole samples in rows, position ids restart, no cross-sample attention
        train_set, eval_set = pack_dataset(cfg, data.train), pack_dataset(cfg, data.eval, eval_split=True)
        collator = PackedCollator(tokenizer.pad_token_id, width=row_capacity(cfg))

    model = load_model(cfg, tokenizer, device)
    apply_training_kernels(cfg, model, device)  # fused linear CE: no [tokens x vocab] logits in training
    common.enable_gradient_checkpointing(cfg, model)
    model = setup_finetuning(cfg, model)

    from transformers import Trainer

    from lmstack.reliability.trainer import reliable

    args = common.training_arguments(cfg, device)
    trainer = reliable(Trainer)(  # staged checkpoints + manifest, SIGTERM save, on_nonfinite
        lmstack_cfg=cfg,
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=common.make_callbacks(cfg) + method_callbacks(cfg),
        optimizers=(create_optimizer(cfg, model, args), None),  # None: the Trainer builds it from `optim`
    )
    result = trainer.train(resume_from_checkpoint=resume)
    common.save_outputs(cfg, trainer, result)
    logger.info("outputs written to %s", cfg.training.output_dir)
    return dict(result.metrics)
