"""Data-aware row lengths for unpacked runs (plan/lengths.py): the planner reads the data's own lengths
(tokenized cache, else one real pipeline pass) instead of assuming every row is cutoff_len long."""

from __future__ import annotations

import numpy as np
import pytest

from lmstack.config.load import build_config
from lmstack.data.pipeline import build_datasets
from lmstack.memory import format_table, plan, to_json
from lmstack.models.load import load_tokenizer
from lmstack.plan.from_config import request_from_plan
from lmstack.plan.lengths import bound, data_lengths
from lmstack.plan.whatif import plan_for
from lmstack.templates import get_template


def encoded(cfg):
    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.data.template, tokenizer)
    template.fix_tokenizer(tokenizer)
    return build_datasets(cfg, tokenizer, template).train


def test_unpacked_sft_plans_for_the_longest_row_not_cutoff_len(base_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = build_config({**base_cfg, "cutoff_len": 4096, "max_steps": -1, "num_train_epochs": 1})
    run_plan = plan_for(cfg, 1, 24)
    first = data_lengths(run_plan)  # cold cache: one pipeline pass, which stores the entry
    assert first is not None and "tokenizer pass" in first.source
    real = int(encoded(cfg).lengths("input_ids").max())
    assert first.longest == first.bound == real < 4096
    again = data_lengths(run_plan)  # warm: read from the cache's offsets, no tokenizer
    assert "tokenized cache" in again.source and again.longest == real
    req = request_from_plan(run_plan, 1, 24, lengths=again)
    assert req.seq_len == real and req.worst_seq_len == 4096
    result = plan(req)
    data = to_json(result)["lengths"]
    assert data["seq_len"] == real and data["worst_case_gib"]["total"] > result.configured.estimate.gpu.total
    assert "cutoff_len, the worst case" in format_table(result)


def test_an_entry_with_other_encode_options_is_not_read(base_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    short = build_config({**base_cfg, "cutoff_len": 32})
    encoded(short)  # fills the cache for cutoff_len 32
    long_plan = plan_for(build_config({**base_cfg, "cutoff_len": 2048}), 1, 24)
    assert data_lengths(long_plan, tokenize=False) is None  # no entry for these options: not guessed


def test_pairwise_rows_count_the_longer_of_chosen_and_rejected(base_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = build_config(
        {**base_cfg, "stage": "dpo", "dataset": "dpo_en_demo", "cutoff_len": 4096, "max_steps": -1}
    )
    got = data_lengths(plan_for(cfg, 1, 40))
    rows = encoded(cfg)
    want = int(np.maximum(rows.lengths("chosen_input_ids"), rows.lengths("rejected_input_ids")).max())
    assert got.longest == want


def test_packed_rows_keep_the_row_capacity(base_cfg):
    cfg = build_config({**base_cfg, "packing": True})
    assert data_lengths(plan_for(cfg, 1, 24)) is None


@pytest.mark.parametrize("seen", [1, 16, 200, 10_000])
def test_a_short_run_is_bounded_by_the_rows_it_draws(seen):
    lengths = np.arange(1, 1001)  # 1000 rows of 1..1000 tokens
    got = bound(lengths, seen)
    if seen >= 1000:
        assert got == 1000
    else:  # P(longest of `seen` random rows <= got) >= 95%
        assert (np.mean(lengths <= got)) ** seen >= 0.95 and got <= 1000
    assert bound(lengths, 16) < bound(lengths, 200) <= 1000


def test_grpo_draws_one_prompt_per_num_generations_answers(base_cfg):
    """TRL's RepeatSampler answers each prompt num_generations times and per_device_train_batch_size
    counts answers: 6 steps x 8 answers / 4 generations = 12 distinct prompts, not 48 (the H200 run
    grpo_0.5b_lora_mb8 was predicted with 48 and over-predicted)."""
    from lmstack.plan.lengths import seen_rows

    flat = {**base_cfg, "stage": "grpo", "reward_funcs": "m:f", "max_steps": 6, "per_device_train_batch_size": 8,
            "num_generations": 4, "packing": False}  # fmt: skip
    assert seen_rows(plan_for(build_config(flat), 1, 24), 2000) == 12
    sft = {**base_cfg, "max_steps": 6, "per_device_train_batch_size": 8, "packing": False}
    assert seen_rows(plan_for(build_config(sft), 1, 24), 2000) == 48


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000, 4097])
@pytest.mark.parametrize("seed", [0, 42, 2**33 + 5])
def test_the_replayed_randperm_equals_torchs(n, seed):
    import torch

    from lmstack.plan.lengths import torch_randperm_head

    g = torch.Generator().manual_seed(seed)
    want = torch.randperm(n, generator=g).numpy()
    for head in (1, n // 2 or 1, n):
        assert torch_randperm_head(n, seed, head).tolist() == want[:head].tolist()


@pytest.mark.parametrize(
    "extra",
    [{}, {"val_size": 0.2}, {"disable_shuffling": True}, {"seed": 7, "gradient_accumulation_steps": 2}],
    ids=["shuffled", "val_size", "in_order", "seed_and_accumulation"],
)
def test_a_short_run_is_planned_for_the_rows_the_trainer_really_draws(base_cfg, tmp_path, monkeypatch, extra):
    """A real Trainer run of 3 steps records the padded length of every batch it collates; the planner's
    bound, replayed from the sampler's seed without running anything, equals the longest of them."""
    from lmstack.train import common
    from lmstack.train.run import train

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    flat = {**base_cfg, "cutoff_len": 1024, "max_steps": 3, "per_device_train_batch_size": 2, "packing": False,
            "output_dir": str(tmp_path / "run"), **extra}  # fmt: skip
    drawn: list[int] = []
    collate = common.PadCollator.__call__

    def recording(self, features):
        drawn.extend(len(f["input_ids"]) for f in features)
        return collate(self, features)

    monkeypatch.setattr(common.PadCollator, "__call__", recording)
    train(None, flat)
    steps_rows = 3 * 2 * flat.get("gradient_accumulation_steps", 1)
    assert len(drawn) >= steps_rows  # accelerate's loader collates one batch ahead of the loop
    drawn = drawn[:steps_rows]
    got = data_lengths(plan_for(build_config(flat), 1, 24), tokenize=False)  # the run filled the cache
    assert got is not None and got.exact and got.seen == steps_rows
    assert got.bound == max(drawn), (got, drawn)
    assert "rows the sampler draws" in got.describe()


@pytest.mark.parametrize(
    "extra",
    [{"stage": "dpo", "pref_loss": "sigmoid"}, {"stage": "dpo", "pref_loss": "orpo"}, {"stage": "rm"},
     {"stage": "dpo", "pref_loss": "sigmoid", "val_size": 0.2, "seed": 3}],
    ids=["dpo", "orpo", "rm", "dpo_val_size_seed"],
)  # fmt: skip
def test_a_short_pairwise_run_is_planned_for_the_pairs_the_trainer_really_draws(base_cfg, tmp_path, monkeypatch, extra):
    """Pairwise trainers pad chosen and rejected of a batch to one width, the longest prompt + answer of its
    pairs; a real 3-step run records the width of every step's batch, and the planner's bound, replayed
    from the sampler's seed, equals the widest of them (not the 95% bound on the data's longest pair)."""
    from transformers import Trainer

    from lmstack.train.run import train

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    flat = {**base_cfg, "dataset": "dpo_en_demo", "cutoff_len": 1024, "max_steps": 3, "packing": False,
            "per_device_train_batch_size": 2, "output_dir": str(tmp_path / "run"), **extra}  # fmt: skip
    widths: list[int] = []
    step = Trainer.training_step

    def recording(self, model, inputs, *args, **kwargs):
        widths.append(max(v.shape[-1] for k, v in inputs.items() if k.endswith("input_ids")))
        return step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", recording)
    train(None, flat)
    assert len(widths) == 3
    got = data_lengths(plan_for(build_config(flat), 1, 24), tokenize=False)  # the run filled the cache
    assert got is not None and got.exact and got.seen == 3 * 2
    assert got.bound == max(widths), (got, widths)
    assert got.bound < got.longest  # a bound the SAFE_LEVEL rule would not give
