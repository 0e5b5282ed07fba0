"""Packing without contamination: packed rows give exactly the per-sample results of unpacked training."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lmstack.config.errors import ConfigError
from lmstack.data.packing import PackedDataset, pack_bins, round_rows
from lmstack.data.tokenized import TokenizedDataset
from lmstack.train.collators import PackedCollator
from lmstack.train.run import train

LENGTHS = (9, 17, 6, 13)


def _samples(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = [-100] * (n // 3) + ids[n // 3 :]  # a masked "prompt" then trained tokens
        out.append({"input_ids": ids, "labels": labels})
    return out


def _model(tiny_model, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    return model.eval()


def _packed_batch(samples, width=None, pad_id=0):
    data = TokenizedDataset.from_samples(samples)
    packed = PackedDataset(data, capacity=sum(len(s["input_ids"]) for s in samples) + 8)
    assert len(packed) == 1
    row = packed[0]
    order = packed.bins[0]
    return PackedCollator(pad_id, width=width)([row]), order


def _segments(order, samples):
    start = 0
    for i in order:
        n = len(samples[i]["input_ids"])
        yield i, slice(start, start + n)
        start += n


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_separate_samples(tiny_model, attn):
    model = _model(tiny_model, attn)
    vocab = model.config.vocab_size
    samples = _samples(vocab)
    batch, order = _packed_batch(samples, width=64)
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        packed_loss = model(**batch).loss
        total, count = 0.0, 0
        for i, seg in _segments(order, samples):
            ids = torch.tensor([samples[i]["input_ids"]])
            labels = torch.tensor([samples[i]["labels"]])
            alone = model(input_ids=ids)
            torch.testing.assert_close(packed_logits[seg], alone.logits[0], atol=1e-5, rtol=1e-5)
            n = int((labels[0, 1:] != -100).sum())
            loss = model(input_ids=ids, labels=labels).loss  # per-sample loss, unpacked
            packed_sample_loss = torch.nn.functional.cross_entropy(
                packed_logits[seg][:-1], labels[0, 1:], ignore_index=-100
            )
            torch.testing.assert_close(packed_sample_loss, loss, atol=1e-5, rtol=1e-5)
            total, count = total + loss.item() * n, count + n
    # the packed row's loss is the mean over exactly the tokens unpacked training trains on
    assert abs(packed_loss.item() - total / count) < 1e-5


def test_packed_sample_cannot_see_its_neighbour(tiny_model):
    """Changing the first sample of a row must leave every later sample's logits unchanged; the control
    (positions that do not restart = a contaminated row) shows the check would catch leakage."""
    model = _model(tiny_model, "sdpa")
    samples = _samples(model.config.vocab_size, lengths=(12, 10))
    batch, order = _packed_batch(samples)
    first, second = list(_segments(order, samples))
    changed = batch["input_ids"].clone()
    changed[0, first[1]] = (changed[0, first[1]] + 7) % model.config.vocab_size
    with torch.no_grad():
        a = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, second[1]]
        b = model(input_ids=changed, position_ids=batch["position_ids"]).logits[0, second[1]]
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        plain = torch.arange(changed.shape[1])[None]  # no restart: one long sequence, contaminated
        leak_a = model(input_ids=batch["input_ids"], position_ids=plain).logits[0, second[1]]
        leak_b = model(input_ids=changed, position_ids=plain).logits[0, second[1]]
    assert (leak_a - leak_b).abs().max() > 1e-3


def test_packing_rows_and_labels():
    lengths = np.random.default_rng(0).integers(1, 60, size=300)
    bins = pack_bins(lengths, 64, seed=3)
    assert bins == pack_bins(lengths, 64, seed=3)  # deterministic
    assert sorted(i for b in bins for i in b) == list(range(300))  # every sample exactly once
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= int(np.ceil(lengths.sum() / 64 * 1.05)) + 1  # best-fit decreasing packs tightly
    with pytest.raises(ValueError, match="longer than the row capacity"):
        pack_bins([70], 64)
    rounded = round_rows(bins, 8)  # every micro-batch full: static shapes, nothing dropped
    assert len(rounded) % 8 == 0 and sorted(i for b in rounded for i in b) == list(range(300))
    assert round_rows([[0], [1], [2]], 2) == [[0], [1], [2], []]  # no row to split: one empty row
    samples = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    row = PackedDataset(TokenizedDataset.from_samples(samples), capacity=8)[0]
    assert row["input_ids"] == [5, 6, 7, 8, 9]
    assert row["position_ids"] == [0, 1, 2, 0, 1]
    assert row["labels"] == [-100, 6, 7, -100, 9]  # the next sample's first token is never a target
    batch = PackedCollator(pad_id=0, width=8)([row])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]  # padding is its own segment
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100]]


def _one_sgd_step(base_cfg, out: Path, **extra) -> tuple[dict, dict]:
    cfg = {
        **base_cfg,
        "finetuning_type": "full",
        "max_samples": 12,
        "cutoff_len": 64,
        "optim": "sgd",
        "learning_rate": 1.0,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "max_steps": 1,
        "save_strategy": "no",
        "output_dir": str(out),
        **extra,
    }
    metrics = train(None, cfg)
    return metrics, load_file(out / "model.safetensors")


def test_packed_training_step_equals_unpacked(base_cfg, tiny_model, tmp_path):
    """fp32 full fine-tuning, one SGD step over the same 12 samples: unpacked as one padded batch,
    packed as rows of 128 tokens in micro-batches of 2 with gradient accumulation. Same loss, same
    gradient (= the weight update at lr 1)."""
    from lmstack.config.load import load_config
    from lmstack.data.packing import pack_dataset
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.load import load_tokenizer
    from lmstack.templates import get_template

    plain_metrics, plain = _one_sgd_step(base_cfg, tmp_path / "plain", per_device_train_batch_size=12)
    packed_cfg = {"packing": True, "per_device_train_batch_size": 2, "max_tokens_per_batch": 256}
    cfg = load_config(None, {**base_cfg, "max_samples": 12, "cutoff_len": 64, **packed_cfg})
    tokenizer = load_tokenizer(cfg)
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan

    plan = RunPlan.resolve(cfg, LaunchContext())
    rows = len(
        pack_dataset(build_datasets(cfg, tokenizer, get_template("qwen", tokenizer)).train, plan.pack_spec())
    )
    assert 2 < rows < 12  # several samples share rows, and there are several micro-batches
    packed_metrics, packed = _one_sgd_step(
        base_cfg, tmp_path / "packed", gradient_accumulation_steps=-(-rows // 2), **packed_cfg
    )
    before = load_file(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(before[k], plain[k]) for k in before)
    for key in before:
        torch.testing.assert_close(packed[key], plain[key], atol=1e-5, rtol=1e-4, msg=key)
    assert abs(packed_metrics["train_loss"] - plain_metrics["train_loss"]) < 1e-5
    log = json.loads((tmp_path / "packed" / "trainer_state.json").read_text())
    assert log["global_step"] == 1


def test_packed_lora_run_learns(base_cfg):
    cfg = {**base_cfg, "packing": True, "max_steps": 12, "cutoff_len": 96, "per_device_train_batch_size": 2}
    train(None, {**cfg, "val_size": 0.1, "do_eval": True, "per_device_eval_batch_size": 3})
    out = Path(cfg["output_dir"])
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] > 0  # packed eval rows
    losses = [
        r["loss"]
        for r in map(json.loads, (out / "trainer_log.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.parametrize(
    "change,pattern",
    [
        ({"max_tokens_per_batch": 512}, r"max_tokens_per_batch: needs packing: true"),
        (
            {"packing": True, "max_tokens_per_batch": 100, "per_device_train_batch_size": 2},
            r"max_tokens_per_batch: 100 tokens over per_device_train_batch_size: 2 rows gives 50-token "
            r"rows, shorter than cutoff_len: 128",
        ),
    ],
)
def test_packing_config_errors_before_model_load(base_cfg, monkeypatch, change, pattern):
    import lmstack.train.sft as sft

    monkeypatch.setattr(sft, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(ConfigError, match=pattern):
        train(None, {**base_cfg, **change})


@pytest.mark.gpu
def test_flex_attention_packed_row_on_gpu(tiny_model):
    """The GPU path: flex_attention builds a document-causal BlockMask from the position resets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="flex_attention"
    ).cuda()
    model.config.use_cache = False
    samples = _samples(model.config.vocab_size, lengths=(40, 70, 25))
    batch, order = _packed_batch(samples, width=256)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"].cuda(), position_ids=batch["position_ids"].cuda()).logits[
            0
        ]
        for i, seg in _segments(order, samples):
            alone = model(input_ids=torch.tensor([samples[i]["input_ids"]]).cuda()).logits[0]
            torch.testing.assert_close(logits[seg], alone, atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
def test_packed_sft_run_on_gpu_uses_flex_and_fused_ce(base_cfg, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="lmstack")
    cfg = {**base_cfg, "packing": True, "bf16": True, "max_steps": 6, "per_device_train_batch_size": 2}
    train(None, cfg)
    text = caplog.text
    assert "attention flex_attention" in text
    assert "fused cross-entropy: lmstack's chunked linear CE" in text or "Liger kernels applied" in text
