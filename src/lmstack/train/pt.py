"""Stage pt: continued pre-training on plain text (and the prompt column of alpaca data).

Each text becomes its tokens + EOS, all trained. With `packing` unset or true (the pt default) a text
longer than cutoff_len is split into cutoff_len pieces (nothing dropped), and the pieces are bin-packed
into rows exactly like sft packing: position ids restart per piece and attention never crosses from
one text into another (LLaMA-Factory's concatenate-and-cut lets them see each other). With
`packing: false` every text is one row, cut to cutoff_len (counted as truncated).
tokenizer -> template -> data -> split + pack -> model -> adapter -> trainer -> train -> save.
"""

from __future__ import annotations

import logging

from lmstack.config.schema import Config
from lmstack.data.packing import pack_dataset, row_capacity
from lmstack.data.pipeline import build_datasets
from lmstack.data.tokenized import TokenizedDataset
from lmstack.models.adapters import setup_finetuning
from lmstack.models.kernels import apply_training_kernels
from lmstack.models.load import load_model
from lmstack.train import common
from lmstack.train.collators import PackedCollator

logger = logging.getLogger(__name__)
WHOLE_TEXT = 1 << 30  # cutoff_len used while encoding texts that are split and packed afterwards


def run(cfg: Config) -> dict:
    device, resume = common.start_run(cfg)

    tokenizer, template = common.tokenizer_and_template(cfg)
    packing = cfg.data.packing is not False
    data = build_datasets(encode_config(cfg) if packing else cfg, tokenizer, template)
    train, evals = data.train, data.eval
    collator = common.PadCollator(tokenizer.pad_token_id)
    if packing:
        pack_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"packing": True})})
        train = pack_dataset(pack_cfg, split_long_texts(train, cfg.data.cutoff_len, "train"))
        evals = pack_dataset(pack_cfg, split_long_texts(evals, cfg.data.cutoff_len, "eval"), eval_split=True)
        collator = PackedCollator(tokenizer.pad_token_id, width=row_capacity(pack_cfg))

    args = common.training_arguments(cfg, device)  # before the model: under ZeRO-3 it loads already sharded
    model = load_model(cfg, tokenizer, device)
    apply_training_kernels(cfg, model, device)
    common.enable_gradient_checkpointing(cfg, model)
    model = setup_finetuning(cfg, model)

    trainer = common.build_trainer(cfg, model, tokenizer, train, evals, collator, args)
    return common.train_and_save(cfg, trainer, resume)


def encode_config(cfg: Config) -> Config:
    """The config the texts are encoded with before splitting: whole texts, no sft-style packing."""
    data = cfg.data.model_copy(update={"cutoff_len": WHOLE_TEXT, "packing": False})
    return cfg.model_copy(update={"data": data})


def split_long_texts(dataset: TokenizedDataset | None, block: int, split: str) -> TokenizedDataset | None:
    """Texts longer than `block` tokens become consecutive pieces of at most `block` tokens."""
    if dataset is None:
        return None
    pieces, cut = [], 0
    for i in range(len(dataset)):
        ids = dataset[i]["input_ids"]
        cut += len(ids) > block
        pieces += [
            {"input_ids": ids[a : a + block], "labels": ids[a : a + block]} for a in range(0, len(ids), block)
        ]
    logger.info(
        "pt (%s): %d texts -> %d pieces of at most cutoff_len=%d tokens (%d texts split, none dropped)",
        split,
        len(dataset),
        len(pieces),
        block,
        cut,
    )
    return TokenizedDataset.from_samples(pieces)
