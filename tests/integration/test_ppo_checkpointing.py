"""stage: ppo with gradient_checkpointing: true recomputes activations in its updates, as the plan
records (the rollouts generate in eval mode, which never recomputes)."""

from __future__ import annotations

from pathlib import Path

from lmstack.train import ppo
from lmstack.train.run import train

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stages"


def _checkpointing(model) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers' newer name
    return bool(model.is_gradient_checkpointing if flag is None else flag)


def test_ppo_updates_run_checkpointed(base_cfg, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    seen: list[tuple[bool, bool]] = []
    update = ppo.ppo_update

    def spy(cfg, policy, optimizer, scheduler, exp):
        stats = update(cfg, policy, optimizer, scheduler, exp)
        seen.append((_checkpointing(policy.backbone.get_base_model()), policy.training))
        return stats

    monkeypatch.setattr(ppo, "ppo_update", spy)
    run = {
        **base_cfg,
        "stage": "ppo",
        "dataset": "rl_prompts",
        "dataset_dir": str(FIXTURES),
        "reward_funcs": "stage_rewards:target_tokens",
        "cutoff_len": 64,
        "lora_rank": 8,
        "max_new_tokens": 4,
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "ppo_epochs": 1,
        "save_strategy": "no",
        "gradient_checkpointing": True,
    }
    train(None, run)
    assert seen == [(True, True), (True, True)]
