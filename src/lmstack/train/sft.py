"""Stage sft: supervised fine-tuning. tokenizer -> template -> data -> model -> adapter -> train -> save."""

from __future__ import annotations

from lmstack.config.schema import Config
from lmstack.data.packing import pack_dataset, packing_enabled, row_capacity
from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.kernels import apply_training_kernels
from lmstack.models.load import load_model
from lmstack.train import common
from lmstack.train.collators import PackedCollator


def run(cfg: Config) -> dict:
    device, resume = common.start_run(cfg)

    tokenizer, template = common.tokenizer_and_template(cfg)
    data = build_datasets(cfg, tokenizer, template)  # fails here, before the model loads, on bad data
    common.save_template_in_tokenizer(tokenizer, template)
    train_set, eval_set = data.train, data.eval
    collator = common.PadCollator(tokenizer.pad_token_id)
    if packing_enabled(cfg):  # whole samples in rows, position ids restart, no cross-sample attention
        train_set, eval_set = pack_dataset(cfg, data.train), pack_dataset(cfg, data.eval, eval_split=True)
        collator = PackedCollator(tokenizer.pad_token_id, width=row_capacity(cfg))

    args = common.training_arguments(cfg, device)  # before the model: under ZeRO-3 it loads already sharded
    model = load_model(cfg, tokenizer, device)
    apply_training_kernels(cfg, model, device)  # fused linear CE: no [tokens x vocab] logits in training
    common.enable_gradient_checkpointing(cfg, model)
    model = setup_finetuning(cfg, model)

    trainer = common.build_trainer(cfg, model, tokenizer, train_set, eval_set, collator, args)
    return common.train_and_save(cfg, trainer, resume)
