"""early_stopping_steps (LF's patience in evaluation rounds) with load_best_model_at_end: a tiny run
whose eval loss stops improving stops early, keeps the best checkpoint through save_total_limit
rotation and ends with the best weights loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmstack.train.run import train


@pytest.mark.parametrize("limit", [1, 2])
def test_early_stopping_keeps_and_loads_the_best_checkpoint(base_cfg, limit):
    cfg = {
        **base_cfg,
        "cutoff_len": 64,
        "max_samples": 48,
        "val_size": 8,
        "learning_rate": 0.05,  # high: the eval loss bounces after a few steps
        "max_steps": 40,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_steps": 2,
        "save_total_limit": limit,
        "load_best_model_at_end": True,
        "early_stopping_steps": 2,
    }
    train(None, cfg)
    out = Path(cfg["output_dir"])
    state = json.loads((out / "trainer_state.json").read_text())
    evals = {h["step"]: h["eval_loss"] for h in state["log_history"] if "eval_loss" in h}
    best_step = min(evals, key=evals.get)
    assert state["global_step"] < 40  # stopped early
    # patience 2: the two evaluations after the best were no better, and training stopped at the second
    assert state["global_step"] == best_step + 2 * 2 == max(evals)
    assert state["best_global_step"] == best_step and state["best_metric"] == evals[best_step]
    assert state["best_model_checkpoint"] == str(out / f"checkpoint-{best_step}")  # not the staging folder
    # rotation never deletes the best one: save_total_limit: 1 keeps only it (transformers drops the
    # newest at the end), 2 keeps it and the newest
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    newest = [] if limit == 1 else [f"checkpoint-{state['global_step']}"]
    assert kept == sorted([f"checkpoint-{best_step}", *newest])
    final = load_file(out / "adapter_model.safetensors")
    best = load_file(out / f"checkpoint-{best_step}" / "adapter_model.safetensors")
    assert final.keys() == best.keys()
    for key in final:
        torch.testing.assert_close(final[key], best[key], rtol=0, atol=0, msg=key)
