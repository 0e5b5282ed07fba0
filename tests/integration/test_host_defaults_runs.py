"""The fast host-side defaults change no result: real tiny LoRA runs (packed rows, LoRA dropout so the
RNG stream matters, two epochs so the workers restart) with the YAML's fields unset, with the values a
CUDA run picks written out (2 data workers, fused AdamW), and with both explicitly off, log the same
loss curve in trainer_log.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.train.run import train


def losses(cfg: dict) -> list[float]:
    train(None, cfg)
    out = Path(cfg["output_dir"])
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def test_fast_defaults_log_the_loss_curve_of_the_plain_settings(base_cfg, tmp_path):
    run = {**base_cfg, "packing": True, "lora_dropout": 0.1, "max_samples": 16, "per_device_train_batch_size": 2, "max_steps": -1,
           "num_train_epochs": 2, "save_strategy": "no"}  # fmt: skip
    unset = losses({**run, "output_dir": str(tmp_path / "unset")})
    cuda_choices = losses({**run, "output_dir": str(tmp_path / "fast"), "dataloader_num_workers": 2,
                           "optim": "adamw_torch_fused"})  # fmt: skip
    off = losses(
        {**run, "output_dir": str(tmp_path / "off"), "dataloader_num_workers": 0, "optim": "adamw_torch"}
    )
    assert len(unset) >= 6 and len(unset) == len(cuda_choices) == len(off)
    # the unset run here is fused AdamW without workers: the workers change nothing, bit for bit
    assert cuda_choices == unset
    # fused against multi-tensor AdamW: the same update, equal up to float rounding
    assert cuda_choices == pytest.approx(off, rel=1e-4)
    saved = (tmp_path / "unset" / "lmstack_config.yaml").read_text()
    assert "optimizer         adamw_torch_fused" in saved and "data_workers      0" in saved
