"""use_unsloth_gc: true trains exactly like plain gradient checkpointing (the layer inputs only wait in
CPU RAM meanwhile): same loss curve, same final LoRA weights (CPU, fp32, tight tolerance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmstack.train.run import train


@pytest.fixture
def spy(monkeypatch):
    """The trained model the sft stage hands to the Trainer."""
    from lmstack.train import optimizers

    seen: dict = {}
    real = optimizers.create_optimizer

    def recording(cfg, model, args):
        seen["model"] = model
        return real(cfg, model, args)

    monkeypatch.setattr(optimizers, "create_optimizer", recording)
    return seen


def run(base_cfg, tmp_path: Path, name: str, **over) -> tuple[list[float], dict[str, torch.Tensor]]:
    out = tmp_path / name
    train(None, {**base_cfg, "output_dir": str(out), "max_steps": 3, **over})
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("loss") is not None], load_file(
        out / "adapter_model.safetensors"
    )


@pytest.mark.parametrize("reentrant", [True, False])
def test_offloaded_checkpointing_trains_like_plain_checkpointing(base_cfg, tmp_path, spy, reentrant):
    plain_loss, plain_w = run(
        base_cfg, tmp_path, "plain", gradient_checkpointing=True, use_reentrant_gc=reentrant
    )
    off_loss, off_w = run(base_cfg, tmp_path, "offload", use_unsloth_gc=True, use_reentrant_gc=reentrant)
    layers = [m for m in spy["model"].modules() if getattr(m, "gradient_checkpointing", False)]
    funcs = {m._gradient_checkpointing_func for m in layers}
    assert len(funcs) == 1  # every decoder layer runs the one offloading checkpoint function
    assert next(iter(funcs)).offloader.packed > 0  # and its pack hook parked their inputs
    assert len(plain_loss) == len(off_loss) == 3
    assert off_loss == pytest.approx(plain_loss, rel=1e-5)
    assert plain_w.keys() == off_w.keys() and plain_w
    for name, w in plain_w.items():
        torch.testing.assert_close(off_w[name], w, rtol=1e-5, atol=1e-6, msg=name)
