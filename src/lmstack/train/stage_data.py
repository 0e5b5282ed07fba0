"""The training data exactly as the stage will read it, built by one function for the stage itself
and for the tokenize-once-per-node pass that runs before it under torchrun (so the pass fills the
very cache entry the stage reads)."""

from __future__ import annotations

import logging
from typing import Any

from lmstack.config.schema import Config
from lmstack.data.pipeline import DataBundle, build_datasets
from lmstack.data.stats import WHOLE_TEXT  # the same whole-text cutoff as `lmstack check`
from lmstack.data.tokenized import TokenizedDataset
from lmstack.plan.runplan import RunPlan

logger = logging.getLogger(__name__)


def encode_config(plan: RunPlan) -> Config:
    """The config the data is encoded with: the plan's, except that pt texts on packed rows are
    encoded whole (they are split into cutoff_len pieces afterwards, nothing dropped)."""
    cfg = plan.cfg
    if not plan.split_long_texts:
        return cfg
    return cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"cutoff_len": WHOLE_TEXT, "packing": False})}
    )


def stage_datasets(plan: RunPlan, tokenizer: Any, template: Any) -> DataBundle:
    """Encoded train/eval data (from the cache when valid); pt pieces already split."""
    data = build_datasets(encode_config(plan), tokenizer, template)
    if plan.split_long_texts:
        block = plan.cfg.data.cutoff_len
        data = DataBundle(
            split_long_texts(data.train, block, "train"),
            split_long_texts(data.eval, block, "eval"),
            data.stats,
        )
    return data


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


def tokenize_on_main_first(plan: RunPlan) -> None:
    """No-op in a single process. Otherwise: the main process of each node tokenizes (filling the
    content-keyed cache), everybody meets at a barrier bounded by ddp_timeout, all go on."""
    from lmstack.launch import dist
    from lmstack.train.common import tokenizer_and_template

    cfg = plan.cfg
    if plan.world_size <= 1 or not cfg.data.dataset:
        return
    dist.init_process_group(cfg.training.ddp_timeout, plan.device == "cuda", plan.ctx.local_rank)
    group = dist.barrier_group(cfg.training.ddp_timeout)  # collective: every rank creates it first
    if plan.ctx.is_local_main:
        tokenizer, template = tokenizer_and_template(cfg)  # the same steps as the stages: same cache key
        build_datasets(encode_config(plan), tokenizer, template)
    dist.wait_for_main(cfg.training.ddp_timeout, plan.ctx.rank, group, "tokenizing the datasets")
