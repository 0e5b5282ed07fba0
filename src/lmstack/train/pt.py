"""Stage pt: continued pre-training on plain text (and the prompt column of alpaca data).

Each text becomes its tokens + EOS, all trained. With `packing` unset or true (the pt default, as in
LLaMA-Factory) the texts are encoded whole, concatenated in dataset order and cut into rows of exactly
`cutoff_len` tokens; the tail shorter than one row is dropped and its token count logged. Attention
crosses text boundaries inside a row (the usual pre-training packing; the EOS marks the boundary).
With `packing: false` every text is one row, cut to cutoff_len (counted as truncated).
tokenizer -> template -> data -> pack -> model -> adapter -> trainer -> train -> save.
"""

from __future__ import annotations

import logging

import numpy as np

from lmstack.config.schema import Config
from lmstack.data.pipeline import build_datasets
from lmstack.data.tokenized import TokenizedDataset
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import load_model, load_tokenizer
from lmstack.templates import get_template
from lmstack.train import common

logger = logging.getLogger(__name__)
WHOLE_TEXT = 1 << 30  # cutoff_len used while encoding texts that are packed afterwards


def run(cfg: Config) -> dict:
    device = common.device_type(cfg)
    common.check_precision(cfg, device)
    resume = common.prepare_output_dir(cfg)

    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.data.template, tokenizer)
    for note in template.fix_tokenizer(tokenizer):
        logger.info(note)
    packing = cfg.data.packing is not False
    data = build_datasets(encode_config(cfg) if packing else cfg, tokenizer, template)
    train, evals = data.train, data.eval
    if packing:
        train = pack_blocks(train, cfg.data.cutoff_len, "train")
        evals = pack_blocks(evals, cfg.data.cutoff_len, "eval") if evals is not None else None

    model = load_model(cfg, tokenizer, device)
    common.enable_gradient_checkpointing(cfg, model)
    model = setup_finetuning(cfg, model)

    from transformers import Trainer

    trainer = Trainer(
        model=model,
        args=common.training_arguments(cfg, device),
        train_dataset=train,
        eval_dataset=evals,
        data_collator=common.PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=common.make_callbacks(cfg),
    )
    result = trainer.train(resume_from_checkpoint=resume)
    common.save_outputs(cfg, trainer, result)
    logger.info("outputs written to %s", cfg.training.output_dir)
    return dict(result.metrics)


def encode_config(cfg: Config) -> Config:
    """The config the texts are encoded with before packing: whole texts, no sft-style packing."""
    data = cfg.data.model_copy(update={"cutoff_len": WHOLE_TEXT, "packing": False})
    return cfg.model_copy(update={"data": data})


def pack_blocks(dataset: TokenizedDataset, block: int, split: str) -> TokenizedDataset:
    """Concatenate every text (each ends with EOS) and cut into rows of `block` tokens."""
    ids = np.concatenate([np.asarray(dataset[i]["input_ids"], dtype=np.int32) for i in range(len(dataset))])
    rows = len(ids) // block
    dropped = len(ids) - rows * block
    if rows == 0:
        from lmstack.config.errors import DataError

        raise DataError(
            f"cutoff_len: the {split} texts hold {len(ids)} tokens, less than one packed row of "
            f"{block}; lower cutoff_len, add text, or set packing: false"
        )
    logger.info(
        "pt packing (%s): %d texts, %d tokens -> %d rows of cutoff_len=%d; %d tail tokens dropped",
        split,
        len(dataset),
        len(ids),
        rows,
        block,
        dropped,
    )
    blocks = ids[: rows * block].reshape(rows, block).tolist()
    return TokenizedDataset.from_samples([{"input_ids": b, "labels": b} for b in blocks])
