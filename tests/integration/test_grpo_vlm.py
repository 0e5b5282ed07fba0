"""GRPO on image prompts (Qwen2.5-VL, Qwen3-VL tiny models, LF's mllm_demo layout): the prompts go through
the sft multimodal plugin (data/mm.py), TRL's vision path feeds the pixels to generation and to every
log-prob forward, the rewards score the completions, and a few real steps train the adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmstack.train.run import train
from media_files import image_demo_dir

TEMPLATES = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl_nothink"}
REWARDS = '''
def even(prompts, completions, completion_ids, **kwargs):
    """The share of even token ids in each answer: varies between answers, so advantages are not 0."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from lmstack.tiny import build_tiny_vision_model

    root = tmp_path_factory.mktemp("tiny_vlm_grpo")
    data = Path(__file__).resolve().parents[2] / "data"
    return {f: build_tiny_vision_model(root / f, f, data_dir=data) for f in TEMPLATES}


def grpo_vlm_run(base_cfg: dict, model: Path, family: str, tmp_path: Path, **over) -> dict:
    rewards = tmp_path / "vl_rewards.py"
    rewards.write_text(REWARDS)
    return {
        **base_cfg,
        "model_name_or_path": str(model),
        "template": TEMPLATES[family],
        "stage": "grpo",
        "dataset": "mllm_demo",
        "dataset_dir": str(image_demo_dir(tmp_path / "data")),
        "cutoff_len": 256,
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_steps": 3,
        "logging_steps": 1,
        "save_strategy": "no",
        "learning_rate": 5e-2,
        "reward_funcs": f"accuracy,{rewards}:even",
        **over,
    }


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_grpo_on_image_prompts_trains_the_adapter(family, tiny_vlm, base_cfg, tmp_path):
    from safetensors.torch import load_file

    run = grpo_vlm_run(base_cfg, tiny_vlm[family], family, tmp_path)
    train(None, run)
    out = Path(run["output_dir"])
    state = json.loads((out / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    assert len(steps) == 3
    for h in steps:
        assert h["loss"] == h["loss"] and abs(h["loss"]) < 1e6  # finite
        assert 0 < h["rewards/even/mean"] <= 1 and 0 <= h["rewards/accuracy/mean"] <= 1
    assert any(h["grad_norm"] > 0 for h in steps)  # the rewards' spread reached the adapter
    lora_b = [t for k, t in load_file(out / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and any(torch.count_nonzero(t) for t in lora_b)  # B starts at 0: the steps moved it
    assert (out / "preprocessor_config.json").is_file()  # the processor loads next to the adapter
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["plan"]["decisions"]["rl"].endswith("rollouts generate")
    assert "image prompts" in manifest["plan"]["reasons"]["rl"]
