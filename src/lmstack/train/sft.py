"""Stage sft: supervised fine-tuning. tokenizer -> template -> data -> model -> adapter -> train -> save."""

from __future__ import annotations

import logging

from lmstack.config.schema import Config
from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import load_model, load_tokenizer
from lmstack.templates import get_template
from lmstack.train import common

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

    model = load_model(cfg, tokenizer, device)
    common.enable_gradient_checkpointing(cfg, model)
    model = setup_finetuning(cfg, model)

    from transformers import Trainer

    args = common.training_arguments(cfg, device)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=common.PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=common.make_callbacks(cfg),
    )
    result = trainer.train(resume_from_checkpoint=resume)
    common.save_outputs(cfg, trainer, result)
    logger.info("outputs written to %s", cfg.training.output_dir)
    return dict(result.metrics)
